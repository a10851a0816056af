"""Parameter groups with parameters outside the model: ``add_param_group`` and an attached optimizer's own groups.

A loss with weights of its own (ArcFace's class centres), a learned
temperature or a second head beside the model: before, ``add_param_group``
on several workers failed with a KeyError from inside the all-reduce order,
and ``KFACPreconditioner(optimizer=...)`` left such parameters' gradients
un-averaged, so each worker's copy drifted apart silently. Now they are
averaged as the model's are: N workers equal one (float64), the ranks stay
bitwise replicas (under DDP, which averages its module's only, the optimizer
averages them at ``step()``), and where their update would be missed (update
fusion) the group is refused.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import CommBackend, run_ranks
from spdkfac.dho2.optimizer import DHO2Optimizer
from spdkfac.update.adamw import DistributedAdamW

ADD_AT, STEPS = 1, 4


class Head(nn.Module):
    """A loss module with weights of its own, kept beside the model (as metric-learning losses are)."""

    def __init__(self) -> None:
        super().__init__()
        self.centres = nn.Parameter(torch.randn(4, 3))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.scale * features @ self.centres.T, y)


def _modules() -> tuple[nn.Module, Head]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, Head()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)


def _loss(model: nn.Module, head: Head, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    out = model(x)
    return head(out, y) if step >= ADD_AT else F.cross_entropy(out[:, :3], y % 3)


def _train_added(
    modules: tuple[nn.Module, Head], backend: CommBackend | str, part: slice, make: Callable[[nn.Module, Any], torch.optim.Optimizer]
) -> list[torch.Tensor]:
    """``make(model, backend)``'s optimizer given the head by ``add_param_group`` at step ``ADD_AT``."""
    model, head = modules
    opt = make(model, backend)
    x, y = _data()
    for step in range(STEPS):
        if step == ADD_AT:
            opt.add_param_group({"params": head.parameters(), "lr": 0.05})
        opt.zero_grad()
        _loss(model, head, x[part], y[part], step).backward()
        opt.step()
    return [p.detach().clone() for p in [*model.parameters(), *head.parameters()]]


def _assert_workers_equal_one(train: Any, extra: Callable[[], nn.Module] | None = None) -> list[nn.Module]:
    """``train(modules, backend, part[, module])`` on 2 in-process workers equals one process on the whole batch, and
    the ranks are bitwise replicas; ``extra``: one more module per run, three identical copies (returned)."""
    copies = [] if extra is None else [extra() for _ in range(3)]
    for copy_ in copies[1:]:
        copy_.load_state_dict(copies[0].state_dict())

    def more(run: int) -> list[nn.Module]:  # (the extra module of run 0, the reference, or of rank r's run 1 + r)
        return copies[run : run + 1]

    want = train(_modules(), "single", slice(0, 16), *more(0))
    modules = [_modules(), _modules()]  # (built here: the global RNG is not the ranks' to share)
    got = run_ranks(2, lambda b: train(modules[b.rank], b, slice(8 * b.rank, 8 * b.rank + 8), *more(1 + b.rank)))
    assert not torch.equal(got[0][-1], _modules()[1].scale)  # the head trained
    for mine, theirs, reference in zip(got[0], got[1], want, strict=True):
        assert torch.equal(mine, theirs)
        torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-12)
    return copies


@pytest.mark.parametrize(
    "options",
    [{}, {"base": "adamw"}, {"compute_method": "eigen"}, {"compute_method": "ekfac"}, {"grad_worker_fraction": 0.5}, {"pipelining": False}],
    ids=["inverse", "adamw", "eigen", "ekfac", "half-grad-workers", "after-backward"],
)
def test_a_group_outside_the_model_trains_on_two_workers_as_on_one(float64: None, options: dict[str, Any]) -> None:
    def make(model: nn.Module, backend: Any) -> torch.optim.Optimizer:
        return SPDKFACOptimizer(model, lr=0.1, backend=backend, profile_steps=1, **options)

    _assert_workers_equal_one(lambda modules, backend, part: _train_added(modules, backend, part, make))


def test_distributed_adamw_averages_an_added_group_too(float64: None) -> None:
    _assert_workers_equal_one(
        lambda modules, backend, part: _train_added(modules, backend, part, lambda m, b: DistributedAdamW(m, lr=0.01, backend=b))
    )


def test_dho2_refuses_a_group_added_after_construction() -> None:
    model, head = _modules()
    opt = DHO2Optimizer(model, backend="single")
    with pytest.raises(ValueError, match="DHO2 keeps the model's parameters as one vector"):
        opt.add_param_group({"params": head.parameters()})


def test_the_added_group_steps_with_its_own_hyperparameters_and_is_not_preconditioned() -> None:
    model, head = _modules()
    opt = SPDKFACOptimizer(model, lr=0.1, momentum=0.0, backend="single")
    opt.add_param_group({"params": head.parameters(), "lr": 0.05})
    assert [layer.name for layer in opt.layers] == ["0", "2"]
    assert opt.kfac_summary().endswith(
        "momentum SGD, not preconditioned, for 13 parameters outside the model (2 tensors of added parameter groups)"
    )
    x, y = _data()
    before = [p.detach().clone() for p in head.parameters()]
    head(model(x), y).backward()
    grads = [p.grad.clone() for p in head.parameters()]
    opt.step()
    for p, b, g in zip(head.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.05 * g)  # plain SGD at the group's lr


def test_a_checkpoint_with_the_added_group_resumes_bitwise() -> None:
    x, y = _data()

    def build() -> tuple[nn.Module, Head, SPDKFACOptimizer]:
        model, head = _modules()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
        opt.add_param_group({"params": head.parameters(), "lr": 0.05})
        return model, head, opt

    def step(model: nn.Module, head: Head, opt: SPDKFACOptimizer) -> None:
        opt.zero_grad()
        head(model(x), y).backward()
        opt.step()

    model, head, opt = build()
    for _ in range(2):
        step(model, head, opt)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(head.state_dict()), copy.deepcopy(opt.state_dict()))
    step(model, head, opt)
    again, again_head, again_opt = build()
    again.load_state_dict(saved[0])
    again_head.load_state_dict(saved[1])
    again_opt.load_state_dict(saved[2])
    step(again, again_head, again_opt)
    for a, b in zip([*model.parameters(), *head.parameters()], [*again.parameters(), *again_head.parameters()], strict=True):
        assert torch.equal(a, b)


def test_a_frozen_parameter_outside_the_model_is_held_and_not_stepped() -> None:
    model, head = _modules()
    head.scale.requires_grad_(False)
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", accumulation_steps=2)  # (the gradients' hooks count)
    opt.add_param_group({"params": head.parameters()})
    x, y = _data()
    for part in (slice(0, 8), slice(8, 16)):
        (head(model(x[part]), y[part]) / 2).backward()
    opt.step()
    assert head.scale.item() == 2.0
    assert head.scale.grad is None


def test_adding_in_the_middle_of_a_step_is_refused() -> None:
    model, head = _modules()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    x, y = _data()
    head(model(x), y).backward()
    with pytest.raises(RuntimeError, match="add_param_group\\(\\) in the middle of a step"):
        opt.add_param_group({"params": head.parameters()})
    opt.step()
    opt.add_param_group({"params": head.parameters()})  # between steps


def test_update_fusion_refuses_the_group_and_goes_on_as_before() -> None:
    model, head = _modules()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", update_fusion="forward")
    with pytest.raises(ValueError, match=r"outside the model \(shapes \(4, 3\), \(\)\) under update_fusion='forward'"):
        opt.add_param_group({"params": head.parameters()})
    assert len(opt.param_groups) == 1
    x, y = _data()
    F.cross_entropy(model(x), y % 3).backward()
    opt.step()


def _train_beside_ddp(wiring: str, ddp: bool) -> list[torch.Tensor]:
    """The head added beside a model in DDP (one process here; several: tests/multiprocess/test_beside_model_multiprocess.py)."""
    model, head = _modules()
    wrapped = DistributedDataParallel(model) if ddp else model
    if wiring == "attached":
        sgd = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (it warned that DDP would leave them to drift)
            warnings.filterwarnings("ignore", "no perf_model given")
            KFACPreconditioner(wrapped, lr=0.1, backend="single", optimizer=sgd)
        opt: torch.optim.Optimizer = sgd
    else:
        opt = SPDKFACOptimizer(wrapped if wiring == "ddp-first" else model, lr=0.1, backend="single")
        opt.add_param_group({"params": head.parameters(), "lr": 0.05})
    x, y = _data()
    for step in range(ADD_AT, ADD_AT + STEPS):
        opt.zero_grad()
        _loss(wrapped, head, x, y, step).backward()  # (DDP wrapped after the optimizer: adopted at its first forward)
        opt.step()
    return [p.detach().clone() for p in [*model.parameters(), *head.parameters()]]


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("wiring", ["ddp-first", "group-first", "attached"])
def test_under_ddp_the_group_is_taken_and_trains_as_on_the_bare_model(wiring: str) -> None:
    """DDP averages its module's gradients only: the optimizer averages the group's at step() (refused before, or,
    attached, left to drift with a warning)."""
    for mine, bare in zip(_train_beside_ddp(wiring, True), _train_beside_ddp(wiring, False), strict=True):
        assert torch.equal(mine, bare)


# -- KFACPreconditioner riding on the user's optimizer ----------------------------------------
def _train_attached(
    modules: tuple[nn.Module, Head], backend: CommBackend | str, part: slice, second: Head | None = None, thaw: bool = False
) -> list[torch.Tensor]:
    """The user's SGD holds the model and the head from the start; ``second`` is added to it at step ADD_AT + 1;
    ``thaw``: the head's scale is frozen until then."""
    model, head = modules
    head.scale.requires_grad_(not thaw)
    sgd = torch.optim.SGD([{"params": model.parameters()}, {"params": head.parameters(), "lr": 0.05}], lr=0.1, momentum=0.9)
    KFACPreconditioner(model, lr=0.1, backend=backend, optimizer=sgd, profile_steps=1)
    x, y = _data()
    for step in range(ADD_AT, ADD_AT + STEPS):
        if second is not None and step == ADD_AT + 1:
            sgd.add_param_group({"params": second.parameters(), "lr": 0.02})
        if thaw and step == ADD_AT + 1:
            head.scale.requires_grad_(True)
        sgd.zero_grad()
        loss = _loss(model, head, x[part], y[part], step)
        if second is not None and step > ADD_AT:
            loss = loss + second(model(x[part]), y[part])
        loss.backward()
        sgd.step()
    return [p.detach().clone() for p in [*model.parameters(), *head.parameters(), *([] if second is None else second.parameters())]]


def test_the_attached_optimizers_parameters_outside_the_model_are_averaged(float64: None) -> None:
    _assert_workers_equal_one(_train_attached)


def test_an_outside_parameter_unfrozen_later_is_averaged_too(float64: None) -> None:
    _assert_workers_equal_one(lambda modules, backend, part: _train_attached(modules, backend, part, thaw=True))


def test_a_group_added_to_the_attached_optimizer_later_is_averaged_from_its_first_step(float64: None) -> None:
    _assert_workers_equal_one(_train_attached, Head)


def _train_unattached(
    modules: tuple[nn.Module, Head], backend: CommBackend | str, part: slice, other: nn.Module | None = None
) -> list[torch.Tensor]:
    """KAISA's usage: ``preconditioner.step()``, then the user's SGD, which holds the model and the head; ``other``:
    a second model with an optimizer of its own, stepped too (a GAN's other network)."""
    model, head = modules
    sgd = torch.optim.SGD([{"params": model.parameters()}, {"params": head.parameters(), "lr": 0.05}], lr=0.1, momentum=0.9)
    preconditioner = KFACPreconditioner(model, lr=0.1, backend=backend, profile_steps=1)
    other_sgd = None if other is None else torch.optim.SGD(other.parameters(), lr=0.1)
    x, y = _data()
    for step in range(ADD_AT, ADD_AT + STEPS):
        sgd.zero_grad()
        _loss(model, head, x[part], y[part], step).backward()
        preconditioner.step()
        sgd.step()
        if other is not None and other_sgd is not None:
            other(x[part]).pow(2).mean().backward()
            other_sgd.step()
            other_sgd.zero_grad()
    return [p.detach().clone() for p in [*model.parameters(), *head.parameters()]]


def test_without_optimizer_the_optimizers_parameters_outside_the_model_are_found_and_averaged(float64: None) -> None:
    """KAISA's usage gives the preconditioner no optimizer: the first step of one that trains its model hands the
    parameters outside the model over (before, each worker's copy drifted apart silently)."""
    _assert_workers_equal_one(_train_unattached)


def test_without_optimizer_another_models_optimizer_is_left_alone(float64: None) -> None:
    others = _assert_workers_equal_one(_train_unattached, lambda: nn.Linear(6, 2))
    assert not torch.equal(others[1].weight, others[2].weight)  # its own gradients, never averaged: each rank's own


def test_the_preconditioners_summary_counts_the_optimizers_parameters_outside_the_model() -> None:
    model, head = _modules()
    sgd = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    pre = KFACPreconditioner(model, lr=0.1, backend="single", optimizer=sgd)
    assert pre.kfac_summary().endswith(
        "Your optimizer's update, not preconditioned, for 13 parameters outside the model (2 tensors of added parameter groups)"
    )
