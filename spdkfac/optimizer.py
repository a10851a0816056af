"""SPDKFACOptimizer: distributed K-FAC as a drop-in replacement for ``torch.optim.SGD``.

The optimizer is wiring: it validates the options (:class:`~spdkfac.config.KFACConfig`),
builds the parts (factor hooks, gradient averaging, fusion controller and profiler,
work plan, decomposition stage, preconditioner), fixes each step's hyperparameters
and leaves the order of the K-FAC work to :class:`~spdkfac.step.kfac_step.KFACStep`
(and ``damping='adaptive'``'s measured step to :class:`~spdkfac.step.adaptive_damping.DampingStep`);
then it takes the base optimizer's step (momentum SGD, AdamW or LAMB). See ``docs/design.md``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn

from .comm import CommBackend, get_backend
from .comm.device import local_rank_and_size
from .config import (
    SCHEDULE_CHECKS,
    BaseOptimizer,
    ComputeMethod,
    EigenOptions,
    EigenRefresh,
    EKFACOptions,
    EKFACUpdate,
    FusionPolicy,
    KFACConfig,
    NormLayers,
    Placement,
    UpdateFusion,
    check_hyperparameters,
)
from .kfac.layers import (
    FACTOR_KINDS,
    FactorKey,
    KFACLayer,
    LayerFilter,
    kfac_layers,
    link_tied_pairs,
    preconditioned_layers,
    used_outside_forward,
)
from .kfac.methods import get_method
from .kfac.sharded_grads import assign_weight_slots
from .kfac.state import (
    check_kfac_state,
    is_base_state,
    keep_held_decompositions,
    load_kfac_state,
    memory_usage,
    save_kfac_state,
    saved_uses,
)
from .kfac.summary import kfac_summary
from .perfmodels import PerfModel, load_perf_model
from .perfmodels.models import UNCALIBRATED_WARNING
from .plan.factor_fusion import DEFAULT_THRESHOLD_BYTES
from .plan.grad_worker_choice import GradWorkerProblem, grad_worker_record, rechosen_note
from .plan.grad_workers import GradWorkerFraction
from .plan.memory_check import memory_warnings
from .plan.work_plan import LayerShape, WorkPlan
from .schedules import LAYER_WIDE_OPTIONS, Scheduled, StepSchedule
from .step.adaptive_damping import AdaptiveDamping, DampingStep, damping_rule
from .step.checkpoint_gather import gather_decompositions, gather_method_states
from .step.data_parallel import ModelWrapping, refuse_wrapped_optimizer
from .step.factor_hooks import warn_if_float16_autocast
from .step.grad_sync import collective_names
from .step.kfac_step import KFACStep, StepHyper
from .step.module_hooks import HookHandle, claim, register
from .step.nonfinite import NonFiniteError, NonFiniteFactorError, SkipStep
from .step.thread_count import agree_on_thread_count
from .step.timeline import Timeline
from .update.added_groups import average_gradients_now, check_outside_model, not_in_model
from .update.base_update import apply_base_update, base_defaults, zero_base_state
from .update.forward_renorm import refuse_forward_renorm
from .update.replaced import ParameterSlots, check_materialised
from .update.unfrozen import outside_groups, regroup
from .update.update_fusion import NO_KL_CLIP, BackwardFusion, ForwardFusion, check_update_fusion
from .update.weight_decay import split_decayed

__all__ = ["NonFiniteError", "NonFiniteFactorError", "SPDKFACOptimizer"]


def _callers_level() -> int:
    """``stacklevel`` for a warning from the function calling this: the first frame outside spdkfac and torch (the
    script's ``step()`` call, however many wrappers torch puts around it)."""
    roots = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
    frame: Any = sys._getframe(1)  # the warning's caller: level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


def _parameters_hint(given: Any) -> str:
    """What to say when ``model.parameters()`` (a ``torch.optim`` habit) was given instead of the model."""
    if isinstance(given, (list, tuple)) or hasattr(given, "__next__"):
        return (
            ": pass the model itself, not model.parameters(): K-FAC hooks the model's layers to see their inputs "
            "and output gradients (parameter groups without weight decay: the no_weight_decay= option)"
        )
    return ""


class SPDKFACOptimizer(torch.optim.Optimizer):
    """Distributed K-FAC with pipelined factor communication and load-balanced inversion.

    Replace ``torch.optim.SGD(model.parameters(), lr=..., momentum=...)`` by
    ``SPDKFACOptimizer(model, lr=..., momentum=...)``; the optimizer averages
    gradients across workers itself (do not wrap it in Horovod's
    DistributedOptimizer). A ``DistributedDataParallel`` model may be passed
    as it is: DDP then averages the gradients and the optimizer preconditions
    the bare module (:mod:`spdkfac.step.data_parallel`). The loss must be a
    mean over the local batch. N workers produce the parameters one worker
    would with the global batch.

    Args:
        model: the model, or its ``DistributedDataParallel`` wrapper (other
            data-parallel wrappers are refused); every ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` (any groups
            and padding mode), ``nn.Conv3d``, ``nn.ConvTranspose1d/2d/3d`` and dense ``nn.Embedding`` with a trainable
            weight is preconditioned (:mod:`spdkfac.kfac.layer_types`); every other
            parameter gets the plain base update
            (:meth:`kfac_summary` lists which, and why).
        lr, momentum, weight_decay: as ``torch.optim.SGD`` (read from
            ``param_groups`` each step, so LR schedulers work); ``momentum``
            (default 0.9) only with ``base='sgd'``.
        base: the update applied after preconditioning, to the preconditioned
            gradients and every other parameter's averaged gradient:
            ``'sgd'`` (momentum SGD, ``torch.optim.SGD``'s rule; weight decay
            coupled: ``wd * param`` added to the preconditioned gradient),
            ``'adamw'`` (``torch.optim.AdamW``'s rule; decoupled decay
            ``-lr * wd * param``) or ``'lamb'`` (LAMB: Adam's ratio plus
            ``wd * param``, scaled per tensor by the trust ratio
            ``‖param‖/‖ratio‖``), :mod:`spdkfac.update.base_update`. The KL clip
            always scales the preconditioned gradients before the base
            update, by ``min(1, sqrt(kl_clip / (lr² |Σ v·grad|)))`` with the
            base's ``lr``; an adaptive base (AdamW, LAMB) then normalises the
            scaled gradient, so only the clip's changes from step to step
            reach its update (``kl_clip=None`` turns it off).
        betas, eps: Adam's moment decays and denominator term (``'adamw'``,
            ``'lamb'``; defaults (0.9, 0.999) and 1e-8, LAMB 1e-6).
        damping: Tikhonov damping γ: ``(F + γI)^-1`` (``'eigen'``: added to
            the eigenvalues of ``A ⊗ G`` when preconditioning); ``'adaptive'``
            or an :class:`~spdkfac.step.adaptive_damping.AdaptiveDamping`:
            adjusted by the Levenberg-Marquardt rule, which needs
            ``step(closure)`` with a loss-only closure (docs/damping.md).
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
            (None: an uncalibrated default, with a warning on several workers; one worker plans nothing with it).
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 loop; the loss
            scale is removed from the G factors and the gradients are averaged
            at the end of ``backward()``, before the scaler reads them; a step
            the scaler skips is discarded by the next :meth:`zero_grad`.
        fusion, pipelining, placement, compute_method, eigen_refresh, eigen_full_every, ekfac_decay, ekfac_update,
        distribute_preconditioning, grad_worker_fraction, memory_budget, overlap_preconditioning,
        fusion_threshold_bytes, profile_steps, replan_interval, timeline, precondition, accumulation_steps,
        skip_nonfinite, skip_layers: how the step is computed: :class:`~spdkfac.config.KFACConfig`.
            The enumerated ones take their strings or enum members (``Placement.LBP``).
        eigen, ekfac: the per-method options grouped, ``EigenOptions(refresh,
            full_every)`` and ``EKFACOptions(decay, update)``, in place of
            their flat keywords (:meth:`~spdkfac.config.KFACConfig.from_options`).
        update_fusion: ``'none'``, ``'forward'`` or ``'backward'``: where the
            parameter update runs (:mod:`spdkfac.update.update_fusion`; same results).
        norm_layers: ``'plain'`` (the default: normalisation layers get the
            base update unpreconditioned) or ``'kfac'``: the affine
            parameters of BatchNorm, LayerNorm, GroupNorm and RMSNorm preconditioned
            by their per-channel 2x2 scale-and-shift Fisher blocks
            (:mod:`spdkfac.kfac.layer_types.norm`, docs/norm-layers.md).
        no_weight_decay: parameters the base update does not decay:
            parameter-name patterns (``'*.bias'``) or ``'kind:bias'``,
            ``'kind:norm'``, ``'kind:vector'`` (fewer than two dimensions);
            they form a second parameter group with ``weight_decay=0``
            (:mod:`spdkfac.update.weight_decay`, docs/base-optimizers.md).
        max_factor_dim: a dense factor wider than this is kept as its
            diagonal (None, the default: none is): a language model's output
            layer (``G`` as wide as the vocabulary), wide MLPs (docs/layers.md).
    """

    #: Whether a GradScaler skipped the step of the backward passes before (KFACPreconditioner attached to an
    #: optimizer, whose step() the scaler then never calls); None: no such check.
    _scaler_skipped: Callable[[], bool] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        refuse_wrapped_optimizer(cls)  # hvd.DistributedOptimizer makes a subclass of the optimizer's class
        super().__init_subclass__(**kwargs)

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float | None = None,
        weight_decay: float = 0.0,
        damping: Scheduled[float] | str | AdaptiveDamping = 0.003,
        factor_decay: float = 0.95,
        kl_clip: Scheduled[float | None] = 0.001,
        factor_update_freq: Scheduled[int] = 1,
        inv_update_freq: Scheduled[int] = 1,
        backend: str | CommBackend = "auto",
        fusion: FusionPolicy | str = FusionPolicy.OPTIMAL,
        pipelining: bool = True,
        placement: Placement | str = Placement.LBP,
        compute_method: ComputeMethod | str = ComputeMethod.INVERSE,
        eigen_refresh: EigenRefresh | str = EigenRefresh.EXACT,
        eigen_full_every: int = 10,
        ekfac_decay: float = 0.95,
        ekfac_update: EKFACUpdate | str = EKFACUpdate.NATURAL,
        distribute_preconditioning: bool = False,
        grad_worker_fraction: GradWorkerFraction | None = None,
        memory_budget: int | None = None,
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
        update_fusion: UpdateFusion | str = UpdateFusion.NONE,
        base: BaseOptimizer | str = BaseOptimizer.SGD,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        norm_layers: NormLayers | str = NormLayers.PLAIN,
        no_weight_decay: Sequence[str] | str = (),
        max_factor_dim: int | None = None,
        eigen: EigenOptions | None = None,
        ekfac: EKFACOptions | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}{_parameters_hint(model)}")
        wrapping = ModelWrapping(model)  # a DDP model: its bare module is preconditioned, DDP averages the gradients
        model = wrapping.module
        #: The Levenberg-Marquardt damping rule (``damping='adaptive'``), or None; the damping in force is the group's.
        self.adaptive_damping = damping_rule(damping, update_fusion, grad_scaler)
        if self.adaptive_damping is not None:
            damping = self.adaptive_damping.initial
        base_options = base_defaults(base, momentum, betas, eps)  # momentum, or betas and eps
        momentum_now = base_options.get("momentum", 0.0)
        hyper = check_hyperparameters(lr=lr, momentum=momentum_now, weight_decay=weight_decay, factor_decay=factor_decay)  # plain floats
        if base != BaseOptimizer.SGD:
            del hyper["momentum"]
        scheduled = dict(damping=damping, kl_clip=kl_clip, factor_update_freq=factor_update_freq, inv_update_freq=inv_update_freq)
        self.schedule = StepSchedule(scheduled, SCHEDULE_CHECKS)
        initial = self.schedule.resolve(0, scheduled)  # validates numbers, and callables' values at the first step
        self.config = KFACConfig.from_options(locals())  # the options named like its fields
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "unscale_")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        check_update_fusion(
            self.config.update_fusion, self.config.base, precondition, initial["kl_clip"], grad_scaler, self.config.splits_preconditioning
        )
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("model has no trainable parameters")
        decayed, undecayed = split_decayed(model, self.config.no_weight_decay)
        # (param_groups[0] holds the hyperparameters every step reads; the excluded parameters differ only in their decay)
        groups = [{"params": decayed}] + ([{"params": undecayed, "weight_decay": 0.0}] if undecayed else [])
        super().__init__(
            groups, {**base_options, **hyper, "damping": initial["damping"], "kl_clip": initial["kl_clip"]}
        )  # checked floats win
        self.model, self.grad_scaler, self.steps = model, grad_scaler, 0
        self.schedule.hold_layer_wide(self.param_groups)  # (a group written by itself from here on is refused)
        self.factor_update_freq: int = initial["factor_update_freq"]  # in force (see _step_kind)
        self.inv_update_freq: int = initial["inv_update_freq"]
        self.compute_method, self.precondition = self.config.compute_method, precondition
        self.method = get_method(self.config.compute_method, self.config)  # chosen once: the decomposition, payload, state and costs
        check_materialised(model)
        self.layers: list[KFACLayer] = (
            preconditioned_layers(
                model, self.method, self.config.skip_layers, self.config.norm_layers is NormLayers.KFAC, self.config.max_factor_dim
            )
            if precondition
            else []
        )
        if wrapping.sharded_over is not None:  # FSDP2 swaps each weight for its whole copy in its passes
            assign_weight_slots(self.layers, model)
        #: Parameters whose preconditioned gradient is the step's direction (EKFAC's Adam update): the base steps along it.
        self._direct = frozenset(p for layer in self.layers for p in layer.params()) if self.method.gives_direction else frozenset()
        self.backend = get_backend(backend)
        wrapping.check_scaler(grad_scaler, self.backend.size)
        self._damping_step = (
            DampingStep(self.adaptive_damping, model, self.layers, self.backend) if self.adaptive_damping is not None else None
        )
        self.wrapping = wrapping
        self._measured_perf_model = load_perf_model(perf_model, warn=False)  # scaled to the run's worker count by _plan_for_workers
        self._uncalibrated = perf_model is None  # (said when first planned for several workers: one plans nothing with it)
        self.timeline: Timeline | None = Timeline() if timeline else None
        self.param_names = collective_names(model, self.param_groups)
        self._slots = ParameterSlots(model)  # (each step checks that the model's parameters are still these)
        self._forward_fusion: ForwardFusion | None = None
        self._backward_fusion: BackwardFusion | None = None
        self._plan_for_workers()
        wrapping.attach(self._adopt_ddp, self._adopt_sharding)
        self._begin_iteration()
        self._own_groups = len(self.param_groups)
        self._unfreeze_hook: HookHandle | None = None
        self._watch_frozen()
        self._taken_over = False
        #: Where the layers' learning rates for the KL clip are read (None: these groups; a preconditioner attached
        #: to your optimizer: its groups).
        self._lr_groups: Callable[[], list[dict[str, Any]]] | None = None
        #: A K-FAC state given by load_kfac_state_dict(), for the next load_state_dict() without one.
        self._pending_kfac: dict[str, Any] | None = None
        #: A load_state_dict() without the K-FAC state and none pending: loaded once load_kfac_state_dict() gives it.
        self._awaiting_kfac: dict[str, Any] | None = None
        self._gathered: dict[str, dict[str, Any]] | None = None  # consolidate_state_dict's, until the next step
        self._partial_noted = False  # whether a state_dict() without every worker's decompositions was warned about
        #: The parameters of added groups that are not the model's (a loss's weights): averaged at step() under DDP.
        self._beside_model: list[torch.Tensor] = []
        #: Embeddings not yet checked for a use outside their forward (at the first factor step).
        self._diagonal_unchecked = [layer for layer in self._preconditioning_layers if layer.shape("A").diagonal]
        for previous in claim(self, wrapping.module.modules()):  # last: a refused construction leaves the old one working
            previous._hand_over()

    def _plan_for_workers(self) -> None:
        """Plan and wire what depends on the number of workers: fusion, placement, gradient workers and the step's parts.

        Construction and :meth:`replan` run this one implementation, so a job
        re-planned at a new size plans as a job started at that size.
        """
        workers = self.backend.size
        self.wrapping.check(workers, self.config.update_fusion)
        self._threads_agreed = False  # (at the next step: construction is collective-free, the simulator plans with it)
        refuse_forward_renorm(self.model, workers)
        if self.wrapping.leaves_parameters_unused:  # a layer may run on some workers only: DDP's buckets and the
            self.backend.apart_from_default_group()  # factors, held back there, must not pair with each other
        if self._uncalibrated and workers > 1:
            self._uncalibrated = False
            warnings.warn(UNCALIBRATED_WARNING, stacklevel=_callers_level())
        self.perf_model = self._measured_perf_model.for_world_size(workers)  # as the simulator plans
        shapes = [LayerShape.of(la) for la in self._preconditioning_layers]
        grad_workers, self.grad_worker_choice = GradWorkerProblem(
            shapes,
            workers,
            self.perf_model,
            self.config.placement,
            self.method,
            self.backend.native_subgroups,
            self.layers[0].factor_dtype.itemsize if self.layers else 4,  # (a bfloat16 model's factors are float32)
            self.inv_update_freq,
            self.config.overlap_preconditioning,
        ).resolve(self.config.grad_worker_fraction, self.config.distribute_preconditioning, self.config.memory_budget)
        self.work_plan: WorkPlan = (
            self.grad_worker_choice.plan
            if self.grad_worker_choice is not None
            else WorkPlan.make(
                shapes, workers, self.perf_model, self.config.placement, self.method,
                grad_workers=grad_workers, native_subgroups=self.backend.native_subgroups, inv_update_freq=self.inv_update_freq,
            )
        )  # fmt: skip
        if self.grad_worker_choice is not None and self.backend.rank == 0:
            print(f"spdkfac: grad_worker_fraction='auto' chose {self.grad_worker_choice.describe()}", flush=True)
        placed = {layer.name: (layer.helper.weight.device, layer.factor_dtype.itemsize) for layer in self.layers}
        try:
            local = local_rank_and_size()  # the processes of a node share its host memory
        except ValueError:  # launcher variables that disagree: not this check's to refuse
            local = None
        for text in memory_warnings(self.work_plan, self.method, self.backend.rank, placed, 1 if local is None else local[1]):
            warnings.warn(text, stacklevel=_callers_level())
        update_fusion = self.config.update_fusion
        self.kfac_step = KFACStep(
            self.config,
            self.layers,
            self.backend,
            self.perf_model,
            self.work_plan,
            self.param_groups,
            self.param_names,
            self.grad_scaler,
            self._collecting,
            self._loss_scale,
            self._final_grad if update_fusion is UpdateFusion.BACKWARD else None,
            self.wrapping,
            lambda: self._step_kind()[0],
        )
        self.kfac_step.factors.unstepped = self._drop_unstepped
        self.kfac_step.factors.input_gradient_passes = self._drop_input_gradient_passes
        self.kfac_step.factors.refused = self._drop_batch
        self.kfac_step.grads.on_cleared = self._drop_cleared
        if self.grad_scaler is None:
            self.kfac_step.factors.first_input = warn_if_float16_autocast
        self._forward_fusion = ForwardFusion(self.model, self.param_groups, self.state) if update_fusion is UpdateFusion.FORWARD else None
        self._backward_fusion = (
            BackwardFusion(
                self.param_groups,
                self.state,
                self.layers,
                self.kfac_step.grads,
                self.param_names,
                self._fusable_step,
                lambda layer: self.kfac_step.begin_fused_layer(layer, self._step_kind()[0]),
            )
            if update_fusion is UpdateFusion.BACKWARD
            else None
        )

    def _adopt_ddp(self) -> None:
        """A DDP wrapped around the model after construction (accelerate's ``prepare()``, Hugging Face's ``Trainer``)
        was found at the first forward pass it ran: re-plan as if the optimizer had been given it, so that DDP
        averages the gradients and the optimizer starts no all-reduce of its own (ValueError where DDP's process
        group is not the backend's, or under ``update_fusion='backward'``)."""
        self.wrapping.check(self.backend.size, self.config.update_fusion)  # (before anything is unhooked)
        self._wire_anew()

    def _adopt_sharding(self) -> None:
        """The model was sharded by ``fully_shard()`` after construction (accelerate's ``prepare()`` with its FSDP2
        plugin, which also swaps the parameter groups' parameters for their shards), found at its first forward
        pass: take it in as construction on the sharded model would, so that FSDP averages the gradients and the
        layers read theirs whole. Before the first step only (nothing is held yet for the replaced parameters);
        the groups keep their hyperparameters. RuntimeError after a step; ValueError as construction refuses."""
        if self.steps > 0 or self.state:
            raise RuntimeError(
                f"the model was sharded by fully_shard() after this optimizer took or loaded {self.steps} step(s): its "
                "state belongs to the parameters FSDP replaced. Build the optimizer on the sharded model (after "
                "fully_shard(), or after accelerator.prepare(model)) and load the checkpoint into it, or shard "
                "before the first step"
            )
        self.wrapping.check(self.backend.size, self.config.update_fusion)
        self.wrapping.check_scaler(self.grad_scaler, self.backend.size)
        current = dict(self.model.named_parameters())
        named = {id(p): name for p, name in self.param_names.items()} | {id(p): name for name, p in current.items()}
        for group in self.param_groups[self._own_groups :]:  # added groups: the model's parameters by name
            group["params"] = [current[named[id(p)]] if named.get(id(p)) in current else p for p in group["params"]]
        self._take_model_anew(keep_layers=False)
        self._diagonal_unchecked = [layer for layer in self._preconditioning_layers if layer.shape("A").diagonal]

    def _unhook_step(self) -> None:
        """Detach the step's hooks and forward fusion's (its held updates applied first), to wire them anew."""
        self.kfac_step.remove_hooks()
        if self._forward_fusion is not None:
            self._forward_fusion.remove_hooks()

    def _wire_anew(self) -> None:
        """Plan and hook the step anew for the workers and the wrapping as they are now (:meth:`_plan_for_workers`)."""
        self._unhook_step()
        self._plan_for_workers()
        self._begin_iteration()

    def replan(self) -> None:
        """Plan fusion, placement and gradient workers anew for the engine's current size and rank.

        For Horovod's elastic mode, whose ``hvd.elastic.run`` re-initialises
        Horovod at another size in the same process
        (:class:`spdkfac.train.elastic.ElasticState` calls this after every
        reset): the plan is the one a job started at that size makes, and the
        ``'optimal'`` fusion plan is profiled again. The step in progress, if
        any, is dropped (its collectives are not waited for: after a lost
        worker they never complete); the factors, decompositions, base state
        and step counter are kept. Then load the committed ``state_dict()``
        (with ``grad_worker_fraction`` < 1 this also recomputes the
        decompositions this worker now holds). A ``DistributedDataParallel``
        model is refused: its process group cannot change size in place.
        """
        if self.wrapping.averages_gradients:
            raise ValueError(
                "replan() re-plans for Horovod's elastic mode; a DistributedDataParallel (or fully_shard) model's process "
                "group cannot change size in place: restart the job under torchrun (spdkfac.train --resume auto) instead"
            )
        self._begin_iteration(abandon=True)  # under backward fusion: rolls back what an unfinished step wrote
        self._gathered = None  # (gathered for the old plan's ranks)
        self._wire_anew()

    # ------------------------------------------------------------- added groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim``'s, between steps. Parameters outside the model (a loss's own weights, a learned
        temperature) get the base update with the group's hyperparameters, and their gradients are averaged over
        the workers as the model's are (under DDP, which averages its module's only, at ``step()``); the model's frozen
        parameters join when unfrozen, their layers preconditioned (:meth:`_take_unfrozen`). ValueError for
        parameters outside the model that update fusion would not update, or for a group's own damping, kl_clip or
        factor_decay (one value for every layer); RuntimeError in the middle of a step."""
        if "kfac_step" not in self.__dict__:  # (torch.optim's construction adds the first groups)
            super().add_param_group(param_group)
            return
        if self._kind is not None or self.kfac_step.backward_seen:
            raise RuntimeError(
                "add_param_group() in the middle of a step (after its first forward pass): add the group between "
                "step() and the next forward pass"
            )
        first = self.param_groups[0]
        for name in LAYER_WIDE_OPTIONS:
            if name in param_group and param_group[name] != first[name]:
                raise ValueError(
                    f"add_param_group() with {name}={param_group[name]!r}, and param_groups[0]'s is {first[name]!r}: "
                    f"K-FAC's {name} is one value for every layer; leave it out of the group"
                )
        super().add_param_group(param_group)
        self.param_groups[-1].update({name: first[name] for name in LAYER_WIDE_OPTIONS})  # (not the defaults: in force now)
        beside = not_in_model(self.model, self.param_groups)
        try:
            check_outside_model(beside, self.config.update_fusion)
        except ValueError:
            self.param_groups.pop()  # (refused: the optimizer goes on as before the call)
            raise
        self._beside_model = beside
        if all(p in self.param_names for p in self.param_groups[-1]["params"]):
            return  # (only the model's parameters: those unfrozen are taken in at the next forward pass)
        previous = self.kfac_step
        self._unhook_step()
        self._replan_keeping_state(previous)

    # ------------------------------------------------------- unfrozen parameters
    def _watch_frozen(self) -> None:
        """Watch the model's parameters outside the groups (frozen so far) from a forward pre-hook on the model:
        the first forward pass after one is unfrozen takes it in (:meth:`_take_unfrozen`)."""
        self._outside = outside_groups(self.model, self.param_groups)
        if self._outside and self._unfreeze_hook is None:
            self._unfreeze_hook = register(self.model.register_forward_pre_hook, self._before_forward)

    def _before_forward(self, module: nn.Module, inputs: Any) -> None:
        if not torch.compiler.is_compiling():  # (a compiled model: zero_grad() takes them in, step() refuses them)
            self._take_unfrozen(strict=True)

    def _take_unfrozen(self, strict: bool) -> None:
        """Take in the parameters frozen so far that are trainable now, as construction would on the model now.

        The parameter groups hold them in the model's order, their layers
        become K-FAC layers (factors from the identity, as any layer's, and
        decomposed at the next step), and the gradient all-reduces, the plan
        and the hooks are made anew; the factors, decompositions, base state,
        step counter and hyperparameters are kept (``state_dict()`` is then
        the one an optimizer built now would save). Between steps only:
        ``strict`` refuses a change in the middle of a step, else it waits.
        """
        if not any(p.requires_grad for p in self._outside):
            return
        outside = {id(p) for p in self._outside}
        unfrozen = [name for name, p in self.model.named_parameters() if p.requires_grad and id(p) in outside]
        if self.wrapping.ddp is not None:
            raise ValueError(
                f"parameters {unfrozen} were frozen when the model was wrapped in DistributedDataParallel and the optimizer "
                "built; DDP averages only the parameters trainable when it wraps the model: after unfreezing, wrap the "
                "bare model in DDP again and build the optimizer for it"
            )
        if self._kind is not None or self.kfac_step.backward_seen:
            if not strict:
                return
            raise RuntimeError(
                f"parameters {unfrozen} became trainable in the middle of a step (after its first forward pass): change "
                "requires_grad between step() and the next forward pass"
            )
        for p in self._outside:
            if p.requires_grad:
                p.grad = None  # (a gradient from before it was frozen: zero_grad() never reached it, torch.optim's would have)
        self._take_model_anew(keep_layers=True)

    def _take_model_anew(self, keep_layers: bool) -> None:
        """Groups, layers, names, plan and hooks made anew for the model as it is now, as construction would make
        them, keeping every state held across steps (``keep_layers``: a layer found again, with the same factor
        shapes, keeps its factors and decompositions; else every layer is new)."""
        previous = self.kfac_step
        self._unhook_step()
        regroup(self.model, self.param_groups, self._own_groups, self.config.no_weight_decay)
        if self.precondition:
            found = kfac_layers(
                self.model, self.method, self.config.skip_layers, self.config.norm_layers is NormLayers.KFAC, self.config.max_factor_dim
            )
            kept = {layer.name: layer for layer in self.layers} if keep_layers else {}
            # (a layer whose bias was unfrozen has a ones column more in A: its factors start anew, as a new layer's)
            self.layers = [kept[new.name] if new.name in kept and kept[new.name].shapes == new.shapes else new for new in found]
            link_tied_pairs(self.layers)
            if self.wrapping.sharded_over is not None:  # (as construction: FSDP2 swaps each weight in its passes)
                assign_weight_slots(self.layers, self.model)
        self._direct = frozenset(p for layer in self.layers for p in layer.params()) if self.method.gives_direction else frozenset()
        if self.adaptive_damping is not None:
            self._damping_step = DampingStep(self.adaptive_damping, self.model, self.layers, self.backend)
        self._replan_keeping_state(previous)
        self._outside = outside_groups(self.model, self.param_groups)

    def _replan_keeping_state(self, previous: KFACStep) -> None:
        """Name, plan and hook the step anew for the parameter groups as they are now (``previous``: the step this
        replaces, its hooks detached), keeping every state held across steps."""
        self.param_names = collective_names(self.model, self.param_groups)
        self._slots = ParameterSlots(self.model)
        self._plan_for_workers()
        self.kfac_step.carry_over(previous)
        if not all(self.work_plan.holds(rank, la.name) for rank in range(self.backend.size) for la in self._preconditioning_layers):
            for layer in self.layers:  # every worker decomposes every layer at the next step, alike (as after a load)
                for kind in FACTOR_KINDS:
                    layer.set_decomposition(kind, None)
        self._begin_iteration()

    # ------------------------------------------------------------------ per step
    def _drop_unstepped(self, exceeded: bool) -> bool:
        """A forward pass begins after backward passes whose ``step()`` is not coming: drop them, as :meth:`zero_grad`
        after a skipped step does, and return True; False (nothing dropped) for passes still to be stepped.

        Not coming: their gradients were cleared since (every one now None:
        ``model.zero_grad()``, the DCGAN example's ``netD.zero_grad()``, with
        a pass of the generator's step through the discriminator before it),
        or, past ``accumulation_steps`` (``exceeded``), an attached
        preconditioner's GradScaler skipped their step, or their gradients
        are all zero (zeroed in place). Past it on gradients not cleared, the
        passes are dropped provisionally: fast adversarial training (Wong et
        al.) clears the attack pass's gradients between the next forward pass
        and its backward, which then checks that they were (and refuses, as
        this forward pass once did, if not).
        """
        grads = self.kfac_step.grads  # (counts every parameter's gradients where its hooks run; else the G layers')
        factors = self.kfac_step.factors
        cleared = grads.cleared() if grads.backward_seen else factors.gradients_cleared()
        if cleared or (exceeded and self._scaler_skipped is not None and self._scaler_skipped()):
            self._drop_batch()
            return True
        if not exceeded:
            return False
        self._drop_batch()
        kept = factors.weights_with_gradients()  # (after the drop: its all-reduces wrote the averages, alike everywhere)
        if any(bool(w.grad.any()) for w in kept if w.grad is not None):  # (all zero: zero_grad(set_to_none=False))
            factors.must_be_cleared = kept
        return True

    def _drop_input_gradient_passes(self) -> bool:
        """A forward pass begins after forward passes whose backward computed only input gradients (an adversarial
        attack's FGSM or PGD steps): with no gradient in this step yet they gave it nothing, so their factors are
        dropped (True), their all-reduces completed first as :meth:`finite_everywhere` does."""
        if self.kfac_step.backward_seen:
            return False
        self.kfac_step.controller.discard()
        self._begin_iteration()
        return True

    def _drop_cleared(self) -> bool:
        """A backward pass begins on gradients cleared since this step's earlier passes: drop those (True), on a step
        without factors. On a factor step the forward pass already did (:meth:`_drop_unstepped`), or its factors
        are this pass's too and dropping them would lose those: the passes are left to the refusal (False)."""
        if self.kfac_step.factors.took_a:
            return False
        self._drop_batch()
        return True

    def _drop_batch(self) -> None:
        """Forget this step's backward passes: their all-reduces completed first (issued alike on every worker)."""
        grads = self.kfac_step.grads
        if grads.pending and not grads.synchronized:
            grads.synchronize(dropping=True)
        if self.kfac_step.backward_seen:
            self.kfac_step.controller.discard()
        self._begin_iteration()

    def _begin_iteration(self, abandon: bool = False) -> None:
        """Forget the finished (skipped, abandoned) step's state in every part."""
        record = self.timeline.begin(self.steps) if self.timeline is not None else None
        self._record = record
        self._kind: tuple[bool, bool] | None = None  # (updates factors, updates inverses), fixed when first needed
        self._scale: float | None = None
        self.kfac_step.begin(record, abandon)
        if self._backward_fusion is not None:
            self._backward_fusion.begin()  # rolls back what an unfinished step wrote in backward

    def _layer_lrs(self) -> dict[str, float] | None:
        """Each K-FAC layer's learning rate (its weight's group's; a preconditioner's, its optimizer's groups) where
        some differ from ``param_groups[0]``'s: the KL clip weighs each layer's update by its own rate."""
        first = float(self.param_groups[0]["lr"])
        groups = self.param_groups if self._lr_groups is None else self._lr_groups()
        if all(float(group["lr"]) == first for group in groups):
            return None  # (the usual case, one rate: no per-parameter map built on every step)
        rate = {id(p): float(group["lr"]) for group in groups for p in group["params"]}
        lrs = {layer.name: rate.get(id(layer.params()[0]), first) for layer in self.layers}
        return lrs if any(r != first for r in lrs.values()) else None

    def _step_kind(self) -> tuple[bool, bool]:
        """(updates factors, updates inverses): fixed with the step's hyperparameters when the step first needs them
        (its first forward pass, or ``step()``), so a change between steps holds for the whole next step."""
        if self._kind is None:
            freqs = self.schedule.fix_step(self.steps, self.param_groups, (self.factor_update_freq, self.inv_update_freq))
            self.factor_update_freq, self.inv_update_freq = freqs
            if self._backward_fusion is not None and self.precondition and self.param_groups[0]["kl_clip"] is not None:
                raise ValueError(NO_KL_CLIP)
            first = any(not layer.decomposed for layer in self._held_layers())
            self._kind = (
                self.precondition and (first or self.steps % freqs[0] == 0),
                self.precondition and (first or self.steps % freqs[1] == 0),
            )
        return self._kind

    def _fusable_step(self) -> bool:
        """Whether backward fusion may update this step in ``backward()``: it keeps the decompositions."""
        return not self._step_kind()[1] and all(layer.decomposed for layer in self._preconditioning_layers)

    def _final_grad(self, p: torch.Tensor) -> None:
        if self._backward_fusion is not None:
            self._backward_fusion.grad_ready(p)

    def _states_kept_elsewhere(self) -> list[str]:
        """The layers whose per-layer method state (EKFAC's scaling) other workers keep: those this one does not
        precondition (none for a method without such state)."""
        if not self.method.stateful:
            return []
        rank, plan = self.backend.rank, self.work_plan
        return [layer.name for layer in self._preconditioning_layers if rank not in plan.preconditioning_ranks(layer.name)]

    def _held_layers(self) -> list[KFACLayer]:
        """The layers whose decompositions this worker holds (all but with ``grad_worker_fraction`` < 1)."""
        return [layer for layer in self._preconditioning_layers if self.work_plan.holds(self.backend.rank, layer.name)]

    @property
    def _preconditioning_layers(self) -> list[KFACLayer]:
        """The layers that precondition a gradient, and so are planned and decomposed: all but an embedding tied to its
        output layer, whose factors join that layer's."""
        return [layer for layer in self.layers if layer.preconditions]

    def _collecting(self, module: nn.Module) -> bool:
        """Whether a layer's hook takes its factor now: on a factor step, with gradients on, while the model trains.

        The model's mode, not the layer's: evaluation passes put the model in
        ``eval()``, while a part put in eval mode inside a training model (an
        encoder with its dropout off, frozen normalisation statistics) still
        trains, and its layers take their factors as in train mode.
        """
        return self.wrapping.module.training and torch.is_grad_enabled() and self._step_kind()[0]

    def _loss_scale(self) -> float:
        """The GradScaler's scale in this backward pass (1 without one); read once per step."""
        if self._scale is None:
            self._scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        return self._scale

    # ----------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Precondition the gradients and take one step of the base optimizer (momentum SGD, AdamW or LAMB).

        ``closure`` as in ``torch.optim``: it recomputes the loss and its
        gradients, and its loss is returned. Under ``damping='adaptive'`` it
        is required and different: it returns the loss of this step's batch
        without a backward pass, and is evaluated under ``torch.no_grad()``
        before and after the update on the steps that adjust the damping
        (whose loss before the update is returned; None on the others).
        """
        if self._damping_step is not None:
            due = self.precondition and self._damping_step.rule.due(self.steps)
            return self._damping_step.step(
                closure, self.param_groups, due, self.kfac_step.grads.synchronize, lambda: self.run_step(base_update=True)
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.run_step(base_update=True)
        return loss

    @property
    def needs_loss_closure(self) -> bool:
        """Whether :meth:`step` must get a closure returning the batch's loss: under ``damping='adaptive'``
        it evaluates the loss itself, before and after the update, to adjust the damping (a training loop
        reads this instead of the optimizer's type or options)."""
        return self._damping_step is not None

    @property
    def last_reduction_ratio(self) -> float | None:
        """ρ of the last damping adjustment (``damping='adaptive'``; None before the first), for the record."""
        return None if self._damping_step is None else self._damping_step.last_reduction_ratio

    @torch.no_grad()
    def run_step(self, base_update: bool) -> bool:
        """The K-FAC step; then the base update, unless ``base_update`` is False.

        Without the base update each preconditioned layer's gradient is left
        replaced by its preconditioned (KL-clipped) gradient and every other
        gradient by its average, for another optimizer to step on
        (:class:`~spdkfac.preconditioner.KFACPreconditioner`). Returns False for
        a step skipped over NaN/Inf (nothing changed), True otherwise.
        """
        if self._taken_over:
            raise RuntimeError(
                "a newer SPDKFACOptimizer (or KFACPreconditioner) was built on this one's model and took its layers over "
                "(K-FAC's hooks serve one optimizer per module): step the newer one"
            )
        self._refuse_awaiting_kfac("step()")
        if self.kfac_step.factors.must_be_cleared is not None:  # (a pass let through provisionally: no backward came)
            self._drop_batch()
            raise RuntimeError(
                "step() after a forward pass with no backward pass, run after a backward pass with no step() between "
                f"(one pass more than accumulation_steps={self.config.accumulation_steps}): the passes before it are "
                "dropped. Run a pass that is not trained on (a metric's, a log's) under torch.no_grad() or in eval() "
                "mode, or call step() before it"
            )
        self._slots.check(p for group in self.param_groups for p in group["params"])
        if not base_update and self.config.update_fusion is not UpdateFusion.NONE:
            raise ValueError(f"update_fusion={self.config.update_fusion!r} updates the parameters itself; it needs the base update")
        if self._nothing_to_step():
            return True
        self.flush()  # the previous step's updates the forward pass did not reach, before this step's
        self._refuse_unseen_gradients()
        self.kfac_step.grads.check_accumulated("step()", short_ok=True)
        self.kfac_step.grads.learn_edits()
        try:
            # Every rank's all-reduces of the step issued alike first (a layer that ran on some workers only holds
            # back those after it there): a collective issued directly before would pair with another one
            self.kfac_step.order.settle()
            if not self._threads_agreed:  # before any of the step's matrix arithmetic
                self._threads_agreed = True
                notice = agree_on_thread_count(self.backend, any(layer.helper.weight.device.type == "cpu" for layer in self.layers))
                if notice is not None:
                    warnings.warn(notice, stacklevel=_callers_level())
            if self.wrapping.averages_gradients:  # DDP (FSDP) averaged its module's gradients only
                trained = [p for p in self._beside_model if p.requires_grad]  # (a frozen one has no gradient anywhere)
                average_gradients_now(self.backend, trained, "spdkfac.beside_model_grad")
            factor_step, inverse_step = self._step_kind()
            hyper = StepHyper.from_group(self.param_groups[0], self._layer_lrs())
            backward = self._backward_fusion
            if backward is not None and backward.active:  # updated in backward: the factors and the checks are left
                backward.finish()
                backward.check_unchanged()
                self.kfac_step.run_after_fused(factor_step, hyper, self.steps, backward.bad)
                backward.commit()
            else:
                self.kfac_step.run(factor_step, inverse_step, hyper, self.steps)
                if factor_step and self._diagonal_unchecked:
                    self._warn_if_used_outside_forward()
                if base_update:
                    self._base_update()
            self.steps += 1
            self._gathered = None  # (the decompositions may have changed)
            self.kfac_step.nonfinite.good_step()
            if self.timeline is not None and self._record is not None:
                self.timeline.end()
        except SkipStep:  # every worker skips this step (the values checked are identical everywhere)
            self._begin_iteration()
            return False
        except BaseException:
            # The first error is the one to see (after a peer died, the engine's): drop this iteration's
            # state without the checks that would raise again over collectives that can never complete.
            self._begin_iteration(abandon=True)
            raise
        self._begin_iteration()
        return True

    def _warn_if_used_outside_forward(self) -> None:
        """Once, at the first factor step: an embedding whose weight also serves outside its forward (a tied head)."""
        layers, self._diagonal_unchecked = self._diagonal_unchecked, []
        for layer in layers:
            if used_outside_forward(layer):
                warnings.warn(
                    f"{layer.name!r} ({type(layer.module).__name__}) has gradient in rows of tokens it never looked up: "
                    f"its weight is used outside its forward too (a tied output layer written as x @ weight.T?). Its "
                    f"factors describe only the lookups, so those rows are preconditioned by 1/damping: leave it to "
                    f"the base update, skip_layers=[{layer.name!r}]",
                    stacklevel=_callers_level(),
                )

    def _refuse_unseen_gradients(self) -> None:
        """A parameter unfrozen after this step's first forward pass has a gradient no hook saw (not averaged
        over the workers, no factors): refused, before anything changes."""
        if not any(p.requires_grad and p.grad is not None for p in self._outside):
            return  # (a parameter still frozen may hold a stale gradient from before: not this step's)
        outside = {id(p) for p in self._outside}
        unseen = [name for name, p in self.model.named_parameters() if p.requires_grad and p.grad is not None and id(p) in outside]
        if unseen:
            raise RuntimeError(
                f"parameters {unseen} have gradients but were frozen when this step began (their requires_grad changed "
                "after its first forward pass, or under torch.compile after zero_grad()): change requires_grad before "
                "zero_grad() and the step's forward pass; the optimizer then takes them in"
            )

    def _base_update(self) -> None:
        """The base optimizer's step on the preconditioned gradients (held for the next forward passes under
        ``update_fusion='forward'``)."""
        if self._forward_fusion is not None:
            self._forward_fusion.defer()
            return
        t_update = Timeline.now() if self._record is not None else 0.0
        apply_base_update(self.config.base, self.param_groups, self.state, self._direct)
        if self._record is not None:
            t = Timeline.now()
            self._record.update += t - t_update
            self._record.span("update", t_update, t)

    # ------------------------------------------------------------ between steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; after a skipped ``step()`` also drop that step's backward passes: their gradient
        and factor all-reduces are completed first (every worker calls this at the same point), then forgotten.

        A skipped step: a GradScaler's overflow, or backward passes through
        this optimizer's model for another optimizer's step (a GAN's generator
        step through the discriminator).
        """
        if not set_to_none:  # zeroing in place would change the gradients the held updates use
            self.flush()
        if self.kfac_step.backward_seen:  # that backward's step() was skipped
            self._drop_batch()
        super().zero_grad(set_to_none=set_to_none)
        self._take_unfrozen(strict=False)

    def synchronize(self) -> None:
        """Wait until every gradient holds its average (call before reading them, e.g. to clip; ``step()`` does it)."""
        if self._backward_fusion is not None:
            raise RuntimeError(
                "synchronize() under update_fusion='backward': the parameters are updated during backward(), so the "
                "gradients cannot be read or clipped before the update; use update_fusion='forward' (or 'none') to clip"
            )
        self.kfac_step.grads.synchronize()

    def flush(self) -> None:
        """Apply every parameter update still held by ``update_fusion='forward'`` (no-op otherwise).

        Call before reading the parameters outside a forward pass (the
        model's ``state_dict()``/``load_state_dict()`` and this optimizer's
        ``step()``, ``state_dict()`` and ``load_state_dict()`` do it).
        """
        if self._forward_fusion is not None:
            self._forward_fusion.flush()

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
        that loads this. Save between steps (not mid-accumulation, nor
        between ``backward()`` and ``step()`` under backward fusion).
        """
        if self._backward_fusion is not None and self._backward_fusion.applied:
            raise RuntimeError(
                "state_dict() between backward() and step() under update_fusion='backward': the parameters hold an "
                "update that step() has not accepted yet; save after step()"
            )
        self._refuse_awaiting_kfac("state_dict()")
        self.flush()
        sd = super().state_dict()
        sd["kfac"] = save_kfac_state(
            self.layers,
            self.steps,
            (self.factor_update_freq, self.inv_update_freq),
            self.method,
            self.config.as_dict(),
            self.kfac_step.factors.expected,
        )
        sd["kfac"]["grad_workers"] = grad_worker_record(self.work_plan, self.grad_worker_choice)
        elsewhere = self._states_kept_elsewhere()
        for name in elsewhere:  # not this worker's to save (its own is a fresh one)
            sd["kfac"]["layers"][name]["method_state"] = None
        if self._gathered is not None:
            for name, entries in self._gathered.items():
                sd["kfac"]["layers"][name].update(entries)
        elif self.steps and not self._partial_noted and (elsewhere or len(self._held_layers()) < len(self._preconditioning_layers)):
            self._partial_noted = True
            then = (
                f"is refused ({self.method.name}'s per-layer state cannot be recomputed)"
                if elsewhere
                else "recomputes every decomposition at its first step, one early refresh"
            )
            warnings.warn(
                f"this state_dict() holds this worker's share of the K-FAC state only (grad_worker_fraction below 1): "
                f"a resume from it {then}. For a checkpoint that resumes bit for bit, call "
                "optimizer.consolidate_state_dict() on every worker before rank 0's state_dict() (Lightning does; "
                "Hugging Face's Trainer with callbacks=[spdkfac.hugging_face_callback()]; "
                "docs/gradient-workers.md#checkpoints). This is said once",
                stacklevel=2,
            )
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: give rank ``to`` every worker's decompositions for its next :meth:`state_dict`, so that a
        resume from that checkpoint recomputes none (the uninterrupted run, bit for bit).

        Needed only with ``grad_worker_fraction`` below 1 (or
        ``distribute_preconditioning``), where each worker keeps its own
        layers' decompositions; elsewhere it sends nothing. Call it on every
        worker, between steps, before rank ``to`` saves (as
        ``ZeroRedundancyOptimizer.consolidate_state_dict``). They are kept in
        host memory until the next step; without this, a resume recomputes
        every decomposition at its first step (docs/gradient-workers.md).
        """
        if self.kfac_step.backward_seen:
            raise RuntimeError(
                "consolidate_state_dict() between backward() and step(): this step's factors are on their way and "
                "its decompositions not made yet; call it after step(), on every worker"
            )
        self.flush()
        gathered = gather_decompositions(self.layers, self.work_plan.holders, to, self.backend)
        for name, entries in gather_method_states(self.layers, self.work_plan.preconditioning_ranks, to, self.backend).items():
            gathered.setdefault(name, {}).update(entries)
        self._gathered = gathered

    def kfac_state_dict(self) -> dict[str, Any]:
        """The K-FAC part of :meth:`state_dict` alone (its ``'kfac'`` entry: factors, decompositions, step counter).

        For checkpointing that keeps only ``state`` and ``param_groups`` of an
        optimizer: ``torch.distributed.checkpoint``'s ``get_state_dict``, FSDP's
        usual way. Save rank 0's beside that checkpoint and give it back to
        every worker with :meth:`load_kfac_state_dict` (with
        ``grad_worker_fraction`` below 1, after :meth:`consolidate_state_dict`
        on every worker, for every worker's decompositions).
        """
        kfac: dict[str, Any] = self.state_dict()["kfac"]
        return kfac

    def _refuse_awaiting_kfac(self, call: str) -> None:
        if self._awaiting_kfac is not None:
            raise RuntimeError(
                f"{call} after a load_state_dict() of 'state' and 'param_groups' alone (torch.distributed.checkpoint's "
                "form, which drops the K-FAC state): give the K-FAC state saved beside it with "
                "optimizer.load_kfac_state_dict(saved) first, on every worker (docs/fsdp.md)"
            )

    def load_kfac_state_dict(self, kfac: dict[str, Any]) -> None:
        """Give the :meth:`kfac_state_dict` of a checkpoint whose optimizer state lacks it (``torch.distributed.checkpoint``'s),
        before or after the :meth:`load_state_dict` of that state (``set_state_dict`` calls it): before, it is held
        for that call; after, the load completes now (Lightning's ``on_load_checkpoint`` comes after the strategy
        loaded the optimizer). ValueError where it does not fit this optimizer's layers and method."""
        check_kfac_state({"kfac": kfac}, self.layers, self.method)
        if self._awaiting_kfac is None:
            self._pending_kfac = kfac
            return
        base, self._awaiting_kfac = self._awaiting_kfac, None
        self.load_state_dict({**base, "kfac": kfac})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` for the same model and compute method (or its
        ``state`` and ``param_groups``, after :meth:`load_kfac_state_dict` gave its K-FAC part)."""
        if "kfac" not in state_dict and self._pending_kfac is not None:
            state_dict = {**state_dict, "kfac": self._pending_kfac}
        if "kfac" not in state_dict and is_base_state(state_dict):  # its K-FAC part may follow: load_kfac_state_dict()
            self._awaiting_kfac = state_dict
            return
        kfac = check_kfac_state(state_dict, self.layers, self.method)
        self._awaiting_kfac = None
        # Per-layer state the saving worker left to others cannot be recomputed, except before the first step, when
        # every one is fresh (accelerate's prepare() loads each worker's own state_dict() back then).
        lacking = [layer.name for layer in self._preconditioning_layers if kfac["layers"][layer.name].get("method_state", {}) is None]
        if lacking and int(kfac["steps"]) > 0:
            raise ValueError(
                f"checkpoint lacks compute_method={self.method.name!r}'s per-layer state of layers {lacking}: it was saved by "
                "a worker that does not precondition them (grad_worker_fraction below 1), and that state cannot be "
                "recomputed. Save after optimizer.consolidate_state_dict() on every worker (docs/gradient-workers.md#checkpoints)"
            )
        self._pending_kfac = None
        self._gathered = None
        self.flush()
        ours = self.config.as_dict()
        # The options the saved state depends on (the value a checkpoint from before the option means).
        for option, before, why in (
            ("base", "sgd", "its optimizer state cannot continue here"),
            ("no_weight_decay", [], "its parameter groups differ"),
            ("max_factor_dim", None, "its factors are shaped differently"),
        ):
            saved = kfac.get("config", {}).get(option, before)
            if saved != ours[option]:
                raise ValueError(
                    f"checkpoint was saved with {option}={saved!r} but this optimizer uses {option}={ours[option]!r}: "
                    f"{why}; construct the optimizer with {option}={saved!r} to resume it"
                )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "kfac"})
        self.schedule.hold_layer_wide(self.param_groups, loaded=True)  # (an older version left factor_decay in group 0)
        load_kfac_state(kfac, self.layers)
        self.kfac_step.factors.expected.clear()  # the checkpoint's (none in older ones: learned again)
        self.kfac_step.factors.expected.update(saved_uses(kfac))
        keep_held_decompositions(kfac, self.layers, {layer.name for layer in self._held_layers()}, self.method)
        elsewhere = set(self._states_kept_elsewhere())
        for layer in self.layers:  # a state kept elsewhere: a fresh one here, as before any step
            if layer.name in elsewhere:
                layer.method_state = self.method.new_state()
        note = rechosen_note(kfac.get("grad_workers"), self.work_plan, self.grad_worker_choice)
        if note is not None and self.backend.rank == 0:
            print(note, flush=True)
        for fusion in (self._forward_fusion, self._backward_fusion):
            if fusion is not None:
                fusion.bind(self.param_groups, self.state)  # (replaced by the load)
        self.steps = int(kfac["steps"])
        if "update_freqs" in kfac:  # (absent from checkpoints made before schedules existed)
            self.factor_update_freq, self.inv_update_freq = (int(f) for f in kfac["update_freqs"])
        self._begin_iteration()

    # ------------------------------------------------------------ reporting
    def memory_usage(self) -> dict[str, int]:
        """Bytes this worker holds in factors (packed running averages) and inverses (or eigendecompositions), per kind.

        With ``grad_worker_fraction`` < 1 only the decompositions of the layers this worker is a gradient worker of.
        """
        return memory_usage(self.layers, self.method)

    def refresh_statistics(self) -> dict[str, Any]:
        """How each eigenbasis was refreshed so far (``eigen_refresh='warm'``; empty otherwise), the same on every rank.

        ``{'totals': {'warm', 'full_scheduled', 'full_drift', 'refreshes', 'warm_share', 'fell_back'}, 'factors':
        {'layer/A': {'dim', 'warm', 'full_scheduled', 'full_drift', 'drift', 'max_drift'}}}``: ``full_scheduled``
        counts the first refresh and every ``eigen_full_every``-th, ``full_drift`` those where the previous basis's
        residual on the new factor (``drift``, ``max_drift``) exceeded the tolerance.
        """
        return self.kfac_step.decompositions.refreshes.as_dict()

    def kfac_summary(self) -> str:
        """Which modules K-FAC preconditions (by type, with how many parameters), which get the base update alone and why."""
        return self._kfac_summary(self.config.base.display_name)

    def _kfac_summary(self, left_to: str) -> str:
        """:meth:`kfac_summary`, naming ``left_to`` as the update of the parameters left out."""
        norm_layers = self.config.norm_layers is NormLayers.KFAC
        text = kfac_summary(self.model, self.layers, self.config.skip_layers, self.precondition, norm_layers, left_to)
        outside = not_in_model(self.model, self.param_groups)
        if outside:
            text += (
                f"\n{left_to}, not preconditioned, for {sum(p.numel() for p in outside):,} parameters outside the model "
                f"({len(outside)} tensors of added parameter groups)"
            )
        return text

    def fusion_plan(self) -> dict[str, list[list[FactorKey]] | None]:
        """Current fusion groups per pass (None while profiling, or for ``'layerwise'``)."""
        return {kind: self.kfac_step.controller.plan(kind) for kind in FACTOR_KINDS}

    def _nothing_to_step(self) -> bool:
        """A fresh optimizer stepped with no pass run and zero gradients (set by hand): a step that changes nothing.

        Horovod's ``broadcast_optimizer_state`` does this to a new optimizer
        (every worker alike) so that a ``torch.optim`` optimizer creates its
        state: here the state stays empty, and Horovod has nothing to
        broadcast (a new optimizer is the same on every worker).
        ``torch.distributed.checkpoint``'s ``get_state_dict`` does it at
        learning rate 0, for a state to load a checkpoint into: there the base
        state is created as zeros (what no state means, :func:`zero_base_state`).
        Anything else (a pass run, a gradient, a step taken) goes on to the
        step and its checks.
        """
        if self.steps or self.state or self._kind is not None or self.kfac_step.backward_seen:
            return False
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads or any(bool(g.any()) for g in grads):  # (no gradient at all: the usual error, no backward)
            return False
        if all(float(group["lr"]) == 0.0 for group in self.param_groups):
            zero_base_state(self.config.base, self.param_groups, self.state, self._direct)
        return True

    def _hand_over(self) -> None:
        """A newer optimizer was built on this one's model: detach (held updates applied first); step() refuses from now on."""
        self.remove_hooks()
        self._taken_over = True

    def remove_hooks(self) -> None:
        """Detach every hook from the model (held updates applied first; the optimizer is unusable afterwards)."""
        if self._forward_fusion is not None:
            self._forward_fusion.remove_hooks()
        self.kfac_step.remove_hooks()
        self.wrapping.remove_hooks()
        if self._unfreeze_hook is not None:
            self._unfreeze_hook.remove()
            self._unfreeze_hook = None

    def __repr__(self) -> str:
        g = self.param_groups[0]
        keys = ("lr", "momentum", "betas", "eps", "weight_decay", "damping", "factor_decay", "kl_clip")
        hyper = ", ".join(f"{k}={g[k]}" for k in keys if k in g)
        options = ", ".join(f"{k}={v!r}" for k, v in self.config.as_dict().items())
        return (
            f"SPDKFACOptimizer(layers={len(self.layers)}, {hyper}, factor_update_freq={self.factor_update_freq}, "
            f"inv_update_freq={self.inv_update_freq}, backend={self.backend.name}(rank {self.backend.rank}/"
            f"{self.backend.size}), {options}, perf_model={self.perf_model.source!r})"
        )
