"""The kernels a piece of PyTorch code runs, with their arithmetic and memory traffic, counted without running it.

Code runs under a dispatch mode on ``meta`` tensors (shapes only, nothing
computed), so a full-size training step of an ImageNet model is counted in
about a second. Each ATen operator that does work is one :class:`Kernel`:

* ``flops``: torch's own FLOP formulas (:data:`torch.utils.flop_counter.flop_registry`:
  convolutions and matrix products, forward and backward); 0 for other ops;
* ``bytes``: every tensor the operator reads or writes, once each (an
  in-place operator reads and writes its first argument: twice);
* ``sync``: the operator reads a value back to the host (``.item()``,
  ``bool(t)``); the host waits for the device there. On ``meta`` tensors
  such a read answers ``True``/``0``, so code that branches on a check (the
  non-finite check) follows its all-finite path.

Views, ``detach`` and allocations move no data and launch nothing; they are
left out. :func:`trace_training_step` counts one step of a model and records
where update fusion would put each parameter's update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..update.update_fusion import update_owners

__all__ = ["Kernel", "StepTrace", "trace_kernels", "trace_training_step"]

_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh", "_to_copy_noop"}
_READ_BACK = {"_local_scalar_dense"}


@dataclass(frozen=True)
class Kernel:
    """One operator's work: floating-point operations, bytes read + written, and whether the host waits for it."""

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    sync: bool = False


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Appends a :class:`Kernel` per operator that does work, to ``kernels``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _READ_BACK:
            self.kernels.append(Kernel(name, sync=True))
            (t,) = args
            return True if t.dtype == torch.bool else 0
        out = func(*args, **kwargs)
        if func.is_view or name in _NO_KERNEL:
            return out
        moved = {id(t): t.nbytes for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        flops = _flops(func, args, kwargs, out)
        written_in_place = sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor) and any(t is a for a in args))
        self.kernels.append(Kernel(name, flops, float(sum(moved.values()) + written_in_place)))
        return out


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """FLOPs of one operator: torch's formula, but a convolution's backward as its forward per gradient it computes.

    (torch's backward formula ignores ``groups``: it counts a depthwise
    convolution's backward as ``in_channels`` times too much.)
    """
    if func.overloadpacket is torch.ops.aten.convolution_backward and not args[7]:  # not transposed
        grad_out, weight, output_mask = args[0], args[2], args[10]
        return float(2 * grad_out.numel() * (weight.numel() // weight.shape[0]) * (int(output_mask[0]) + int(output_mask[1])))
    count = flop_registry.get(func.overloadpacket)
    return float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0


def trace_kernels(fn: Callable[[], object]) -> list[Kernel]:
    """The kernels ``fn()`` runs (call it with ``meta`` tensors to count without computing)."""
    rec = _Recorder()
    with rec:
        fn()
    return rec.kernels


@dataclass
class StepTrace:
    """One training step's forward and backward kernels, and where each parameter's fused update would go.

    ``params`` holds each trainable tensor's element count. ``forward_slots[i]``
    lists the parameters whose forward-fused update runs just before
    ``forward[i]`` (the forward pre-hook of the module that holds them, as
    :class:`~spdkfac.update.update_fusion.ForwardFusion`); ``backward_slots[i]``
    those whose gradient is final once ``backward[i]`` has run (the earliest
    point of a backward-fused update).
    """

    forward: list[Kernel]
    backward: list[Kernel]
    params: list[int]
    forward_slots: dict[int, list[int]] = field(default_factory=dict)
    backward_slots: dict[int, list[int]] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.forward) + sum(k.flops for k in self.backward)


def trace_training_step(model: nn.Module, input_shape: Sequence[int]) -> StepTrace:
    """Count one forward + backward (cross-entropy loss) of ``model`` on a batch of ``input_shape``, on ``meta`` tensors.

    The model is moved to ``meta`` (its values are lost: pass a model built for counting).
    """
    model = model.to("meta").train()
    params = [p for p in model.parameters() if p.requires_grad]
    index: dict[torch.Tensor, int] = {p: i for i, p in enumerate(params)}
    rec = _Recorder()
    forward_slots: dict[int, list[int]] = {}
    backward_slots: dict[int, list[int]] = {}
    handles = []
    for module, owned in update_owners(model, params).items():

        def pre_hook(_m: nn.Module, _inputs: Any, owned: list[torch.Tensor] = owned) -> None:
            forward_slots.setdefault(len(rec.kernels), []).extend(index[p] for p in owned)

        handles.append(module.register_forward_pre_hook(pre_hook))

    def grad_hook(p: torch.Tensor) -> None:
        backward_slots.setdefault(len(rec.kernels) - 1, []).append(index[p])

    handles += [p.register_post_accumulate_grad_hook(grad_hook) for p in params]  # type: ignore[no-untyped-call]
    x = torch.empty(*input_shape, device="meta")
    with rec:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, torch.zeros(input_shape[0], dtype=torch.long, device="meta"))
        n_forward = len(rec.kernels)
        torch.autograd.backward(loss)
    for h in handles:
        h.remove()
    backward_slots = {i - n_forward: ps for i, ps in backward_slots.items()}
    return StepTrace(rec.kernels[:n_forward], rec.kernels[n_forward:], [p.numel() for p in params], forward_slots, backward_slots)
