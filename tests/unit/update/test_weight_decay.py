"""``no_weight_decay``: which parameters each kind names, the two groups against torch's optimizers, K-FAC steps,
resume and N workers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from nets import batch, small_transformer, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import run_ranks
from spdkfac.update.weight_decay import split_decayed


class Tokens(nn.Module):
    """A transformer-like model with a class token, an attention module, norms and a bias-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 8)
        self.cls = nn.Parameter(torch.zeros(8))
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.permute(0, 2, 1, 3).reshape(x.shape[0], 6, 12)) + self.cls
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(self.rms(h).mean(dim=1))


def _names(model: nn.Module, entries: list[str]) -> set[str]:
    _, excluded = split_decayed(model, entries)
    ids = {id(p) for p in excluded}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_each_kind_names_its_parameters():
    model = Tokens()
    biases = {"embed.bias", "attn.in_proj_bias", "attn.out_proj.bias", "norm.bias"}
    norms = {"norm.weight", "norm.bias", "rms.weight"}
    assert _names(model, ["kind:bias"]) == biases
    assert _names(model, ["kind:norm"]) == norms
    assert _names(model, ["kind:vector"]) == biases | norms | {"cls"}
    assert _names(model, ["*.bias", "cls"]) == {"embed.bias", "attn.out_proj.bias", "norm.bias", "cls"}


def test_bad_entries_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown kind"):
        SPDKFACOptimizer(Tokens(), lr=0.1, no_weight_decay=["kind:biases"])
    with pytest.raises(ValueError, match=r"\['head\.bias'\] match no trainable parameter"):
        SPDKFACOptimizer(Tokens(), lr=0.1, no_weight_decay=["*.bias", "head.bias"])
    with pytest.raises(ValueError, match="excludes every parameter"):
        SPDKFACOptimizer(Tokens(), lr=0.1, no_weight_decay=["*"])
    with pytest.raises(TypeError, match="no_weight_decay entries"):
        SPDKFACOptimizer(Tokens(), lr=0.1, no_weight_decay=[nn.LayerNorm])


@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_without_preconditioning_the_groups_step_as_torchs_optimizer(base):
    # (no attention here: the gradient of k's bias is zero up to rounding, which Adam would scale up to full steps)
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Flatten(), nn.Linear(72, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 5))
    theirs = copy.deepcopy(ours)
    opt = SPDKFACOptimizer(
        ours, lr=0.05, weight_decay=0.1, base=base, precondition=False, backend="single", no_weight_decay=["kind:vector"]
    )
    decayed = [p for n, p in theirs.named_parameters() if p.dim() >= 2]
    vectors = [p for n, p in theirs.named_parameters() if p.dim() < 2]
    groups = [{"params": decayed}, {"params": vectors, "weight_decay": 0.0}]
    ref = (
        torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.1)
        if base == "sgd"
        else torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    )
    x, y = batch(8)
    for step in range(3):
        for o, m in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x + 0.1 * step), y).backward()
            o.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_kfac_step_decays_only_the_decayed_parameters():
    """A zero loss: every preconditioned gradient is zero, so the step is the decay alone, p <- (1 - lr wd) p."""
    model = Tokens()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # (nothing zero: a zero parameter stays zero under decay)
    opt = SPDKFACOptimizer(
        model, lr=0.5, momentum=0.0, weight_decay=0.1, kl_clip=None, backend="single", no_weight_decay=["kind:norm", "cls"]
    )
    assert len(opt.layers) == 6  # (embed, q, k, v, out_proj, head: K-FAC runs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, _ = batch(8)
    (0.0 * model(x).sum()).backward()
    opt.step()
    for name, p in model.named_parameters():
        kept = name.startswith(("norm.", "rms.")) or name == "cls"
        expected = before[name] if kept else before[name] * (1 - 0.5 * 0.1)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7, msg=name)
        assert kept == torch.equal(p.detach(), before[name]), name


def test_resume_is_bitwise_and_a_checkpoint_with_other_groups_is_refused():
    def run(model, opt, steps):
        x, y = batch(8)
        for s in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()

    options = dict(lr=0.05, weight_decay=0.1, backend="single", no_weight_decay=["kind:vector"])
    straight = small_transformer()
    opt = SPDKFACOptimizer(straight, **options)
    run(straight, opt, range(2))
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(straight.state_dict())
    run(straight, opt, range(2, 4))
    resumed = small_transformer(seed=1)
    resumed.load_state_dict(weights)
    again = SPDKFACOptimizer(resumed, **options)
    again.load_state_dict(copy.deepcopy(saved))
    run(resumed, again, range(2, 4))
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    other = SPDKFACOptimizer(small_transformer(), **{**options, "no_weight_decay": ["kind:bias"]})
    with pytest.raises(ValueError, match=r"saved with no_weight_decay=\['kind:vector'\]"):
        other.load_state_dict(copy.deepcopy(saved))


def test_two_workers_equal_one_with_the_groups(float64):
    options = dict(lr=0.05, weight_decay=0.1, no_weight_decay=["kind:bias", "kind:norm"], profile_steps=1)
    x, y = batch(8)
    ref = small_transformer()
    train(ref, SPDKFACOptimizer(ref, backend="single", **options), x, y, 3)
    models = [small_transformer() for _ in range(2)]

    def rank(backend):
        model = models[backend.rank]
        local = slice(4 * backend.rank, 4 * backend.rank + 4)
        train(model, SPDKFACOptimizer(model, backend=backend, **options), x[local], y[local], 3)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ranks = run_ranks(2, rank)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ranks[0][name], p.detach(), rtol=1e-9, atol=1e-11, msg=name)
        assert torch.equal(ranks[0][name], ranks[1][name]), name
