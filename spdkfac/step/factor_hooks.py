"""The Kronecker factors of each step: computed in the layers' hooks, sent while the passes go on.

A forward pre-hook computes each layer's ``A`` from its input; a gradient
hook on the layer's output computes ``G`` as soon as the backward pass reaches
it. Each goes straight to the :class:`~spdkfac.step.factor_allreduce.TensorFusionController`
(pipelining), or is kept until ``step()`` (D-KFAC's all-at-once). With
gradient accumulation the early micro-batches' factors are summed locally and
only the k-th is sent, as their mean. While a fusion plan is being made, or a
timeline recorded, each factor's computation is timed, and the hook's own
work beyond it (bookkeeping, packing into a fusion buffer, launching the
all-reduce).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..kfac.layers import FACTOR_KINDS, FactorKey, KFACLayer
from ..kfac.linalg import non_finite_indices
from .compiled_hooks import register_factor_pre_hook, register_output_grad_hook
from .factor_allreduce import TensorFusionController
from .factor_profiler import FusionProfiler
from .nonfinite import NonFiniteFactorError, NonFiniteGuard
from .timeline import IterationRecord, Timeline

__all__ = ["FactorCollector"]


class FactorCollector:
    """Hooks on every preconditioned layer that compute and send its batch factors.

    Args:
        layers: the preconditioned layers.
        controller: where the factors are sent.
        profiler: times the factors while a fusion plan is being made.
        pipelining: send each factor from its hook (else at ``step()``).
        accumulation_steps: backward passes per step.
        collecting: whether a forward pass of this module computes factors
            (training mode, gradients on, a factor step).
        loss_scale: the loss scale of this backward pass (GradScaler; 1 without).
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        controller: TensorFusionController,
        profiler: FusionProfiler,
        pipelining: bool,
        accumulation_steps: int,
        collecting: Callable[[nn.Module], bool],
        loss_scale: Callable[[], float],
    ) -> None:
        self.layers = layers
        self.controller = controller
        self.profiler = profiler
        self.pipelining = pipelining
        self.accumulation_steps = accumulation_steps
        self.collecting = collecting
        self.loss_scale = loss_scale
        self.record: IterationRecord | None = None
        self.arrived: dict[str, list[FactorKey]] = {"A": [], "G": []}
        self.backward_seen = False  # a G factor was computed since reset()
        self._stash: list[tuple[FactorKey, torch.Tensor]] = []
        self._a_taken: set[str] = set()
        self._micro: dict[FactorKey, tuple[int, torch.Tensor | None]] = {}  # micro-batches so far: (count, sum)
        self._hook_handles: list[Any] = []
        for layer in layers:
            # (registered so that a torch.compile'd forward calls them without a graph break: compiled_hooks)
            self._hook_handles.append(register_factor_pre_hook(layer.module, self._a_hook(layer)))
            self._hook_handles.append(register_output_grad_hook(layer.module, *self._g_hook(layer)))

    def reset(self, record: IterationRecord | None) -> None:
        """Start a new step: nothing computed, nothing kept back."""
        self.record = record
        self.arrived = {"A": [], "G": []}
        self.backward_seen = False
        self._stash = []
        self._a_taken = set()
        self._micro = {}
        for layer in self.layers:
            layer.helper.forget()  # inputs a forward pass kept for a backward pass that never came

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if self.collecting(module):
                self._submit(layer, "A", lambda: layer.compute_a(inputs[0]))

        return hook

    def _g_hook(self, layer: KFACLayer) -> tuple[Callable[[], bool], Callable[[torch.Tensor], None]]:
        """When the layer's output gradient is wanted (its A was taken this step), and what computes G from it.

        Registered as a hook on the layer output's gradient
        (:func:`~spdkfac.step.compiled_hooks.register_output_grad_hook`): it
        fires in the backward pass as soon as the gradient with respect to
        this layer's output is known, like a full backward hook, but it also
        works when the next operation modifies the output in place
        (``ReLU(inplace=True)``) and for a first layer whose input needs no
        gradient.
        """

        def g_ready(grad_output: torch.Tensor) -> None:
            # Each micro-batch loss carries 1/accumulation_steps: dividing it out like a loss scale gives its true G.
            scale = self.loss_scale() / self.accumulation_steps
            self._submit(layer, "G", lambda: layer.compute_g(grad_output, scale))

        return (lambda: layer.name in self._a_taken), g_ready

    def _submit(self, layer: KFACLayer, kind: str, compute: Callable[[], torch.Tensor]) -> None:
        t_enter = Timeline.now() if self.record is not None else 0.0
        key = (kind, layer.name)
        self.backward_seen |= kind == "G"
        if kind == "A":
            self._a_taken.add(layer.name)
        count, total = self._micro.get(key, (0, None))
        if count + 1 > self.accumulation_steps:
            times = "twice" if count + 1 == 2 else f"{count + 1} times"
            raise RuntimeError(
                f"factor {kind} of layer {layer.name!r} was computed {times} in one step, but accumulation_steps is "
                f"{self.accumulation_steps}: call step() after every {self.accumulation_steps} forward/backward pass(es), "
                "and run each preconditioned layer once per pass (no weight sharing); to skip a batch after its "
                "forward pass, decide with optimizer.finite_everywhere(loss), which drops its factors on every worker"
            )
        if count + 1 < self.accumulation_steps:  # an early micro-batch: sum locally, communicate nothing
            factor = compute()
            self._micro[key] = (count + 1, factor if total is None else total.add_(factor))
            return
        self._micro[key] = (count + 1, None)
        # The last micro-batch (the only one with k=1): timed and pipelined with the communication as usual.
        profiling = self.profiler.active
        timed = self.record is not None or profiling
        t_start = t_end = 0.0
        if timed:
            if profiling and torch.cuda.is_available():
                torch.cuda.synchronize()
            t_start = Timeline.now()
        factor = compute()
        if total is not None:  # the mean over the micro-batches
            factor = total.add_(factor).div_(self.accumulation_steps)
        if timed:
            if profiling and factor.is_cuda:
                torch.cuda.synchronize()
            t_end = Timeline.now()
            self.profiler.factor_timed(kind, t_start, t_end)
            if self.record is not None:
                self.record.factor_computed(key, t_start, t_end)
                self.controller.poll()
        if self.pipelining:
            self.arrived[kind].append(key)
            self.controller.submit(key, factor)
        else:
            self._stash.append((key, factor))
        if self.record is not None:  # the hook's own cost: all but the factor's computation (a cost model charges it apart)
            self.record.hooks += Timeline.now() - t_enter - (t_end - t_start)

    def send_stashed(self) -> None:
        """Without pipelining, send the factors the hooks kept back (D-KFAC: all at once after backward)."""
        for key, factor in self._stash:
            self.arrived[key[0]].append(key)
            self.controller.submit(key, factor)
        self._stash = []

    def take(self, nonfinite: NonFiniteGuard, step: int) -> dict[FactorKey, torch.Tensor]:
        """Wait for this step's averaged factors (packed); raise if one is missing or non-finite."""
        self.send_stashed()
        factors = self.controller.wait_all()
        if not factors:
            raise RuntimeError(
                "step() was called on a factor-update step but no Kronecker factor was computed: run the "
                "forward and backward pass in training mode (model.train()) with gradients enabled before step(); "
                "a torch.compile'd model must first run after the optimizer is built (Dynamo does not see hooks added "
                "to a model, or to another instance of its class, it has already compiled; torch._dynamo.reset() forgets those)"
            )
        expected = {(kind, layer.name) for layer in self.layers for kind in FACTOR_KINDS}
        missing = sorted(expected - factors.keys())
        if missing:
            raise RuntimeError(f"no factor was computed for {missing} in this step; every preconditioned layer must run")
        keys = list(factors)
        bad = [keys[i] for i in non_finite_indices([factors[key] for key in keys])]
        if bad:
            nonfinite.bad_step(NonFiniteFactorError(sorted(bad), step))
        return factors

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
