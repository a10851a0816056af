"""The mixture-of-experts zoo model: its routing against a per-token float64 reference, every Linear preconditioned,
and 2 workers equal to one process while the experts take different numbers of tokens on each."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.layers import kfac_layers
from spdkfac.models import get_model
from spdkfac.models.llama import CharLlama
from spdkfac.models.moe import MixtureOfExperts


def test_each_token_is_the_weighted_sum_of_its_top_k_experts(float64):
    torch.manual_seed(0)
    moe = MixtureOfExperts(6, 5, experts=4, top_k=2)
    x = torch.randn(3, 7, 6)
    with torch.no_grad():
        out = moe(x)
    assert out.shape == x.shape
    for token, value in zip(x.reshape(-1, 6), out.reshape(-1, 6)):
        with torch.no_grad():
            scores = torch.softmax(token @ moe.router.weight.T, -1)
            top = sorted(range(4), key=lambda e: -float(scores[e]))[:2]
            expected = sum(float(scores[e]) / float(scores[top].sum()) * moe.experts[e](token[None])[0] for e in top)
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts"):
        MixtureOfExperts(4, 4, experts=2, top_k=3)


def test_the_router_and_every_experts_layers_are_preconditioned():
    names = {layer.name for layer in kfac_layers(get_model("char_moe_llama"))}
    for block in (0, 1):
        assert f"blocks.{block}.moe.router" in names
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"blocks.{block}.moe.experts.{e}.{proj}" in names


def _train(model: CharLlama, backend: Any, ids: torch.Tensor, steps: int = 3, accumulation: int = 1) -> list[torch.Tensor]:
    opt = SPDKFACOptimizer(model, lr=0.05, damping=0.01, kl_clip=None, backend=backend, accumulation_steps=accumulation)
    for s in range(steps):
        opt.zero_grad()
        for batch in ((ids + s) % 11).chunk(accumulation):
            (F.cross_entropy(model(batch[:, :-1]), batch[:, 1:]) / accumulation).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _tiny() -> CharLlama:
    torch.manual_seed(0)
    return CharLlama(11, context=8, dim=8, depth=1, heads=2, mlp_dim=6, experts=4, top_k=2)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_workers_equal_one_process_with_experts_taking_uneven_tokens(accumulation, float64):
    """Also with 2 micro-batches of one sequence per worker: the workers' micro-batches send different numbers of
    tokens to the experts, and one process takes the whole batch in one pass."""
    ids = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(1))
    model = _tiny()
    with torch.no_grad():  # each half of the batch sends a different number of tokens to some expert
        tokens = model.blocks[0].mlp_norm(model.tokens(ids[:, :-1]) + 0).reshape(-1, 8)
        chosen = model.blocks[0].moe.router(tokens).topk(2, dim=-1).indices
        halves = [torch.bincount(chosen[:16].reshape(-1), minlength=4), torch.bincount(chosen[16:].reshape(-1), minlength=4)]
    assert not torch.equal(halves[0], halves[1])
    single = _train(_tiny(), "single", ids)
    models = [_tiny(), _tiny()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranks = run_ranks(2, lambda b: _train(models[b.rank], b, ids[2 * b.rank : 2 * b.rank + 2], accumulation=accumulation))
    assert not [w for w in caught if "different numbers of samples" in str(w.message)]
    for a, b, s in zip(ranks[0], ranks[1], single):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, s, rtol=1e-10, atol=1e-12)
