"""The order of the K-FAC work in one ``step()``, over the parts that do it.

Two orders, because the preconditioning only needs the decompositions in use:

* steps that decompose (and single-worker runs, or with
  ``overlap_preconditioning`` off): wait for every gradient, fold in the
  factors, decompose, precondition;
* steps that keep the decompositions
  (:func:`~spdkfac.plan.work_plan.overlaps_preconditioning`): precondition each layer
  as soon as its gradient is averaged, last layer first, while the remaining
  gradient and factor all-reduces are still in flight, then fold in the
  factors.

Under ``update_fusion='backward'`` the steps that keep the decompositions are
preconditioned and updated layer by layer inside ``backward()``
(:mod:`spdkfac.update.update_fusion`) and ``step()`` only folds in the factors
(:meth:`KFACStep.run_after_fused`).

Either way the update is checked for NaN/Inf before any parameter changes;
a bad step is skipped on every worker alike (the values checked are the same
everywhere) or raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..comm import CommBackend
from ..config import KFACConfig
from ..kfac.layers import FACTOR_KINDS, KFACLayer
from ..kfac.linalg import all_finite, non_finite_indices
from ..perfmodels import PerfModel
from ..plan.work_plan import WorkPlan, overlaps_preconditioning
from .collective_order import CollectiveOrder
from .data_parallel import ModelWrapping
from .decomposition_stage import DecompositionStage
from .factor_allreduce import TensorFusionController
from .factor_hooks import FactorCollector
from .factor_profiler import FusionProfiler
from .grad_sync import GradientSync
from .nonfinite import NonFiniteError, NonFiniteGuard, non_finite
from .preconditioning import Preconditioner
from .timeline import IterationRecord

__all__ = ["KFACStep", "StepHyper"]


@dataclass(frozen=True)
class StepHyper:
    """The hyperparameters in force for one step (from ``param_groups[0]``, validated when the step was fixed)."""

    lr: float
    damping: float
    factor_decay: float
    kl_clip: float | None = None
    #: Each K-FAC layer's learning rate where some differ from ``lr`` (layers in groups of their own rates), for the
    #: KL clip; None where every layer trains at ``lr``.
    layer_lrs: Mapping[str, float] | None = None

    @classmethod
    def from_group(cls, group: dict[str, Any], layer_lrs: Mapping[str, float] | None = None) -> StepHyper:
        """The values of an optimizer param group (and the layers' own rates)."""
        kl_clip = group["kl_clip"]
        return cls(
            lr=float(group["lr"]),
            damping=float(group["damping"]),
            factor_decay=float(group["factor_decay"]),
            kl_clip=None if kl_clip is None else float(kl_clip),
            layer_lrs=layer_lrs,
        )


class KFACStep:
    """The parts of the K-FAC step, and the order of their work in ``step()`` (all before the SGD update).

    Builds the parts for the optimizer: the factor hooks and the fusion
    controller and profiler they feed, the gradient averaging, the
    decomposition stage and the preconditioner (the last two following the
    work plan).
    """

    def __init__(
        self,
        config: KFACConfig,
        layers: list[KFACLayer],
        backend: CommBackend,
        perf_model: PerfModel,
        work_plan: WorkPlan,
        param_groups: list[dict[str, Any]],
        param_names: dict[torch.Tensor, str],
        grad_scaler: Any | None,
        collecting: Callable[[nn.Module], bool],
        loss_scale: Callable[[], float],
        on_final_grad: Callable[[torch.Tensor], None] | None = None,
        wrapping: ModelWrapping | None = None,
        factor_step: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self.layers = layers
        self._by_name = {layer.name: layer for layer in layers}
        self.workers = backend.size
        self.rank = backend.rank
        self.work_plan = work_plan
        self.param_groups = param_groups
        self.param_names = param_names
        self.nonfinite = NonFiniteGuard(config.skip_nonfinite)
        params = [p for group in param_groups for p in group["params"]]
        self.order = CollectiveOrder(backend, params)  # the hooks' all-reduces, paired alike on every rank
        self.controller = TensorFusionController(backend, self.order)
        self.profiler = FusionProfiler(config, backend, layers, self.controller, perf_model)
        self.factors = FactorCollector(
            layers,
            self.controller,
            self.profiler,
            config.pipelining,
            config.accumulation_steps,
            collecting,
            loss_scale,
            factor_step,
            self.order,
        )
        self.grads = GradientSync(
            backend, param_groups, param_names, config.accumulation_steps, grad_scaler, on_final_grad, wrapping, self.order
        )
        self.decompositions = DecompositionStage([layer for layer in layers if layer.preconditions], work_plan.inversion, backend)
        self.preconditioner = Preconditioner(layers, backend, work_plan, self.grads.wait)
        self.record: IterationRecord | None = None
        self.overlapped_steps = 0  # steps that preconditioned while gradients were still being averaged
        self.overlapped_factor_steps = 0  # of those, factor steps that preconditioned before waiting for the factors

    def begin(self, record: IterationRecord | None, abandon: bool = False) -> None:
        """Forget the finished (skipped, abandoned) step's state in every part."""
        self.record = record
        self.order.begin()
        self.profiler.begin_iteration()
        self.factors.reset(record)
        self.grads.reset(record)
        self.controller.begin_iteration(record, abandon=abandon)

    @property
    def backward_seen(self) -> bool:
        """Whether a backward pass ran since the step began (its gradients or factors exist)."""
        return self.grads.backward_seen or self.factors.backward_seen

    def run(self, factor_step: bool, inverse_step: bool, hyper: StepHyper, step: int) -> None:
        """Average, fold in, decompose and precondition as this step needs; check the result is finite.

        Raises :class:`~spdkfac.step.nonfinite.SkipStep` for a skipped step.
        """
        group = self.param_groups[0]
        self.order.settle()  # every all-reduce in flight, alike on every rank (which layers ran where agreed)
        for layer in self.layers:  # before either order preconditions: the global batch the hooks just saw, the base's hyper
            samples = self.factors.samples.get(layer.name, 0) if factor_step else None
            layer.method.begin_step(layer.method_state, samples, group)
        if self._overlapping(inverse_step):
            self._precondition(hyper, wait_for_grads=True)
            self.grads.synchronize()  # the parameters outside the preconditioned layers
            if factor_step:  # (after synchronize: a bad factor raises with no all-reduce left pending)
                self.update_factors(hyper, step)
                self.overlapped_factor_steps += 1
            self.overlapped_steps += 1
        else:
            self.grads.synchronize()
            if factor_step:
                self.update_factors(hyper, step)
            if inverse_step:
                self.update_decompositions(hyper, step)
            if self.config.precondition:
                self._precondition(hyper)
        self._check_finite(step)
        for layer in self.layers:  # the step stands: what the method learned from it becomes its state
            layer.method.commit(layer.method_state)

    def begin_fused_layer(self, layer: KFACLayer, factor_step: bool) -> None:
        """Before ``layer`` is preconditioned in backward (update fusion): its method takes the step's global batch
        (this worker's, times the workers and micro-batches, where the layer ran here) and the base's hyper."""
        ran = factor_step and self.factors.computed(("G", layer.name))
        samples = layer.local_samples * self.workers * self.config.accumulation_steps if ran else None
        layer.method.begin_step(layer.method_state, samples, self.param_groups[0])

    def run_after_fused(self, factor_step: bool, hyper: StepHyper, step: int, bad: list[str]) -> None:
        """The rest of a step whose layers were preconditioned and updated in backward (update fusion).

        Folds in the factors on a factor step; ``bad`` (non-empty: backward met
        NaN/Inf and wrote nothing) makes the step skipped or refused as usual;
        else what the methods learned in backward becomes their state.
        Raises :class:`~spdkfac.step.nonfinite.SkipStep` for a skipped step.
        """
        self.grads.synchronize()  # (done at the end of backward; idempotent; settles the order)
        if factor_step:
            self.update_factors(hyper, step)
        if bad:
            self._check_finite(step)
        for layer in self.layers:  # the step stands (as at the end of run())
            layer.method.commit(layer.method_state)

    def _overlapping(self, inverse_step: bool) -> bool:
        if not overlaps_preconditioning(self.config.overlap_preconditioning, self.config.precondition, self.workers, inverse_step):
            return False
        held = (layer for layer in self.layers if layer.preconditions and self.work_plan.holds(self.rank, layer.name))
        return not self.grads.synchronized and all(layer.decomposed for layer in held)  # else: the plain path

    def update_factors(self, hyper: StepHyper, step: int) -> None:
        """Fold this step's averaged factors into the running averages."""
        factors = self.factors.take(self.nonfinite, step)
        for (kind, name), mat in factors.items():
            self._by_name[name].update_factor(kind, mat, hyper.factor_decay)
        for name in self.factors.skipped:  # did not run: keeps its factors (the identity the averages start from, if none)
            layer = self._by_name[name]
            for kind in FACTOR_KINDS:
                if layer.packed_factor(kind) is None:
                    layer.set_factor(kind, layer.shape(kind).identity(layer.factor_dtype, layer.helper.weight.device))
        self.profiler.factor_step_done(self.factors.irregular)

    def update_decompositions(self, hyper: StepHyper, step: int) -> None:
        """Recompute the inverses (or eigendecompositions) where the work plan says; every rank gets all."""
        self.decompositions.run(hyper.damping, step, self.record)

    def _precondition(self, hyper: StepHyper, wait_for_grads: bool = False) -> None:
        self.preconditioner.run(hyper.damping, hyper.lr, hyper.kl_clip, wait_for_grads, self.record, hyper.layer_lrs)

    def _check_finite(self, step: int) -> None:
        """Skip (or refuse) a step whose averaged or preconditioned gradients hold NaN/Inf: never NaN parameters."""
        params = (p for group in self.param_groups for p in group["params"])
        bad = non_finite((self.param_names.get(p, "?"), p.grad) for p in params)
        if not bad:
            return
        bad_decompositions = [
            f"{kind}{layer.method.suffix} of {layer.name!r}"
            for layer in self.layers
            for kind in FACTOR_KINDS
            if layer.decomposition(kind) is not None and non_finite_indices(list(layer.method.tensors(layer.decomposition(kind))))
        ]
        label = self.layers[0].method.label if self.layers else ""
        cause = f"; the {label} {bad_decompositions} are non-finite (a damaged checkpoint?)" if bad_decompositions else ""
        self.nonfinite.bad_step(
            NonFiniteError(
                f"non-finite gradient(s) at step {step} for {bad[:8]}{' ...' if len(bad) > 8 else ''}{cause}. "
                "No parameter was changed. Check the inputs/loss of that step (or lower the learning rate)."
            )
        )

    def carry_over(self, previous: KFACStep) -> None:
        """Continue the state a replaced step kept across steps: the layers' use counts and samples, the non-finite
        counter, the eigenbasis refresh statistics and the overlap counts (the plan's parts start anew)."""
        self.factors.carry_over(previous.factors)
        self.nonfinite = previous.nonfinite
        self.decompositions.refreshes = previous.decompositions.refreshes
        self.overlapped_steps, self.overlapped_factor_steps = previous.overlapped_steps, previous.overlapped_factor_steps

    def remove_hooks(self) -> None:
        """Detach the factor and gradient hooks from the model."""
        self.factors.remove_hooks()
        self.grads.remove_hooks()

    def finite_everywhere(self, value: torch.Tensor, backend: CommBackend) -> bool:
        """Whether ``value`` is finite on every worker (one tiny all-reduce); if not, drop this step's factors."""
        flag = torch.tensor([1.0 if all_finite(value.detach()) else 0.0], dtype=torch.float64, device=value.device)
        if backend.size > 1:  # (after the factors A this step's order expects before it)
            self.order.sync_allreduce(flag, "spdkfac.finite_everywhere")
        finite = bool(flag.item() == 1.0)
        if not finite:
            self.controller.discard()
        return finite
