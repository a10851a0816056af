"""An optimizer the script lets go of is freed, with its factors and the model.

Sweeps, notebooks and fine-tuning scripts build one optimizer after another in
one process. The gradient hooks on the parameters live in C++, where the
garbage collector cannot see them; while they held the optimizer, every
optimizer that had them (N workers, gradient accumulation, backward update
fusion) stayed alive with its model and factors until the process ended.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import batch, small_net

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

warnings.filterwarnings("ignore", message="no perf_model given")

OPTIONS: dict[str, dict[str, Any]] = {
    "every-step": {},
    "accumulation": {"accumulation_steps": 2},
    "backward-update-fusion": {"update_fusion": "backward", "kl_clip": None},
    "forward-update-fusion": {"update_fusion": "forward"},
    "eigen": {"compute_method": "eigen"},
}


def _steps(model: nn.Module, step: Callable[[], None], zero_grad: Callable[[], None], passes: int) -> None:
    x, y = batch(8)
    for s in range(2):
        zero_grad()
        for xm, ym in zip((x + 0.1 * s).chunk(passes), y.chunk(passes), strict=True):
            (F.cross_entropy(model(xm), ym) / passes).backward()
        step()


def _let_go(build: Callable[[], tuple[nn.Module, Any]]) -> list[weakref.ref[Any]]:
    """Build and train in a frame of its own; weak references to what it built."""
    model, optimizer = build()
    return [weakref.ref(model), weakref.ref(optimizer)]


def _assert_freed(refs: list[weakref.ref[Any]]) -> None:
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_an_optimizer_let_go_is_freed_with_its_model(options: str) -> None:
    def build() -> tuple[nn.Module, Any]:
        model = small_net()
        opt = SPDKFACOptimizer(model, lr=0.05, **OPTIONS[options])
        _steps(model, opt.step, opt.zero_grad, OPTIONS[options].get("accumulation_steps", 1))
        return model, opt

    _assert_freed(_let_go(build))


def test_a_preconditioner_let_go_is_freed() -> None:
    def build() -> tuple[nn.Module, Any]:
        model = small_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kfac = KFACPreconditioner(model, accumulation_steps=2)

        def step() -> None:
            kfac.step()
            opt.step()

        _steps(model, step, opt.zero_grad, 2)
        return model, kfac

    _assert_freed(_let_go(build))


def test_the_optimizers_of_two_workers_let_go_are_freed() -> None:
    models = {0: small_net(), 1: small_net()}

    def rank(backend: Any) -> list[weakref.ref[Any]]:
        model = models.pop(backend.rank)
        opt = SPDKFACOptimizer(model, lr=0.05, backend=backend)
        _steps(model, opt.step, opt.zero_grad, 1)
        return [weakref.ref(opt), weakref.ref(model)]

    _assert_freed([r for rank_refs in run_ranks(2, rank, timeout=120) for r in rank_refs])


def _hooked(model: nn.Module) -> list[str]:
    """What carries a hook: modules (forward and state-dict hooks) and parameters (gradient hooks)."""
    found = [f"module {n!r}" for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks or m._state_dict_pre_hooks]
    return found + [f"parameter {n!r}" for n, p in model.named_parameters() if p._post_accumulate_grad_hooks]


@pytest.mark.parametrize("options", ["accumulation", "forward-update-fusion"])
def test_a_model_kept_after_its_optimizer_is_let_go_carries_no_hook(options: str) -> None:
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, **OPTIONS[options])
    _steps(model, opt.step, opt.zero_grad, OPTIONS[options].get("accumulation_steps", 1))
    assert _hooked(model)
    held = opt.state_dict()  # (forward fusion: the held updates applied)
    ref = weakref.ref(opt)
    del opt
    _assert_freed([ref])  # before, the model's hooks kept the optimizer (and its factors) alive
    assert _hooked(model) == []
    assert held["state"]


# -- a newer optimizer on the same model -------------------------------------------------------------------------


def _two_stages(keep_first: bool, options: dict[str, Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """Two steps with one optimizer, then two with a new one on the same model (the first let go, or still referred to)."""
    model = small_net()
    kept: list[Any] = []
    opt = SPDKFACOptimizer(model, lr=0.05, momentum=0.9, **options)
    _steps(model, opt.step, opt.zero_grad, 1)
    if keep_first:
        kept.append(opt)  # e.g. an LR scheduler of the first stage still holds it
    opt = SPDKFACOptimizer(model, lr=0.02, momentum=0.9, **options)  # (the first one is now garbage, or held)
    _steps(model, opt.step, opt.zero_grad, 1)
    opt.flush()
    return [p.detach().clone() for p in model.parameters()], kept


def _two_stages_on_fresh_models(options: dict[str, Any]) -> list[torch.Tensor]:
    """The same, the second stage on a fresh model given the first stage's parameters: what the second must equal."""
    first = small_net()
    opt = SPDKFACOptimizer(first, lr=0.05, momentum=0.9, **options)
    _steps(first, opt.step, opt.zero_grad, 1)
    second = small_net(seed=5)
    second.load_state_dict(first.state_dict())
    opt = SPDKFACOptimizer(second, lr=0.02, momentum=0.9, **options)
    _steps(second, opt.step, opt.zero_grad, 1)
    opt.flush()
    return [p.detach().clone() for p in second.parameters()]


@pytest.mark.parametrize("options", ["every-step", "forward-update-fusion", "eigen"])
@pytest.mark.parametrize("keep_first", [False, True], ids=["first-let-go", "first-still-referred-to"])
def test_a_second_optimizer_on_the_same_model_trains_it_as_on_a_fresh_one(keep_first: bool, options: str) -> None:
    got, kept = _two_stages(keep_first, OPTIONS[options])  # before: "factor A ... computed twice in one step"
    want = _two_stages_on_fresh_models(OPTIONS[options])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    if keep_first:
        with pytest.raises(RuntimeError, match="newer SPDKFACOptimizer"):
            kept[0].step()


def test_the_first_optimizers_held_updates_are_applied_when_it_is_taken_over() -> None:
    model = small_net()
    first = SPDKFACOptimizer(model, lr=0.05, update_fusion="forward")
    _steps(model, first.step, first.zero_grad, 1)
    assert first._forward_fusion is not None
    assert first._forward_fusion.pending
    reference = small_net()
    plain = SPDKFACOptimizer(reference, lr=0.05)
    _steps(reference, plain.step, plain.zero_grad, 1)
    SPDKFACOptimizer(model, lr=0.05)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_refused_second_optimizer_leaves_the_first_working() -> None:
    model, reference = small_net(), small_net()
    opt, ref_opt = SPDKFACOptimizer(model, lr=0.05), SPDKFACOptimizer(reference, lr=0.05)
    with pytest.raises(ValueError, match="damping"):
        SPDKFACOptimizer(model, lr=0.05, damping=-1.0)
    for m, o in ((model, opt), (reference, ref_opt)):
        _steps(m, o.step, o.zero_grad, 1)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_optimizers_of_separate_submodules_coexist() -> None:
    """One optimizer per part of a model (no module in common): neither takes the other over; without the KL clip
    (one number over all layers) they step as one optimizer on the whole model."""
    whole, parts = small_net(), small_net()
    one = SPDKFACOptimizer(whole, lr=0.05, kl_clip=None)
    first, second = SPDKFACOptimizer(parts[:3], lr=0.05, kl_clip=None), SPDKFACOptimizer(parts[3:], lr=0.05, kl_clip=None)

    def both(name: str) -> Callable[[], None]:
        def call() -> None:
            getattr(first, name)()
            getattr(second, name)()

        return call

    _steps(whole, one.step, one.zero_grad, 1)
    _steps(parts, both("step"), both("zero_grad"), 1)
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        assert torch.equal(a, b)
