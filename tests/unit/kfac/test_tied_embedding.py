"""An embedding tied to its output layer: one weight preconditioned with the nearest Kronecker product of both uses'
terms. Against a float64 reference written from the definitions (each use's factors from its rows, the nearest
Kronecker product from the SVD of the rearranged sum, a dense Kronecker solve); 2 workers equal one; the cases
that stay untied; the summary, a checkpoint, update fusion."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_reference import factors, one_hot_rows, update
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.tied_factors import tied_factors

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

DAMPING, DECAY = 0.05, 0.5
VOCAB, WIDTH = 9, 5


class TiedLM(nn.Module):
    """Embedding, a nonlinearity, an output layer holding the embedding's weight; keeps what the reference reads."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=bias)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.e = self.wte(tokens)
        self.e.retain_grad()
        self.h = torch.tanh(self.e)
        self.z = self.head(self.h)
        self.z.retain_grad()
        return self.z


def _nearest_kronecker(terms: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest Kronecker product to ``Σ X_k ⊗ Y_k`` from the SVD of its rearrangement (Van Loan & Pitsianis),
    its scale split so that ``‖X‖/‖Y‖`` is the geometric mean of the terms' ratios weighted by their norms."""
    v, d = terms[0][0].shape[0], terms[0][1].shape[0]
    total = sum(torch.kron(x, y) for x, y in terms)
    rearranged = total.reshape(v, d, v, d).permute(0, 2, 1, 3).reshape(v * v, d * d)
    u, s, vh = torch.linalg.svd(rearranged)
    x, y = (u[:, 0] * s[0].sqrt()).reshape(v, v), (vh[0] * s[0].sqrt()).reshape(d, d)
    if x.trace() < 0:
        x, y = -x, -y
    weights = [float(a.norm() * b.norm()) for a, b in terms]
    log_ratio = sum(w * math.log(float(a.norm() / b.norm())) for w, (a, b) in zip(weights, terms)) / sum(weights)
    t = math.sqrt(math.exp(log_ratio) * float(y.norm() / x.norm()))
    return t * x, y / t


def _running(factor: torch.Tensor, diagonal: bool = False) -> torch.Tensor:
    kept = torch.diag(torch.diagonal(factor)) if diagonal else factor
    return DECAY * torch.eye(kept.shape[0], dtype=kept.dtype) + (1 - DECAY) * kept


def _one_step(method: str, bias: bool, **options):
    torch.manual_seed(0)
    model = TiedLM(bias)
    opt = SPDKFACOptimizer(
        model, lr=1.0, momentum=0.0, damping=DAMPING, factor_decay=DECAY, kl_clip=None, backend="single", compute_method=method, **options
    )
    tokens = torch.randint(0, VOCAB, (6, 4))
    out = model(tokens)
    weights = torch.randn(out.shape)
    ((out * weights).sum() / tokens.shape[0]).backward()
    grad = model.wte.weight.grad.clone()
    if bias:
        grad = torch.cat([grad, model.head.bias.grad.unsqueeze(1)], dim=1)
    before = (
        torch.cat([model.wte.weight.detach(), model.head.bias.detach().unsqueeze(1)], dim=1) if bias else model.wte.weight.detach().clone()
    )
    opt.step()
    after = torch.cat([model.wte.weight.detach(), model.head.bias.detach().unsqueeze(1)], dim=1) if bias else model.wte.weight.detach()
    return model, tokens, grad, before - after, opt


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("diagonal_g", [False, True])
def test_the_tied_weight_against_the_reference(method, bias, diagonal_g):
    options = {"max_factor_dim": VOCAB - 1} if diagonal_g else {}
    model, tokens, grad, change, opt = _one_step(method, bias, **options)
    n = tokens.shape[0]
    counts, embedding_g = factors(one_hot_rows(model.wte, tokens), model.e.grad.reshape(-1, WIDTH), n, False, shared=False)
    output_a, output_g = factors(model.h.detach().reshape(-1, WIDTH), model.z.grad.reshape(-1, VOCAB), n, bias, shared=False)
    counts, embedding_g = _running(counts), _running(embedding_g)
    output_a, output_g = _running(output_a), _running(output_g, diagonal=diagonal_g)
    side = output_a.shape[0]
    padded = torch.zeros(side, side, dtype=embedding_g.dtype)
    padded[:WIDTH, :WIDTH] = embedding_g
    x, y = _nearest_kronecker([(counts, padded), (output_g, output_a)])
    if diagonal_g:  # (the nearest product of diagonal-X terms is diagonal)
        torch.testing.assert_close(x, torch.diag(torch.diagonal(x)), rtol=0, atol=1e-12)
    torch.testing.assert_close(change, update(y, x, grad, DAMPING, method), rtol=1e-8, atol=1e-10)
    wte, head = opt.layers
    assert (wte.tied_output, head.tied_embedding, wte.preconditions, head.preconditions) == (head, wte, False, True)


def test_the_combination_is_exact_where_one_use_vanishes():
    torch.manual_seed(1)
    c, ge = torch.rand(VOCAB), torch.rand(WIDTH, WIDTH)
    gh, ah = torch.rand(VOCAB, VOCAB), torch.rand(WIDTH + 1, WIDTH + 1)
    gh, ah, ge = gh @ gh.T, ah @ ah.T, ge @ ge.T
    x, y = tied_factors(c * 1e-12, ge, gh, ah)
    torch.testing.assert_close((x, y), (gh, ah), rtol=1e-8, atol=1e-8)
    x, y = tied_factors(c, ge, gh * 1e-12, ah)
    padded = torch.zeros(WIDTH + 1, WIDTH + 1, dtype=ge.dtype)
    padded[:WIDTH, :WIDTH] = ge
    torch.testing.assert_close((x, y), (torch.diag(c), padded), rtol=1e-5, atol=1e-5)
    x, y = tied_factors(torch.ones(VOCAB), torch.eye(WIDTH), torch.eye(VOCAB), torch.eye(WIDTH))  # (where averages start)
    torch.testing.assert_close((x, y), (math.sqrt(2) * torch.eye(VOCAB), math.sqrt(2) * torch.eye(WIDTH)))


def _net(bias: bool = False) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(TiedLM(bias))


def _train(model: nn.Module, backend, rows: slice, method: str, **options) -> list[torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(3))
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend=backend, compute_method=method, inv_update_freq=2, **options)
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(tokens[rows]).reshape(-1, VOCAB), labels[rows].reshape(-1)).backward()
        opt.step()
    opt.flush()  # (update fusion 'forward' holds the last update until the next forward pass)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("method", ["inverse", "eigen", "ekfac"])
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_two_workers_equal_one_and_stay_replicas(method, fraction):
    one = _train(_net(True), "single", slice(None), method)
    models = [_net(True), _net(True)]
    options = {} if fraction is None else {"grad_worker_fraction": fraction}
    ranks = run_ranks(2, lambda b: _train(models[b.rank], b, slice(4 * b.rank, 4 * b.rank + 4), method, **options))
    for mine, other, ref in zip(ranks[0], ranks[1], one):
        assert torch.equal(mine, other)
        torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("fusion", ["forward", "backward"])
def test_update_fusion_equals_the_plain_step(fusion):
    plain = _train(_net(), "single", slice(None), "inverse", kl_clip=None)
    fused = _train(_net(), "single", slice(None), "inverse", kl_clip=None, update_fusion=fusion)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_embedding_preconditions_nothing_and_the_plan_holds_one_layer():
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    assert [layer.name for layer in opt.layers] == ["0.wte", "0.head"]
    assert sorted(a.key for a in opt.work_plan.inversion.assignments) == [("A", "0.head"), ("G", "0.head")]
    text = opt.kfac_summary()
    assert "Embedding (tied to an output layer: its factors join that layer's)" in text
    assert "Linear (tied to an embedding: one weight, preconditioned with both uses' factors)" in text
    assert "not preconditioned" not in text
    tokens = torch.randint(0, VOCAB, (4, 3))
    F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1)).backward()
    opt.step()
    assert opt.layers[0].decomposition("A") is None
    assert opt.layers[1].decomposed


def test_a_checkpoint_resumes_bitwise():
    tokens = torch.randint(0, VOCAB, (6, 3), generator=torch.Generator().manual_seed(4))

    def steps(model: nn.Module, opt: SPDKFACOptimizer, k: int) -> None:
        for _ in range(k):
            opt.zero_grad()
            F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1)).backward()
            opt.step()

    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", inv_update_freq=3)
    steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    model_saved = {k: v.clone() for k, v in model.state_dict().items()}
    steps(model, opt, 3)
    resumed = _net()
    resumed.load_state_dict(model_saved)
    opt2 = SPDKFACOptimizer(resumed, lr=0.1, backend="single", inv_update_freq=3)
    opt2.load_state_dict(saved)
    assert opt2.layers[1].decomposed  # (kept: the embedding's missing decompositions do not make it incomplete)
    steps(resumed, opt2, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class _TwoEmbeddingsOneHead(nn.Module):
    """An encoder and a decoder embedding and an output layer, all one weight (T5's ``shared``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Embedding(VOCAB, WIDTH)
        self.dec = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.dec.weight = self.head.weight = self.enc.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(tokens) + self.dec(tokens.flip(1))))


def test_several_embeddings_are_one_use_each():
    model = _TwoEmbeddingsOneHead()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", factor_decay=DECAY)
    embedding, head = opt.layers
    assert embedding.modules == [model.enc, model.dec]
    assert embedding.tied_output is head
    tokens = torch.randint(0, VOCAB, (4, 3))
    F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1)).backward()
    opt.step()
    counts = embedding.factor("A")
    expected = torch.bincount(tokens.reshape(-1), minlength=VOCAB).double() / tokens.numel()  # (both uses: 2x rows)
    torch.testing.assert_close(counts, DECAY + (1 - DECAY) * expected)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.a = nn.Linear(WIDTH, VOCAB)
        self.b = nn.Linear(WIDTH, VOCAB)
        self.a.weight = self.b.weight = self.wte.weight


class _ThreeTypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.a = nn.Linear(WIDTH, VOCAB, bias=False)
        self.b = NonDynamicallyQuantizableLinear(WIDTH, VOCAB, bias=False)
        self.a.weight = self.b.weight = self.wte.weight


@pytest.mark.parametrize(
    ("model", "skip", "why"),
    [
        (_TwoHeads(), (), "has its own bias"),
        (_ThreeTypes(), (), "is a different layer"),
        (nn.Sequential(TiedLM(), nn.Linear(VOCAB, 2)), ("0.head",), "is in skip_layers but"),
    ],
)
def test_other_ties_still_get_the_base_update(model, skip, why):
    with pytest.warns(UserWarning, match=why):
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", skip_layers=skip)
    assert all(layer.tied_output is None and layer.tied_embedding is None for layer in opt.layers)
    assert not any(isinstance(layer.module, nn.Embedding) for layer in opt.layers)


def test_a_checkpoint_from_before_tied_layers_names_the_way_to_resume_it():
    """A checkpoint saved when the tied weight got the base update (as with skip_layers) resumes with skip_layers."""

    def net() -> nn.Module:
        return nn.Sequential(TiedLM(), nn.Linear(VOCAB, 3))

    with pytest.warns(UserWarning, match="is in skip_layers but"):
        before = SPDKFACOptimizer(net(), lr=0.1, backend="single", skip_layers=["0.head"])
    saved = before.state_dict()
    with pytest.raises(ValueError, match=r"missing from checkpoint \['0.head', '0.wte'\].*resumes with skip_layers=\['0.head'\]"):
        SPDKFACOptimizer(net(), lr=0.1, backend="single").load_state_dict(saved)
    with pytest.warns(UserWarning, match="is in skip_layers but"):
        SPDKFACOptimizer(net(), lr=0.1, backend="single", skip_layers=["0.head"]).load_state_dict(saved)
