"""Iteration time with and without update fusion: a step's kernels replayed on a device description.

The seed (*Optimizer Fusion*, ``../shared/papers/optimizer-fusion.txt``)
explains its gain by locality (a fused update touches a parameter or gradient
that its pass has just touched) and parallelism (backward-fused updates run
while backward goes on), and reports that the time saved per iteration does
not depend on the batch and grows as the layers get smaller: a cost per
parameter tensor, the update's kernel launches. This model has exactly those
terms and no others:

* **Kernels.** A step's forward and backward kernels, counted on ``meta``
  tensors (:func:`~.kernel_trace.trace_training_step`), and each parameter's
  update kernels, traced from the code the optimizer runs
  (:func:`~spdkfac.update.base_update.sgd_param_update`). A kernel takes
  ``max(flops / flop_rate, bytes / bandwidth)`` on the device.
* **Launches.** The host spends ``launch_s`` per kernel. On an asynchronous
  device (a GPU stream) the host issues ahead and the device runs kernels in
  order as soon as they are issued; a kernel that reads a value back (a
  ``sync``) makes the host wait for the device. On a synchronous device (a
  CPU) the host runs each kernel itself: ``launch_s`` plus the kernel.
  The training loop waits for the device once per iteration (it reads the
  loss): ``sync_after='backward'`` (host and device in step when
  ``step()`` begins: the seed's baseline, whose step overlaps nothing) or
  ``'step'`` (the host may still be ahead of the device when ``step()``
  begins, and the unfused update's launches hide behind backward's queue).
* **Placement.** ``'none'``: the updates after backward (and after
  ``step()``'s non-finite check, for the ``spdkfac`` recipe).
  ``'forward'``: each parameter's update just before the first kernel of the
  module that holds it, in the next forward pass. ``'backward'``: each
  parameter's update as soon as its gradient is final (for ``spdkfac``:
  with the copies kept for a rollback, and one non-finite check of every
  gradient at the end of backward).
* **What fusion can save.** The device runs one kernel at a time (one
  stream), so a fused update still takes its device time; what fusion hides
  is the host's launches, behind forward or backward kernels already
  queued. Forward fusion leaves the first module's update exposed (nothing
  is queued before it), backward fusion the last gradient's.
* **Locality.** The one read that directly follows a write of the same
  tensor is saved when the tensor fits in ``cache_bytes``: forward fusion
  saves the forward kernel's read of the parameter the update has just
  written; backward fusion saves the update's read of the gradient the
  backward has just written (a read from a kernel bound by its arithmetic
  saves nothing). Nothing else is assumed saved.

Not modelled: several streams, kernels' fixed minimum device time, caches
beyond that one read, memory allocation, communication (one worker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..step.nonfinite import non_finite
from ..update.base_update import sgd_param_update
from ..update.update_fusion import UpdateFusion
from .kernel_trace import Kernel, StepTrace, trace_kernels

__all__ = [
    "RECIPES",
    "Device",
    "Recipe",
    "iteration_kernels",
    "iteration_seconds",
    "predicted_gains",
    "stream_seconds",
]

SyncPoint = Literal["backward", "step"]
ELEMENT_BYTES = 4  # float32 parameters and gradients


@dataclass(frozen=True)
class Device:
    """What the model needs to know of a device.

    Args:
        name: a label.
        bandwidth: bytes/s a memory-bound kernel reaches.
        flop_rate: FLOP/s the convolutions and matrix products reach.
        launch_s: host seconds to issue one kernel (eager PyTorch: dispatch and launch).
        asynchronous: the host issues kernels ahead of the device (a GPU
            stream); False: the host runs each kernel itself (a CPU).
        cache_bytes: a tensor read right after it was written is read from
            cache when it is no larger than this.
    """

    name: str
    bandwidth: float
    flop_rate: float
    launch_s: float
    asynchronous: bool
    cache_bytes: float = 0.0

    def kernel_seconds(self, k: Kernel) -> float:
        """Device time of one kernel: bound by its arithmetic or by its memory traffic."""
        return max(k.flops / self.flop_rate, k.bytes / self.bandwidth)


def stream_seconds(kernels: Sequence[Kernel], device: Device) -> float:
    """Time until the device has run ``kernels`` (issued in order by one host thread), starting idle and in step."""
    host = dev = 0.0
    for k in kernels:
        host += device.launch_s
        if device.asynchronous:
            dev = max(dev, host) + device.kernel_seconds(k)
            if k.sync:
                host = dev
        else:
            host = dev = host + device.kernel_seconds(k)
    return dev


@dataclass(frozen=True)
class Recipe:
    """The kernels an optimizer runs per parameter (``n`` elements), traced from the code that runs them.

    ``update``: one parameter's update. ``check``: the non-finite check of
    gradients of these sizes (empty: none). ``backup``: what a backward-fused
    update keeps for a rollback, per parameter.
    """

    name: str
    update: Callable[[int], list[Kernel]]
    check: Callable[[list[int]], list[Kernel]]
    backup: Callable[[int], list[Kernel]]


def _meta(n: int) -> torch.Tensor:
    return torch.empty(n, device="meta")


def _sgd_update(n: int) -> list[Kernel]:
    """Momentum SGD with weight decay, momentum buffer present (every step after the first)."""
    p, state = _meta(n), {"momentum_buffer": _meta(n)}
    return trace_kernels(lambda: sgd_param_update(p, _meta(n), state, 0.1, 0.9, 5e-4))


def _spdkfac_check(sizes: list[int]) -> list[Kernel]:
    grads = [_meta(n) for n in sizes]
    return trace_kernels(lambda: non_finite((str(i), g) for i, g in enumerate(grads)))


def _spdkfac_backup(n: int) -> list[Kernel]:
    """The copies :class:`~spdkfac.update.update_fusion.BackwardFusion` keeps of a parameter and its momentum buffer."""
    p, buf = _meta(n), _meta(n)
    return trace_kernels(lambda: (p.detach().clone(), buf.clone()))


#: ``seed``: the update alone (a plain eager loop with a for-loop momentum SGD, the seed's setting);
#: ``spdkfac``: as this project's optimizer runs it (non-finite checks, rollback copies under backward fusion).
RECIPES: dict[str, Recipe] = {
    "seed": Recipe("seed", _sgd_update, lambda sizes: [], lambda n: []),
    "spdkfac": Recipe("spdkfac", _sgd_update, _spdkfac_check, _spdkfac_backup),
}


def _cached(n: int, device: Device) -> float:
    """Bytes of an ``n``-element tensor's read that the cache serves right after its write (0 when it does not fit)."""
    nbytes = float(ELEMENT_BYTES * n)
    return nbytes if nbytes <= device.cache_bytes else 0.0


def _less_traffic(k: Kernel, nbytes: float) -> Kernel:
    return replace(k, bytes=max(0.0, k.bytes - nbytes)) if nbytes else k


def iteration_kernels(
    trace: StepTrace, mode: UpdateFusion | str, recipe: Recipe, device: Device, sync_after: SyncPoint = "backward"
) -> list[Kernel]:
    """One iteration's kernels in issue order, with the loop's sync after ``backward()`` or after ``step()``."""
    params = trace.params
    updates = {i: recipe.update(n) for i, n in enumerate(params)}
    mode = UpdateFusion.parse("update_fusion", mode)
    if mode is UpdateFusion.FORWARD:
        forward: list[Kernel] = []
        for j, k in enumerate(trace.forward):
            held = trace.forward_slots.get(j, [])
            for i in held:
                forward += updates[i]
            forward.append(_less_traffic(k, sum(_cached(params[i], device) for i in held)))  # reads what was just written
    else:
        forward = list(trace.forward)
    if mode is UpdateFusion.BACKWARD:
        backward: list[Kernel] = []
        for j, k in enumerate(trace.backward):
            backward.append(k)
            for i in trace.backward_slots.get(j, []):
                first, *rest = recipe.backup(params[i]) + updates[i]
                backward += [_less_traffic(first, _cached(params[i], device)), *rest]  # reads the gradient just written
        backward += recipe.check(params)  # once, at the end of backward(): the updates are rolled back if it fails
        step: list[Kernel] = []
    else:
        backward = list(trace.backward)
        step = recipe.check(params) + ([k for i in range(len(params)) for k in updates[i]] if mode is UpdateFusion.NONE else [])
    read_loss = Kernel("read loss", sync=True)
    if sync_after == "backward":
        return [*forward, *backward, read_loss, *step]
    return [*forward, *backward, *step, read_loss]


def iteration_seconds(
    trace: StepTrace, mode: UpdateFusion | str, recipe: Recipe, device: Device, sync_after: SyncPoint = "backward"
) -> float:
    """Predicted seconds per iteration with update fusion ``mode`` (the next iteration starts with the device idle)."""
    return stream_seconds(iteration_kernels(trace, mode, recipe, device, sync_after), device)


def predicted_gains(trace: StepTrace, recipe: Recipe, device: Device, sync_after: SyncPoint = "backward") -> dict[str, float]:
    """Seconds per iteration for each mode, and the throughput gain (unfused time over fused) of each fused mode."""
    t = {mode.plain(): iteration_seconds(trace, mode, recipe, device, sync_after) for mode in UpdateFusion}
    return {**{f"{m}_s": t[m] for m in t}, "forward": t["none"] / t["forward"], "backward": t["none"] / t["backward"]}
