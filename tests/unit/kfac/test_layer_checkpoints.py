"""Checkpoints with the new layer types: plain data (``weights_only=True``), exact resume, and the older format still loads."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from nets import batch, mixed_net, small_net, train

from spdkfac import SPDKFACOptimizer

KW = dict(lr=0.05, damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("method", [pytest.param("inverse", marks=pytest.mark.slow), "eigen"])
def test_mixed_net_resumes_exactly_from_a_weights_only_checkpoint(method, float64):
    x, y = batch(8)
    model = mixed_net()
    opt = SPDKFACOptimizer(model, compute_method=method, **KW)
    train(model, opt, x, y, 3)
    saved_model, saved_opt = _round_trip(model.state_dict()), _round_trip(opt.state_dict())
    train(model, opt, x + 1.0, y, 2)

    resumed = mixed_net(seed=7)
    resumed.load_state_dict(saved_model)
    opt2 = SPDKFACOptimizer(resumed, compute_method=method, **KW)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, x + 1.0, y, 2)
    for k, v in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    entry = saved_opt["kfac"]["layers"]
    assert entry["embed"]["A"].shape == (10,)  # a diagonal factor is saved as its vector
    assert entry["grouped"]["A"].shape == (2, 18, 18)  # block-diagonal: one block per group


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_a_checkpoint_in_the_earlier_layout_still_loads(method, float64):
    """Before the methods were plug-ins every layer entry held A_inv, G_inv, A_eigen and G_eigen (None where unused)."""
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, compute_method=method, **KW)
    train(model, opt, x, y, 2)
    state = copy.deepcopy(opt.state_dict())
    for entry in state["kfac"]["layers"].values():
        for key in ("A_inv", "G_inv", "A_eigen", "G_eigen"):
            entry.setdefault(key, None)
    if method == "inverse":
        del state["kfac"]["compute_method"]  # the oldest checkpoints: inverses, no method recorded
    opt2 = SPDKFACOptimizer(small_net(), compute_method=method, **KW)
    opt2.load_state_dict(_round_trip(state))
    for a, b in zip(opt.layers, opt2.layers):
        for kind in ("A", "G"):
            for t, u in zip(a.method.tensors(a.decomposition(kind)), b.method.tensors(b.decomposition(kind))):
                assert torch.equal(t, u)


def test_a_checkpoint_of_another_grouping_is_refused():
    opt = SPDKFACOptimizer(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, groups=2)), **KW)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, groups=2))
    opt.layers[0].update_factor("A", opt.layers[0].shape("A").identity(torch.float32, torch.device("cpu")), 0.5)
    state = opt.state_dict()
    state["kfac"]["layers"]["0"]["A"] = torch.eye(18)  # one 18x18 block instead of two
    with pytest.raises(ValueError, match="different model"):
        SPDKFACOptimizer(model, **KW).load_state_dict(state)
