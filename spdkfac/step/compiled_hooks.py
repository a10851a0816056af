"""Module hooks that ``torch.compile`` traces without a graph break: their Python work runs when the graph runs.

Dynamo traces a module's hooks with its ``forward()``. The factor hooks do
Python bookkeeping (counters, dicts, timers, launching all-reduces), so traced
as they are they break the graph at every layer, and whatever they read
becomes a guard. Registered through this module, a hook puts one opaque op
into the graph instead: ``spdkfac::hook_tap``, a custom op registered as
ordered and side-effecting (so it is neither removed nor reordered with the
other taps), whose kernel calls the hook's Python code with the real tensors
when the compiled graph runs. A forward pre-hook becomes a tap on its inputs;
an output-gradient hook becomes a tensor hook whose body is a tap, which
AOTAutograd places in the compiled backward graph. Run eagerly, the hooks are
called exactly as registered.

What a tap changes, and what the hooks rely on: the tap's kernel runs with
autograd off, on tensors that need no gradient, so a pre-hook is called
under ``torch.enable_grad()`` (a tap is only put in a graph traced with
gradients on, on a module in training mode; Dynamo recompiles when either
changes). An output-gradient hook's ``wanted()`` is asked when the gradient
arrives, not in the forward pass.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from ..kfac.layer_types.shared_input import compiled_buffers
from .module_hooks import HookHandle, register

__all__ = ["TAPS_AVAILABLE", "compiling", "register_factor_pre_hook", "register_output_grad_hook", "run_eagerly"]

#: Whether this torch has what a tap needs (custom ops, effect registration); without it the hooks are plain hooks
#: (read when a hook is registered).
TAPS_AVAILABLE = (
    all(hasattr(torch.library, name) for name in ("custom_op", "_register_effectful_op"))
    and hasattr(torch.compiler, "is_compiling")
    and hasattr(getattr(torch._library, "effects", None), "EffectType")
)

_OP = "spdkfac::hook_tap"
_ids = itertools.count()
_taps: weakref.WeakValueDictionary[int, _Tap] = weakref.WeakValueDictionary()  # alive while its hook is registered


class _Tap:
    """A hook's run-time body, found by the number the graph passes to the op."""

    def __init__(self, run: Callable[[list[torch.Tensor]], None]) -> None:
        self.run = run
        self.id = next(_ids)
        _taps[self.id] = self


def _hook_tap(tensors: list[torch.Tensor], tap: int) -> None:
    """The op's kernel: the hook's Python work, when the compiled graph runs (a removed hook's tap does nothing)."""
    found = _taps.get(tap)
    if found is not None:
        found.run(tensors)


def _hook_tap_fake(tensors: list[torch.Tensor], tap: int) -> None:
    """Nothing to infer: the op returns nothing."""


#: A CUDA graph (``mode="reduce-overhead"``) would replay a tap's kernels without its Python: the tag makes inductor
#: leave each tap outside its graphs, where torch has it (2.13 and 2.14 do, 2.4 does not).
_CUDAGRAPH_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)

if TAPS_AVAILABLE:
    if _CUDAGRAPH_UNSAFE is not None:
        torch.library.custom_op(_OP, _hook_tap, mutates_args=(), tags=(_CUDAGRAPH_UNSAFE,)).register_fake(_hook_tap_fake)
    else:  # (a torch without the tag: no tags argument either)
        torch.library.custom_op(_OP, _hook_tap, mutates_args=()).register_fake(_hook_tap_fake)
    torch.library._register_effectful_op(_OP, torch._library.effects.EffectType.ORDERED)


def _tap(tensors: list[torch.Tensor], tap: _Tap) -> None:
    torch.ops.spdkfac.hook_tap(tensors, tap.id)


def compiling() -> bool:
    """Whether Dynamo is tracing this call (False on a torch without ``torch.compiler.is_compiling``)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable``: a hook that must run as Python (a graph break where a compiled forward calls it)."""
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
        disabled: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return disabled
    return fn


def register_factor_pre_hook(module: nn.Module, hook: Callable[[nn.Module, tuple[Any, ...]], None]) -> HookHandle:
    """``module.register_forward_pre_hook(hook)``; in a compiled forward (gradients on) a tap on the inputs.

    Registered as the optimizer's (:mod:`~spdkfac.step.module_hooks`): keep
    the returned handle to keep the hook. ``hook`` must only read its inputs (it may not replace them). With
    gradients off a compiled forward calls nothing: the hook's caller then
    computes no factor anyway (it decides from the model's mode, which a
    module's own does not tell: a part in eval mode may still train).
    """
    if not TAPS_AVAILABLE:
        return register(module.register_forward_pre_hook, hook)
    tap = _Tap(lambda tensors: _call_with_grad(hook, module, tensors))

    def pre_hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
        if not torch.compiler.is_compiling():
            hook(module, inputs)
        elif torch.is_grad_enabled() and all(isinstance(x, torch.Tensor) for x in inputs):
            _tap(list(inputs), tap)
        elif torch.is_grad_enabled():
            run_eagerly(hook)(module, inputs)  # inputs that are not all tensors: the hook itself, a graph break

    pre_hook.tap = tap  # type: ignore[attr-defined]  # kept alive with the hook
    return register(module.register_forward_pre_hook, pre_hook)


def _call_with_grad(hook: Callable[[nn.Module, tuple[Any, ...]], None], module: nn.Module, tensors: list[torch.Tensor]) -> None:
    # With gradients on, as in the traced forward (a tap is only emitted with gradients on); the tensors are the graph's
    # buffers, whose memory inductor reuses by plan: no Gram is reused for what looks like the same input.
    with torch.enable_grad(), compiled_buffers():
        hook(module, tuple(tensors))


def _noting_repeats(on_grad: Callable[[torch.Tensor], Any], on_repeat: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    """``on_grad`` for one output, then ``on_repeat`` when it takes a gradient there a second time (another pass)."""
    taken = False

    def hook(grad: torch.Tensor) -> None:
        nonlocal taken
        if on_grad(grad):
            if taken:
                on_repeat()
            taken = True

    return hook


def register_output_grad_hook(
    module: nn.Module,
    wanted: Callable[[], bool],
    on_grad: Callable[[torch.Tensor], Any],
    on_repeat: Callable[[], None] | None = None,
) -> HookHandle:
    """A forward hook that calls ``on_grad`` with the gradient of ``module``'s output in the backward pass.

    Eagerly: when ``wanted()`` in the forward pass, a gradient hook on the
    output (it fires as soon as that gradient is known, also when the next
    operation modifies the output in place, and for a first layer whose input
    needs no gradient). Compiled: always a tap in the backward graph, which
    asks ``wanted()`` when the gradient arrives. So ``wanted`` must give the
    same answer at both times: it may depend on the step's state, not on
    whether a backward pass is running. ``on_repeat`` (eager only) is called
    when ``on_grad`` takes (returns True for) one output's gradient a second
    time: a second backward pass through the same forward pass
    (``backward(retain_graph=True)`` and another).
    """
    tapped = TAPS_AVAILABLE
    tap = _Tap(lambda tensors: on_grad(tensors[0]) if wanted() else None)

    def grad_tap(grad: torch.Tensor) -> None:
        _tap([grad], tap)

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if tapped and torch.compiler.is_compiling():
            output.register_hook(grad_tap)  # type: ignore[no-untyped-call]  # torch leaves Tensor.register_hook unannotated
        elif wanted():
            output.register_hook(on_grad if on_repeat is None else _noting_repeats(on_grad, on_repeat))  # type: ignore[no-untyped-call]

    hook.tap = tap  # type: ignore[attr-defined]  # kept alive with the hook
    return register(module.register_forward_hook, hook)
