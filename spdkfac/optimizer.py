"""SPDKFACOptimizer: distributed K-FAC as a drop-in replacement for ``torch.optim.SGD``.

The optimizer is wiring: it validates the options (:class:`~spdkfac.config.KFACConfig`),
builds the parts (factor hooks, gradient averaging, fusion controller and profiler,
work plan, decomposition stage, preconditioner), fixes each step's hyperparameters
and leaves the order of the K-FAC work to :class:`~spdkfac.kfac_step.KFACStep`;
then it takes the momentum-SGD step. See ``docs/design.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn

from .comm import CommBackend, get_backend
from .config import SCHEDULE_CHECKS, ComputeMethod, EigenRefresh, FusionPolicy, KFACConfig, Placement, check_hyperparameters
from .coverage import kfac_summary
from .fusion import DEFAULT_THRESHOLD_BYTES
from .grad_sync import collective_names
from .kfac_state import check_kfac_state, load_kfac_state, memory_usage, save_kfac_state
from .kfac_step import KFACStep, StepHyper
from .layers import FACTOR_KINDS, FactorKey, KFACLayer, LayerFilter, preconditioned_layers
from .methods import get_method
from .nonfinite import NonFiniteError, NonFiniteFactorError, SkipStep
from .perfmodels import PerfModel, load_perf_model
from .schedules import Scheduled, StepSchedule
from .sgd import momentum_sgd_update
from .timeline import Timeline
from .work_plan import LayerShape, WorkPlan

__all__ = ["NonFiniteError", "NonFiniteFactorError", "SPDKFACOptimizer"]


class SPDKFACOptimizer(torch.optim.Optimizer):
    """Distributed K-FAC with pipelined factor communication and load-balanced inversion.

    Replace ``torch.optim.SGD(model.parameters(), lr=..., momentum=...)`` by
    ``SPDKFACOptimizer(model, lr=..., momentum=...)``; the optimizer averages
    gradients across workers itself (do not also use Horovod's
    DistributedOptimizer or DDP). The loss must be a mean over the local batch.
    N workers produce the parameters one worker would with the global batch.

    Args:
        model: every ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` (any groups
            and padding mode) and dense ``nn.Embedding`` with a trainable
            weight is preconditioned (:mod:`spdkfac.layer_types`); every other
            parameter gets the plain momentum-SGD update
            (:meth:`kfac_summary` lists which, and why).
        lr, momentum, weight_decay: as ``torch.optim.SGD`` (read from
            ``param_groups`` each step, so LR schedulers work).
        damping: Tikhonov damping γ: ``(F + γI)^-1`` (``'eigen'``: added to
            the eigenvalues of ``A ⊗ G`` when preconditioning).
        factor_decay: running-average weight of the old factor.
        kl_clip: KL-clip bound on the preconditioned update (None disables).
        factor_update_freq, inv_update_freq: update factors (inverses) at the
            steps where ``steps % freq == 0`` (and at the first);
            ``inv_update_freq`` a multiple of ``factor_update_freq``.
            These four may each be a callable ``f(step) -> value``
            (:mod:`spdkfac.schedules`); the values in force are
            ``param_groups[0]['damping']`` / ``['kl_clip']`` and the
            attributes ``factor_update_freq`` / ``inv_update_freq``.
        backend: ``'auto'``, ``'horovod'``, ``'torch'``, ``'single'`` or a
            :class:`~spdkfac.comm.CommBackend`.
        perf_model: a fitted performance-model file or :class:`~spdkfac.perfmodels.PerfModel`
            (None: an uncalibrated default, with a warning).
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 loop; the loss
            scale is removed from the G factors and the gradients are averaged
            at the end of ``backward()``, before the scaler reads them; a step
            the scaler skips is discarded by the next :meth:`zero_grad`.
        fusion, pipelining, placement, compute_method, eigen_refresh, eigen_full_every, ekfac_decay,
        distribute_preconditioning, overlap_preconditioning,
        fusion_threshold_bytes, profile_steps, replan_interval, timeline, precondition, accumulation_steps,
        skip_nonfinite, skip_layers: how the step is computed: :class:`~spdkfac.config.KFACConfig`.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        damping: Scheduled[float] = 0.003,
        factor_decay: float = 0.95,
        kl_clip: Scheduled[float | None] = 0.001,
        factor_update_freq: Scheduled[int] = 1,
        inv_update_freq: Scheduled[int] = 1,
        backend: str | CommBackend = "auto",
        fusion: FusionPolicy = "optimal",
        pipelining: bool = True,
        placement: Placement = "lbp",
        compute_method: ComputeMethod = "inverse",
        eigen_refresh: EigenRefresh = "exact",
        eigen_full_every: int = 10,
        ekfac_decay: float = 0.95,
        distribute_preconditioning: bool = False,
        overlap_preconditioning: bool = True,
        perf_model: str | PerfModel | None = None,
        fusion_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        profile_steps: int = 3,
        replan_interval: int | None = None,
        timeline: bool = False,
        precondition: bool = True,
        grad_scaler: Any | None = None,
        accumulation_steps: int = 1,
        skip_nonfinite: int = 0,
        skip_layers: Sequence[LayerFilter] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        hyper = check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay, factor_decay=factor_decay)  # plain floats
        scheduled = dict(damping=damping, kl_clip=kl_clip, factor_update_freq=factor_update_freq, inv_update_freq=inv_update_freq)
        self.schedule = StepSchedule(scheduled, SCHEDULE_CHECKS)
        initial = self.schedule.resolve(0, scheduled)  # validates numbers, and callables' values at the first step
        self.config = KFACConfig.from_options(locals())  # the options named like its fields
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "unscale_")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        super().__init__(params, {**hyper, "damping": initial["damping"], "kl_clip": initial["kl_clip"]})
        self.model, self.grad_scaler, self.steps = model, grad_scaler, 0
        self.factor_update_freq: int = initial["factor_update_freq"]  # in force (see _step_kind)
        self.inv_update_freq: int = initial["inv_update_freq"]
        self.compute_method, self.precondition = compute_method, precondition
        self.method = get_method(compute_method, self.config)  # chosen once: the decomposition, payload, state and costs
        self.layers: list[KFACLayer] = preconditioned_layers(model, self.method, self.config.skip_layers) if precondition else []
        self.backend = get_backend(backend)
        self.perf_model = load_perf_model(perf_model).for_world_size(self.backend.size)  # as the simulator plans
        shapes = [LayerShape.of(la) for la in self.layers]
        self.work_plan = WorkPlan.make(shapes, self.backend.size, self.perf_model, placement, self.method, distribute_preconditioning)
        self.timeline: Timeline | None = Timeline() if timeline else None
        self.param_names = collective_names(model, self.param_groups)
        self.kfac_step = KFACStep(
            self.config,
            self.layers,
            self.backend,
            self.perf_model,
            self.work_plan,
            self.param_groups,
            self.param_names,
            grad_scaler,
            self._collecting,
            self._loss_scale,
        )
        self._begin_iteration()

    # ------------------------------------------------------------------ per step
    def _begin_iteration(self, abandon: bool = False) -> None:
        """Forget the finished (skipped, abandoned) step's state in every part."""
        record = self.timeline.begin(self.steps) if self.timeline is not None else None
        self._record = record
        self._kind: tuple[bool, bool] | None = None  # (updates factors, updates inverses), fixed when first needed
        self._scale: float | None = None
        self.kfac_step.begin(record, abandon)

    def _step_kind(self) -> tuple[bool, bool]:
        """(updates factors, updates inverses): fixed with the step's hyperparameters when the step first needs them
        (its first forward pass, or ``step()``), so a change between steps holds for the whole next step."""
        if self._kind is None:
            freqs = self.schedule.fix_step(self.steps, self.param_groups, (self.factor_update_freq, self.inv_update_freq))
            self.factor_update_freq, self.inv_update_freq = freqs
            first = any(not layer.decomposed for layer in self.layers)
            self._kind = (
                self.precondition and (first or self.steps % freqs[0] == 0),
                self.precondition and (first or self.steps % freqs[1] == 0),
            )
        return self._kind

    def _collecting(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self._step_kind()[0]

    def _loss_scale(self) -> float:
        """The GradScaler's scale in this backward pass (1 without one); read once per step."""
        if self._scale is None:
            self._scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        return self._scale

    # ----------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Precondition the gradients and take one momentum-SGD step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.kfac_step.grads.check_accumulated("step()")
        try:
            factor_step, inverse_step = self._step_kind()
            hyper = StepHyper.from_group(self.param_groups[0])
            self.kfac_step.run(factor_step, inverse_step, hyper, self.steps)
            momentum_sgd_update(self.param_groups, self.state)
            self.steps += 1
            self.kfac_step.nonfinite.good_step()
            if self.timeline is not None and self._record is not None:
                self.timeline.end()
        except SkipStep:  # every worker skips this step (the values checked are identical everywhere)
            self._begin_iteration()
            return loss
        except BaseException:
            # The first error is the one to see (after a peer died, the engine's): drop this iteration's
            # state without the checks that would raise again over collectives that can never complete.
            self._begin_iteration(abandon=True)
            raise
        self._begin_iteration()
        return loss

    # ------------------------------------------------------------ between steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; after a skipped ``step()`` also discard that step's factors (waited for first).

        Raises RuntimeError while gradient all-reduces are pending (no ``step()`` / :meth:`synchronize` yet).
        """
        if self.kfac_step.grads.pending and not self.kfac_step.grads.synchronized:
            raise RuntimeError("zero_grad() called while gradient all-reduces are pending; call step() (or synchronize()) first")
        if self.kfac_step.backward_seen:  # that backward's step() was skipped
            self.kfac_step.controller.discard()
            self._begin_iteration()
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait until every gradient holds its average (call before reading them, e.g. to clip; ``step()`` does it)."""
        self.kfac_step.grads.synchronize()

    def finite_everywhere(self, value: torch.Tensor) -> bool:
        """True when ``value`` (e.g. the loss) is finite on every worker: one tiny all-reduce.

        The way to skip a bad batch after the forward pass (every worker must
        decide alike): when False, this step's factors are dropped on every
        worker (their all-reduces waited for), and mid-accumulation the whole
        step, as ``zero_grad()`` would.
        """
        accumulated = self.kfac_step.backward_seen  # earlier micro-batches' gradients are only local
        finite = self.kfac_step.finite_everywhere(value, self.backend)
        if not finite:
            self._begin_iteration()
            if accumulated:
                super().zero_grad(set_to_none=True)
        return finite

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state plus K-FAC state (step counter, factors, decompositions, update frequencies).

        Callable schedules are not saved: pass the same ones to the optimizer
        that loads this. Save between steps (not mid-accumulation).
        """
        sd = super().state_dict()
        sd["kfac"] = save_kfac_state(
            self.layers, self.steps, (self.factor_update_freq, self.inv_update_freq), self.method, self.config.as_dict()
        )
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` for the same model and compute method."""
        kfac = check_kfac_state(state_dict, self.layers, self.method)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "kfac"})
        load_kfac_state(kfac, self.layers)
        self.steps = int(kfac["steps"])
        if "update_freqs" in kfac:  # (absent from checkpoints made before schedules existed)
            self.factor_update_freq, self.inv_update_freq = (int(f) for f in kfac["update_freqs"])
        self._begin_iteration()

    # ------------------------------------------------------------ reporting
    def memory_usage(self) -> dict[str, int]:
        """Bytes held by factors (packed running averages) and inverses (or eigendecompositions), per kind."""
        return memory_usage(self.layers, self.method)

    def kfac_summary(self) -> str:
        """Which modules K-FAC preconditions (by type, with how many parameters), which get plain SGD and why."""
        return kfac_summary(self.model, self.layers, self.config.skip_layers, self.precondition)

    def fusion_plan(self) -> dict[str, list[list[FactorKey]] | None]:
        """Current fusion groups per pass (None while profiling, or for ``'layerwise'``)."""
        return {kind: self.kfac_step.controller.plan(kind) for kind in FACTOR_KINDS}

    def remove_hooks(self) -> None:
        """Detach every hook from the model (the optimizer is unusable afterwards)."""
        self.kfac_step.remove_hooks()

    def __repr__(self) -> str:
        g = self.param_groups[0]
        hyper = ", ".join(f"{k}={g[k]}" for k in ("lr", "momentum", "weight_decay", "damping", "factor_decay", "kl_clip"))
        options = ", ".join(f"{k}={v!r}" for k, v in self.config.as_dict().items())
        return (
            f"SPDKFACOptimizer(layers={len(self.layers)}, {hyper}, factor_update_freq={self.factor_update_freq}, "
            f"inv_update_freq={self.inv_update_freq}, backend={self.backend.name}(rank {self.backend.rank}/"
            f"{self.backend.size}), {options}, perf_model={self.perf_model.source!r})"
        )
