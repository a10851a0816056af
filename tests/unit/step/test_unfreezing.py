"""Parameters frozen when the optimizer is built and unfrozen later (fine-tuning's gradual unfreezing).

``torch.optim.SGD(model.parameters())`` updates a parameter once it is
unfrozen. Before, the optimizer here planned its groups, layers and gradient
all-reduces from the parameters trainable at construction, so an unfrozen
layer silently never trained. Now it takes them in before the next forward
pass; the steps are those of a K-FAC layer that did not run until then (the
same model with the layer trainable from the start but run under
``torch.no_grad()`` for the first steps), N workers equal one, and the ranks
stay bitwise replicas.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, worker_module
from nets import assert_bitwise_equal
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.dho2.optimizer import DHO2Optimizer
from spdkfac.update.adamw import DistributedAdamW

warnings.filterwarnings("ignore", message="no perf_model given")

WORKER = ROOT / "tests" / "workers" / "unfreeze_check.py"
unfreeze = worker_module(WORKER)
Net, UNFREEZE, STEPS, _batches, _train = unfreeze.Net, unfreeze.UNFREEZE, unfreeze.STEPS, unfreeze.batches, unfreeze.train


OPTIONS = {
    "every-step": {},
    "amortised": {"factor_update_freq": 2, "inv_update_freq": 2},
    "eigen": {"compute_method": "eigen"},
    "adamw-no-decay-for-biases": {"base": "adamw", "weight_decay": 0.01, "no_weight_decay": ["kind:bias"]},
    "forward-update-fusion": {"update_fusion": "forward"},
    "backward-update-fusion": {"update_fusion": "backward", "kl_clip": None},
    "accumulation": {"accumulation_steps": 2},
}


@pytest.mark.parametrize("when", ["before-zero-grad", "before-forward"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_an_unfrozen_layer_trains_as_a_layer_that_did_not_run_until_then(options: str, when: str) -> None:
    got = _train(False, OPTIONS[options], when=when)
    want = _train(True, OPTIONS[options])
    assert not torch.equal(got[-1][0], got[UNFREEZE - 1][0])  # the unfrozen weight moves
    for s, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda m, s=s: f"step {s}: {m}")


def test_the_state_dict_is_the_one_an_optimizer_built_now_saves() -> None:
    net = Net()
    net.first.requires_grad_(False)
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single", no_weight_decay=["kind:bias"], weight_decay=0.01)
    x, y = _batches()[0]
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    net.first.requires_grad_(True)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    fresh = SPDKFACOptimizer(net, lr=0.1, backend="single", no_weight_decay=["kind:bias"], weight_decay=0.01)
    ours, theirs = opt.state_dict(), fresh.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert list(ours["kfac"]["layers"]) == list(theirs["kfac"]["layers"]) == ["first", "mid", "head"]
    fresh.load_state_dict(ours)  # and it resumes there


@pytest.mark.parametrize("config", list(unfreeze.CONFIGS))
def test_two_workers_unfreezing_equal_one_and_stay_replicas(config: str, float64: None) -> None:
    options = unfreeze.CONFIGS[config]
    nets = [Net(), Net()]  # (made here: the ranks' threads share the random generator)
    ranks = run_ranks(2, lambda backend: _train(False, options, backend, net=nets[backend.rank]), timeout=120)
    check_workers(ranks, _train(False, options), config)


def check_workers(ranks: list[list[list[torch.Tensor]]], single: list[list[torch.Tensor]], config: str) -> None:
    """Bitwise replicas after every step, and one process's parameters on the whole batch."""
    for s in range(STEPS):
        assert_bitwise_equal(ranks[1][s], ranks[0][s], f"{config}, step {s}")
        for a, b in zip(ranks[0][s], single[s], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, s=s: f"{config}, step {s}: {m}")


def test_a_gradient_from_before_the_freezing_is_not_carried_into_the_unfrozen_layer() -> None:
    """A layer trained, frozen with its gradient left, then unfrozen: its first step's gradient is that step's alone
    (``torch.optim`` clears it in every ``zero_grad()``; here it is in no group until taken in)."""
    results = []
    for stale in (False, True):
        net = Net()
        if stale:
            F.cross_entropy(net(_batches()[0][0]), _batches()[0][1]).backward()  # gradients left on every parameter
        net.first.requires_grad_(False)
        opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
        for s, (x, y) in enumerate(_batches()[:4]):
            if s == 2:
                net.first.requires_grad_(True)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()  # (the stale gradient of the still-frozen layer is no reason to refuse)
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _one_step(net: Net, opt: SPDKFACOptimizer, unfreeze_after_forward: bool) -> None:
    x, y = _batches()[0]
    opt.zero_grad()
    out = net(x)
    if unfreeze_after_forward:
        net.first.requires_grad_(True)
        out = out + net(x)
    F.cross_entropy(out, y).backward()
    opt.step()


def test_unfreezing_in_the_middle_of_a_step_is_refused_before_anything_changes() -> None:
    net = Net()
    net.first.requires_grad_(False)
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
    _one_step(net, opt, False)
    with pytest.raises(RuntimeError, match=r"\['first.weight', 'first.bias'\] became trainable in the middle of a step"):
        _one_step(net, opt, True)  # (a second forward pass sees it)

    net = Net()
    net.first.requires_grad_(False)
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batches()[0]
    out = net(x)
    net.first.requires_grad_(True)  # after the only forward pass: its gradient is one no hook saw
    F.cross_entropy(out + 0 * net.first.weight.sum(), y).backward()
    with pytest.raises(RuntimeError, match=r"\['first.weight'\] have gradients but were frozen when this step began"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_a_preconditioner_takes_an_unfrozen_layer_in_for_any_torch_optimizer() -> None:
    net = Net()
    net.first.requires_grad_(False)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = KFACPreconditioner(net, backend="single")
    batches = _batches()
    for s in range(3):
        if s == 1:
            net.first.requires_grad_(True)
        before = net.first.weight.detach().clone()
        sgd.zero_grad()
        F.cross_entropy(net(batches[s][0]), batches[s][1]).backward()
        pre.step()
        sgd.step()
        assert torch.equal(before, net.first.weight) == (s == 0)
    assert [layer.name for layer in pre.layers] == ["first", "mid", "head"]


@pytest.mark.usefixtures("process_group")
def test_unfreezing_under_ddp_is_refused_with_ddps_remedy() -> None:
    net = Net()
    net.first.requires_grad_(False)
    ddp = DistributedDataParallel(net)
    opt = SPDKFACOptimizer(ddp, lr=0.1, backend="single")
    x, y = _batches()[0]
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    net.first.requires_grad_(True)
    with pytest.raises(ValueError, match="wrap the bare model in DDP again"):
        opt.zero_grad()  # (or the next forward pass, whichever comes first)


def _adamw_unfreezing(net: Net, backend: Any, part: Any) -> list[torch.Tensor]:
    net.first.requires_grad_(False)
    opt = (
        DistributedAdamW(net, lr=0.01, weight_decay=0.01, backend=backend)
        if backend is not None
        else torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    )
    for s, (x, y) in enumerate(_batches()):
        if s == UNFREEZE:
            net.first.requires_grad_(True)
        opt.zero_grad()
        F.cross_entropy(net(x[part]), y[part]).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_distributed_adamw_steps_a_layer_unfrozen_later_as_torch_adamw_does(float64: None) -> None:
    """DistributedAdamW held the parameters trainable when built only: an unfrozen layer silently never trained."""
    want = _adamw_unfreezing(Net(), None, slice(0, 8))
    assert not torch.equal(want[0], Net().first.weight)
    nets = [Net(), Net()]
    ranks = run_ranks(2, lambda backend: _adamw_unfreezing(nets[backend.rank], backend, slice(4 * backend.rank, 4 * backend.rank + 4)))
    assert_bitwise_equal(ranks[0], ranks[1], "DistributedAdamW replicas")
    for a, b in zip(ranks[0], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dho2_refuses_a_layer_unfrozen_after_it_was_built() -> None:
    net = Net()
    net.first.requires_grad_(False)
    opt = DHO2Optimizer(net, backend="single")
    x, y = _batches()[0]
    opt.step(lambda: F.cross_entropy(net(x), y))
    net.first.requires_grad_(True)
    with pytest.raises(ValueError, match="2 parameter\\(s\\) of the model were frozen when DHO2 was built"):
        opt.step(lambda: F.cross_entropy(net(x), y))
