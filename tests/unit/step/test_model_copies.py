"""Copies of the model made while it trains: ``copy.deepcopy(model)`` and ``torch.save(model)``.

Scripts keep the best model so far, an EMA or SWA average or a distillation
teacher as a deep copy, and some save the whole model with ``torch.save``.
The optimizer's hooks on the model's modules used to travel with it: a
pickle failed ("Can't pickle local object"), a deep copy took the whole
optimizer along (and, with frozen parameters, its forward pass then failed
inside that copy), and the copy's forward passes fed the optimizer's factors.
Now a copy is a plain model, as with ``torch.optim``: it holds no optimizer,
it trains on its own, and the original's steps are bitwise those of a job
that never copied it.
"""

from __future__ import annotations

import copy
import gc
import io
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import batch, small_net

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.step.module_hooks import InertHook, OptimizerHook, register

warnings.filterwarnings("ignore", message="no perf_model given")

STEPS, COPY_AT = 4, 2


class Scaled(nn.Module):
    """small_net behind a parameter the root module holds itself (copied before the root's hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_net()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.gain)


OPTIONS: dict[str, dict[str, Any]] = {
    "every-step": {},
    "amortised": {"factor_update_freq": 2, "inv_update_freq": 2},
    "frozen-first-layer": {},
    "forward-update-fusion": {"update_fusion": "forward"},
    "backward-update-fusion": {"update_fusion": "backward", "kl_clip": None},
}


def _model(options: str) -> nn.Module:
    model = Scaled()
    if options == "frozen-first-layer":
        model.body[0].requires_grad_(False)  # (the optimizer then watches the model for unfreezing)
    return model


def _optimizer(model: nn.Module, options: str) -> SPDKFACOptimizer:
    return SPDKFACOptimizer(model, lr=0.05, momentum=0.9, damping=0.01, **OPTIONS[options])


def _train(
    options: str,
    after_copy_step: Callable[[nn.Module], Any] | None = None,
    between: Callable[[nn.Module, torch.Tensor], None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """STEPS steps; ``after_copy_step(model)`` after step COPY_AT; ``between(model, x)`` after every later forward pass.

    Returns the parameters after step COPY_AT and at the end, as the unfused optimizer would hold them, and what
    ``after_copy_step`` returned.
    """
    model = _model(options)
    opt = _optimizer(model, options)
    x, y = batch(8)
    at_copy: list[torch.Tensor] = []
    made = None
    for s in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x + 0.1 * s), y)
        if between is not None and s >= COPY_AT:
            between(model, x + 0.1 * s)
        loss.backward()
        opt.step()
        if s + 1 == COPY_AT:
            if after_copy_step is not None:
                made = after_copy_step(model)
            at_copy = [v.clone() for v in model.state_dict().values()]  # (state_dict() applies held updates)
    return at_copy, [v.clone() for v in model.state_dict().values()], made


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _train_alone(copied: nn.Module) -> None:
    """The copy trains with its own optimizer, in training mode (its hooks must not reach the original's)."""
    opt = torch.optim.SGD(copied.parameters(), lr=0.1)
    x, y = batch(8, seed=7)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(copied(x), y).backward()
        opt.step()


@pytest.mark.parametrize("options", list(OPTIONS))
def test_a_deep_copy_is_the_model_as_trained_so_far_without_the_optimizer(options: str) -> None:
    want_at_copy, want_end, _ = _train(options)

    def deep_copy(model: nn.Module) -> list[torch.Tensor]:
        copied = copy.deepcopy(model)
        # Its hooks hold no optimizer (before, a deep copy of the optimizer came along with them).
        assert all(isinstance(h, InertHook) for m in copied.modules() for h in _hooks(m))
        values = [v.clone() for v in copied.state_dict().values()]
        _train_alone(copied)
        return values

    got_at_copy, got_end, copied_values = _train(options, deep_copy)
    _assert_equal(copied_values, want_at_copy)  # forward fusion: the held updates applied before copying
    _assert_equal(got_at_copy, want_at_copy)
    _assert_equal(got_end, want_end)  # the copy trained alone; the original's steps are those of a job without it


def _hooks(module: nn.Module) -> list[Any]:
    dicts = (module._forward_pre_hooks, module._forward_hooks, module._state_dict_pre_hooks, module._load_state_dict_pre_hooks)
    return [getattr(h, "hook", h) for d in dicts for h in d.values()]  # (torch wraps load_state_dict pre-hooks)


@pytest.mark.parametrize("options", ["every-step", "amortised", "forward-update-fusion"])
def test_a_copy_run_inside_the_step_feeds_no_factor(options: str) -> None:
    """A teacher deep-copied from the model, run in training mode with gradients between the forward and backward pass."""
    _, want, _ = _train(options)
    teachers: list[nn.Module] = []

    def teach(model: nn.Module, x: torch.Tensor) -> None:
        F.mse_loss(teachers[0](x), torch.zeros(8, 5)).backward()  # the teacher's own backward pass, too

    _, got, _ = _train(options, lambda model: teachers.append(copy.deepcopy(model)), teach)
    _assert_equal(got, want)


@pytest.mark.parametrize("options", ["every-step", "frozen-first-layer", "forward-update-fusion"])
def test_torch_save_of_the_whole_model(options: str) -> None:
    want_at_copy, want_end, _ = _train(options)

    def save(model: nn.Module) -> bytes:
        buffer = io.BytesIO()
        torch.save(model, buffer)  # (before, "Can't pickle local object")
        return buffer.getvalue()

    got_at_copy, got_end, saved = _train(options, save)
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    _assert_equal(list(loaded.state_dict().values()), want_at_copy)  # the root's own gain too (written after pickling)
    _assert_equal(got_at_copy, want_at_copy)
    _assert_equal(got_end, want_end)
    assert all(isinstance(h, InertHook) for m in loaded.modules() for h in _hooks(m))

    # A new optimizer on the loaded model trains it as on a fresh model with those values.
    fresh = _model(options)
    fresh.load_state_dict(loaded.state_dict())
    x, y = batch(8, seed=3)
    for net in (loaded, fresh):
        opt = _optimizer(net, options)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        opt.flush()
    _assert_equal(list(loaded.state_dict().values()), list(fresh.state_dict().values()))


def test_the_preconditioners_hooks_stay_with_it_too() -> None:
    def job(copy_at_step: bool) -> list[torch.Tensor]:
        model = small_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kfac = KFACPreconditioner(model, damping=0.01)
        x, y = batch(8)
        teacher = None
        for s in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(model(x + 0.1 * s), y)
            if teacher is not None:
                teacher(x).sum().backward()
            loss.backward()
            kfac.step()
            opt.step()
            if copy_at_step and s == 0:
                teacher = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        return [p.detach().clone() for p in model.parameters()]

    _assert_equal(job(True), job(False))


def test_an_optimizer_hook_is_called_as_its_function_while_its_handle_lives() -> None:
    calls: list[tuple[Any, ...]] = []

    def fn(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "result"

    module = nn.Linear(2, 2)
    handle = register(module.register_forward_pre_hook, fn)
    (hook,) = module._forward_pre_hooks.values()
    assert isinstance(hook, OptimizerHook)
    assert hook(1, 2, key=3) == "result"
    assert calls == [((1, 2), {"key": 3})]
    assert isinstance(copy.deepcopy(hook), InertHook)
    assert copy.deepcopy(hook)(1, 2) is None
    del handle, fn
    gc.collect()
    assert not module._forward_pre_hooks  # the handle freed: the hook removed
    assert hook(1, 2) is None  # and one still referred to does nothing
