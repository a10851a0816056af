"""``max_factor_dim``: a factor wider than it is kept as its diagonal. Against a float64 reference written from the
definitions (the dense factors of ``layer_reference``, their diagonal taken, a dense Kronecker solve), for Linear
layers (flat and sequence input), an Embedding's ``G``, a convolution's ``A`` and EKFAC; 2 workers equal one;
what the plan, the summary, the memory and a checkpoint see."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_reference import conv_grad_rows, conv_rows, factors, one_hot_rows, update
from one_step import kfac_step

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.perfmodels import PerfModel
from spdkfac.plan.work_plan import LayerShape, preconditioning_seconds
from spdkfac.variants import make_optimizer

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

DAMPING, DECAY = 0.05, 0.5


def _running(factor: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """One step's running average from the identity, of the factor or of its diagonal alone."""
    kept = torch.diag(torch.diagonal(factor)) if diagonal else factor
    return DECAY * torch.eye(kept.shape[0], dtype=kept.dtype) + (1 - DECAY) * kept


def _grad(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """A layer's gradient (or change) as the ``g x a`` matrix, the bias as its last column."""
    weight = grads["weight"].reshape(grads["weight"].shape[0], -1)
    return weight if "bias" not in grads else torch.cat([weight, grads["bias"].unsqueeze(1)], dim=1)


def _check(opt: SPDKFACOptimizer, change: dict[str, torch.Tensor], A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, method: str):
    (layer,) = opt.layers
    for kind, ref in (("A", A), ("G", G)):
        mine = layer.factor(kind)
        torch.testing.assert_close(torch.diag(mine) if mine.dim() == 1 else mine, ref, rtol=1e-10, atol=1e-12)
    expected = update(A, G, grad, DAMPING, method)
    got = _grad(change)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("features", "limit", "diagonal"), [((8, 5), 6, "A"), ((4, 12), 9, "G"), ((8, 5), 4, "AG")])
@pytest.mark.parametrize("sequence", [False, True])
def test_linear_factors_kept_diagonal_against_the_reference(method, bias, features, limit, diagonal, sequence):
    torch.manual_seed(0)
    module = nn.Linear(*features, bias=bias)  # A is in_features (+1) wide, G out_features
    x = torch.randn(6, 3, module.in_features) if sequence else torch.randn(6, module.in_features)
    grad_out, grads, change, opt = kfac_step(module, x, method, DAMPING, DECAY, max_factor_dim=limit)
    assert opt.layers[0].diagonal_by_width == frozenset(diagonal)
    a_rows, g_rows = x.reshape(-1, module.in_features), grad_out.reshape(-1, module.out_features)
    A, G = factors(a_rows, g_rows, x.shape[0], bias, shared=False)
    A, G = _running(A, "A" in diagonal), _running(G, "G" in diagonal)
    _check(opt, change, A, G, _grad(grads), method)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_embedding_g_kept_diagonal_against_the_reference(method):
    torch.manual_seed(0)
    module = nn.Embedding(7, 6)
    tokens = torch.randint(0, 7, (5, 4))
    grad_out, grads, change, opt = kfac_step(module, tokens, method, DAMPING, DECAY, max_factor_dim=5)
    assert opt.layers[0].diagonal_by_width == frozenset("G")  # (A is diagonal by the type: not counted)
    A, G = factors(one_hot_rows(module, tokens), grad_out.reshape(-1, 6), 5, False, shared=False)
    A, G = _running(A, True), _running(G, True)
    layer = opt.layers[0]
    torch.testing.assert_close(torch.diag(layer.factor("G")), G, rtol=1e-10, atol=1e-12)
    expected = update(A, G, grads["weight"].T, DAMPING, method)
    torch.testing.assert_close(change["weight"].T, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_convolution_a_kept_diagonal_by_the_gram_default(method):
    """A convolution's ``A`` (its patches: channels x kernel) through the helper's default, the Gram's diagonal."""
    torch.manual_seed(0)
    module = nn.Conv2d(2, 3, 3, padding=1, stride=2)
    x = torch.randn(4, 2, 5, 5)
    grad_out, grads, change, opt = kfac_step(module, x, method, DAMPING, DECAY, max_factor_dim=10)
    assert opt.layers[0].diagonal_by_width == frozenset("A")  # A: 2*9 + 1 wide, G: 3
    (a_rows,), (g_rows,) = conv_rows(module, x), conv_grad_rows(module, grad_out)
    A, G = factors(a_rows, g_rows, 4, True)
    _check(opt, change, _running(A, True), _running(G, False), _grad(grads), method)


def test_ekfac_with_a_diagonal_g_against_the_reference():
    """EKFAC's natural update with ``Q_G = I``: the projected gradient is ``grad Q_A``, scaled by its running scaling."""
    torch.manual_seed(0)
    module = nn.Linear(4, 10)
    x = torch.randn(12, 4)
    grad_out, grads, change, opt = kfac_step(module, x, "ekfac", DAMPING, DECAY, max_factor_dim=6)
    A, G = factors(x, grad_out, 12, True, shared=False)
    A, G = _running(A, False), _running(G, True)
    d_a, q_a = torch.linalg.eigh(A)
    grad = _grad(grads)
    v = grad @ q_a
    beta = opt.method.decay
    scale = beta * torch.outer(torch.diagonal(G), d_a) + (1 - beta) * 12 * v.square()
    expected = (v / (scale + DAMPING)) @ q_a.T
    torch.testing.assert_close(_grad(change), expected, rtol=1e-8, atol=1e-10)


def test_adam_in_the_eigenbasis_takes_a_diagonal_factor():
    """The Adam update in a partly diagonal eigenbasis trains (the first step: Adam's sign-like step there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 10), nn.Tanh(), nn.Linear(10, 3))
    opt = SPDKFACOptimizer(model, lr=0.05, compute_method="ekfac", ekfac_update="adam", base="adamw", max_factor_dim=6)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert [la.diagonal_by_width for la in opt.layers] == [frozenset("G"), frozenset("A")]
    assert losses[-1] < 0.8 * losses[0]


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Embedding(30, 12), nn.Flatten(), nn.Linear(36, 20), nn.Tanh(), nn.Linear(20, 40))


def _train(model: nn.Module, backend, rows: slice, method: str, **options) -> list[torch.Tensor]:
    tokens = torch.randint(0, 30, (8, 3), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(3))
    opt = SPDKFACOptimizer(
        model, lr=0.1, damping=0.01, backend=backend, compute_method=method, max_factor_dim=16, inv_update_freq=2, **options
    )
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(tokens[rows]), labels[rows]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_two_workers_equal_one_and_stay_replicas(method, fraction):
    """Also with each layer preconditioned by one worker (MEM-OPT): the diagonal decompositions and results travel."""
    one = _train(_net(), "single", slice(None), method)
    models = [_net(), _net()]
    options = {} if fraction is None else {"grad_worker_fraction": fraction}
    ranks = run_ranks(2, lambda b: _train(models[b.rank], b, slice(4 * b.rank, 4 * b.rank + 4), method, **options))
    for mine, other, ref in zip(ranks[0], ranks[1], one):
        assert torch.equal(mine, other)
        torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-11)


def test_plan_summary_and_memory_see_the_diagonal():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3000))  # a wide output layer
    dense = SPDKFACOptimizer(model, lr=0.1)
    opt = SPDKFACOptimizer(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3000)), lr=0.1, max_factor_dim=2048)
    shape = LayerShape.of(opt.layers[1])
    assert shape.g_diagonal
    assert not shape.a_diagonal
    assert shape.factor_shape("G").diagonal
    perf = PerfModel.default()  # the plan's per-step cost of the head: its G scales the rows (3000 x 33 products, not 3000^2 x 33)
    dense_cost = preconditioning_seconds(perf, opt.method, LayerShape.of(dense.layers[1]))
    assert preconditioning_seconds(perf, opt.method, shape) == pytest.approx(dense_cost * (1 + 33) / (3000 + 33))
    assert "1 x Linear (diagonal G: wider than max_factor_dim)" in opt.kfac_summary()
    for o in (dense, opt):
        x = torch.randn(8, 16)
        o.zero_grad()
        o.model(x).square().mean().backward()
        o.step()
    size = opt.layers[1].factor_dtype.itemsize
    assert opt.memory_usage()["G"] == (32 * 33 // 2 + 3000) * size  # the first layer's packed G, the head's diagonal
    assert dense.memory_usage()["G"] == (32 * 33 // 2 + 3000 * 3001 // 2) * size


def test_the_option_is_checked_and_a_checkpoint_keeps_it():
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_factor_dim must be a positive integer"):
            SPDKFACOptimizer(_net(), lr=0.1, max_factor_dim=bad)
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, max_factor_dim=16)
    opt.zero_grad()
    F.cross_entropy(model(torch.randint(0, 30, (4, 3))), torch.randint(0, 40, (4,))).backward()
    opt.step()
    with pytest.raises(ValueError, match=r"saved with max_factor_dim=16 but this optimizer uses max_factor_dim=None"):
        SPDKFACOptimizer(_net(), lr=0.1).load_state_dict(opt.state_dict())
    again = SPDKFACOptimizer(_net(), lr=0.1, max_factor_dim=16)
    again.load_state_dict(opt.state_dict())
    torch.testing.assert_close(again.layers[2].factor("G"), opt.layers[2].factor("G"), rtol=0, atol=0)


def test_the_preconditioner_and_a_variant_spec_take_it():
    model = nn.Sequential(nn.Linear(4, 10), nn.Tanh(), nn.Linear(10, 3))
    preconditioner = KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_factor_dim=6)
    assert [layer.diagonal_by_width for layer in preconditioner.kfac.layers] == [frozenset("G"), frozenset("A")]
    preconditioner.remove_hooks()
    opt = make_optimizer("spdkfac:max_factor_dim=6", model, lr=0.1)
    assert opt.config.max_factor_dim == 6
