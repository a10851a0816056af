"""SPDKFACOptimizer: distributed K-FAC as a drop-in replacement for ``torch.optim.SGD``.

The optimizer is a *schedule*: it registers hooks, decides when factors and
inverses are updated, and in ``step()`` orders the work. The maths lives in
:mod:`spdkfac.layers`, factor communication in :mod:`spdkfac.fusion`,
inversion placement in :mod:`spdkfac.placement` (driven by
:mod:`spdkfac.perfmodels`), and collectives in :mod:`spdkfac.comm`.

Per step, on every worker:

1. forward: a pre-hook computes each layer's batch factor ``A`` and hands it
   to the :class:`~spdkfac.fusion.TensorFusionController`, which all-reduces
   fused groups asynchronously while later layers compute;
2. backward: a gradient hook on each layer output does the same for ``G``; per-parameter
   hooks start the gradient all-reduces (as Horovod's DistributedOptimizer);
3. ``step()``: wait for gradients and factors, fold the averaged factors into
   running averages, invert them per the placement plan (owners broadcast the
   upper triangle of their inverses while inverting the next one; with
   ``compute_method='eigen'`` they eigendecompose and broadcast ``Q`` and the
   eigenvalues), precondition ``grad <- (G+γI)^-1 grad (A+γI)^-1`` (eigen:
   ``(A ⊗ G + γI)^-1 vec(grad)``) (every layer on every worker, or with
   ``distribute_preconditioning`` each layer on one worker, results broadcast),
   scale by the KL-clip factor, and apply momentum SGD with weight decay to
   every parameter.
"""
from __future__ import annotations

import itertools
import math
import statistics
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn as nn

from .comm import CommBackend, Handle, get_backend
from .fusion import DEFAULT_THRESHOLD_BYTES, FUSION_POLICIES, TensorFusionController, plan_groups
from .layers import FACTOR_KINDS, FactorKey, KFACLayer, LayerFilter, factor_list, functional_submodules, kfac_layers
from .decomposition import Eigen, check_method, eigen_payload, stage_costs, unpack_eigen
from .inversion import compute_eigen, compute_inverses
from .linalg import all_finite, invert_spd, triangle_size
from .nonfinite import NonFiniteError, NonFiniteFactorError, NonFiniteGuard, SkipStep, non_finite
from .perfmodels import PerfModel, load_perf_model
from .placement import PLACEMENTS, PlacementPlan, balance_by_cost, place, preconditioning_cost
from .schedules import Scheduled, StepSchedule
from .timeline import FactorEvent, IterationRecord, Timeline

__all__ = ["SPDKFACOptimizer", "NonFiniteError", "NonFiniteFactorError"]



def _check_number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return v


def _check_freq(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class SPDKFACOptimizer(torch.optim.Optimizer):
    """Distributed K-FAC with pipelined factor communication and load-balanced inversion.

    Replace ``torch.optim.SGD(model.parameters(), lr=..., momentum=...)`` by
    ``SPDKFACOptimizer(model, lr=..., momentum=...)``; the optimizer averages
    gradients across workers itself, so do not also wrap it in Horovod's
    DistributedOptimizer or the model in DDP. The loss must be a mean over the
    local batch (PyTorch's default).

    Args:
        model: the network; every ``nn.Linear`` and ``nn.Conv2d`` (groups=1,
            zero padding) with a trainable weight is preconditioned, every other
            parameter gets the plain momentum-SGD update.
        lr: learning rate (read from ``param_groups`` each step, so LR
            schedulers work).
        momentum: SGD momentum.
        weight_decay: L2 penalty added to the (preconditioned) gradient.
        damping: Tikhonov damping γ: inverses are ``(F + γI)^-1`` (a new value
            takes effect at the next inverse update; with
            ``compute_method='eigen'``, γ is added to the eigenvalues of
            ``A ⊗ G`` when preconditioning, so a new value takes effect at once).
        factor_decay: running-average weight of the old factor.
        kl_clip: KL-clip bound on the preconditioned update (None disables).
        factor_update_freq: update factors at the steps where
            ``steps % factor_update_freq == 0`` (and at the first step).
        inv_update_freq: recompute inverses likewise (a multiple of
            ``factor_update_freq`` at every step).

            ``damping``, ``kl_clip`` and the two frequencies may each be a
            callable ``f(step) -> value`` of the number of completed steps,
            evaluated once per step on every worker alike and validated then
            (:mod:`spdkfac.schedules`; or use its per-epoch
            :class:`~spdkfac.schedules.KFACParamScheduler`). The values in force
            are ``param_groups[0]['damping']`` / ``['kl_clip']`` and the
            attributes ``factor_update_freq`` / ``inv_update_freq``; a write
            there between steps holds from the next step on (for an option
            given as a callable, until the callable's next value).
        backend: ``'auto'``, ``'horovod'``, ``'torch'``, ``'single'`` or a
            :class:`~spdkfac.comm.CommBackend`.
        fusion: factor all-reduce fusion policy: ``'optimal'`` (Eq. 15),
            ``'threshold'``, ``'layerwise'`` or ``'naive'``.
        pipelining: all-reduce factors from the hooks as they are computed
            (True) or all at once after the backward pass (False, as D-KFAC).
        placement: inversion placement: ``'lbp'`` (Algorithm 1), ``'seq'``
            (MPD-KFAC) or ``'local'`` (D-KFAC).
        compute_method: ``'inverse'`` (the paper's damped inverses
            ``(G+γI)^-1 grad (A+γI)^-1``) or ``'eigen'`` (KAISA's
            eigendecompositions, ``(A ⊗ G + γI)^-1 vec(grad)``: a closer
            approximation of the damped Fisher, a slower decomposition and a
            broadcast of ``d*d + d`` instead of ``d(d+1)/2`` elements; the
            placement is costed with the performance model's ``eigen`` curve).
        distribute_preconditioning: each layer's gradient is preconditioned
            by one worker (layers balanced by their matmul cost) and the
            results are broadcast, one fused buffer per worker, instead of
            every worker preconditioning every layer (not in the paper; as
            KAISA's MEM-OPT). Trades a broadcast of all preconditioned
            gradients per step for ``1/P`` of the preconditioning compute:
            worth it where the preconditioning matmuls are slow next to the
            network (CPU workers, or factors updated rarely). Same result.
        overlap_preconditioning: on steps that keep the current inverses
            (all but one in ``inv_update_freq``), precondition each layer as
            soon as its averaged gradient arrives, last layer first, so that
            the gradient all-reduce of the earlier layers hides behind the
            preconditioning matmuls of the later ones; on such steps that
            update the factors, the preconditioning (which reads only the
            kept inverses) also runs before waiting for the factor
            all-reduces, hiding them as well (not in the paper; the D-KFAC
            and MPD-KFAC baselines turn it off). Same result.
        perf_model: path to a fitted performance-model JSON, a
            :class:`~spdkfac.perfmodels.PerfModel`, or None for the built-in
            uncalibrated default (warns once).
        fusion_threshold_bytes: buffer size of the ``'threshold'`` policy.
        profile_steps: factor-update steps timed (after one warm-up step)
            before the ``'optimal'`` fusion plan is made.
        replan_interval: re-profile every this many factor-update steps and
            replace the ``'optimal'`` plan if the per-layer times have drifted
            (None: plan once). The current plan stays in use while the new
            profile is taken; every worker switches at the same step.
        timeline: record a per-iteration :class:`~spdkfac.timeline.Timeline`.
        precondition: False turns K-FAC off: the optimizer is then plain
            distributed momentum SGD with the same gradient communication
            (the S-SGD baseline of the benchmarks).
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 mixed-precision
            loop (``scaler.scale(loss).backward(); scaler.step(opt);
            scaler.update()``). The optimizer then removes the loss scale from
            the G factors and finishes the gradient all-reduces at the end of
            ``backward()``, so that the scaler unscales and checks averaged
            gradients; a step the scaler skips (inf/NaN gradients, identical on
            every worker) is discarded by the next :meth:`zero_grad`.
        accumulation_steps: gradient accumulation: call ``backward()`` this
            many times (k), then ``step()`` once; each micro-batch loss is its
            mean divided by k (torch's idiom), so the gradients sum to the mean
            over the k micro-batches. The factors are the mean of the
            micro-batches' (each G computed with the 1/k removed, like a loss
            scale), i.e. with equal micro-batches exactly those of one batch
            k times as large. One round of communication per step: factors are
            summed locally and sent (pipelined) from the hooks of the k-th
            micro-batch, and each gradient all-reduce starts at the k-th
            accumulation of its parameter. A ``step()`` (or
            :meth:`synchronize`) after another number of backward passes, or a
            (k+1)-th backward pass, raises.
        skip_nonfinite: how many consecutive steps meeting NaN or Inf (in the
            averaged gradients, the averaged factors or the preconditioned
            gradients) are skipped, with a warning, before a
            :class:`NonFiniteError` is raised (0: raise at the first). A
            skipped or refused step changes no parameter, momentum buffer or
            factor and does not count as a step; every worker decides the same
            at the same step, because the values checked are identical on all.
            To skip a batch yourself after the forward pass, decide on every
            worker at once: ``if not optimizer.finite_everywhere(loss):
            continue`` (one tiny all-reduce).
        skip_layers: modules to leave out of K-FAC (plain momentum-SGD
            update): module names (``'encoder.layers.0.linear1'``), class
            names (``'Linear'``) or classes. Layers whose weight is used
            without their ``forward()`` (``nn.MultiheadAttention.out_proj``)
            are left out automatically, with a notice; a weight shared by
            several modules (tied weights) must be left out here.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        damping: Scheduled[float] = 0.003,
        factor_decay: float = 0.95,
        kl_clip: Scheduled[Optional[float]] = 0.001,
        factor_update_freq: Scheduled[int] = 1,
        inv_update_freq: Scheduled[int] = 1,
        backend: Union[str, CommBackend] = "auto",
        fusion: str = "optimal",
        pipelining: bool = True,
        placement: str = "lbp",
        compute_method: str = "inverse",
        distribute_preconditioning: bool = False,
        overlap_preconditioning: bool = True,
        perf_model: Union[None, str, PerfModel] = None,
        fusion_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        profile_steps: int = 3,
        replan_interval: Optional[int] = None,
        timeline: bool = False,
        precondition: bool = True,
        grad_scaler: Optional[Any] = None,
        accumulation_steps: int = 1,
        skip_nonfinite: int = 0,
        skip_layers: Sequence[LayerFilter] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _check_number("lr", lr, 0.0)
        _check_number("momentum", momentum, 0.0, 1.0)
        _check_number("weight_decay", weight_decay, 0.0)
        _check_number("factor_decay", factor_decay, 0.0, 1.0)
        self.schedule = StepSchedule(
            dict(damping=damping, kl_clip=kl_clip, factor_update_freq=factor_update_freq, inv_update_freq=inv_update_freq),
            dict(damping=lambda n, v: _check_number(n, v, 0.0, low_open=True),
                 kl_clip=lambda n, v: None if v is None else _check_number(n, v, 0.0, low_open=True),
                 factor_update_freq=_check_freq, inv_update_freq=_check_freq),
        )
        # Validates the numbers, and the callables' values at the first step.
        initial = self.schedule.resolve(0, dict(damping=damping, kl_clip=kl_clip, factor_update_freq=factor_update_freq,
                                                inv_update_freq=inv_update_freq))
        if fusion not in FUSION_POLICIES:
            raise ValueError(f"fusion must be one of {FUSION_POLICIES}, got {fusion!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        check_method(compute_method)
        if not isinstance(pipelining, bool):
            raise TypeError(f"pipelining must be a bool, got {type(pipelining).__name__}")
        if not isinstance(distribute_preconditioning, bool):
            raise TypeError(f"distribute_preconditioning must be a bool, got {type(distribute_preconditioning).__name__}")
        if not isinstance(overlap_preconditioning, bool):
            raise TypeError(f"overlap_preconditioning must be a bool, got {type(overlap_preconditioning).__name__}")
        _check_freq("accumulation_steps", accumulation_steps)
        _check_freq("profile_steps", profile_steps)
        if replan_interval is not None:
            _check_freq("replan_interval", replan_interval)
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "unscale_")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        if isinstance(fusion_threshold_bytes, bool) or not isinstance(fusion_threshold_bytes, int) or fusion_threshold_bytes <= 0:
            raise ValueError(f"fusion_threshold_bytes must be a positive integer, got {fusion_threshold_bytes!r}")

        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, damping=initial["damping"], factor_decay=factor_decay,
                        kl_clip=initial["kl_clip"])
        super().__init__(params, defaults)

        self.model = model
        # The update frequencies in force (callables: their value at the current step; see _resolve_schedule).
        self.factor_update_freq: int = initial["factor_update_freq"]
        self.inv_update_freq: int = initial["inv_update_freq"]
        self.fusion = fusion
        self.pipelining = pipelining
        self.placement_strategy = placement
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.profile_steps = profile_steps
        self.replan_interval = replan_interval
        self.fusion_plans_made = 0  # plans made so far (the first, then one per re-profile)
        self.fusion_plan_changes = 0  # re-profiles that changed the plan
        self.grad_scaler = grad_scaler
        self.accumulation_steps = accumulation_steps
        self.nonfinite = NonFiniteGuard(skip_nonfinite)
        self.steps = 0

        self.precondition = precondition
        self.compute_method = compute_method
        self.layers: List[KFACLayer] = kfac_layers(model, compute_method, tuple(skip_layers)) if precondition else []
        functional = functional_submodules(model)
        if precondition and functional:  # a notice, once: these layers are not preconditioned
            warnings.warn(f"these layers get the plain momentum-SGD update, without K-FAC: {functional}", stacklevel=2)
        if precondition and not self.layers:
            raise ValueError(
                "model has no layer SPDKFACOptimizer can precondition (nn.Linear or nn.Conv2d with groups=1 "
                "and zero padding, with a trainable weight); use torch.optim.SGD for this model"
            )
        self._layer_by_name = {layer.name: layer for layer in self.layers}

        self.backend = get_backend(backend)
        self.perf_model = load_perf_model(perf_model)
        self.perf_model.check_world_size(self.backend.size)
        self.perf_model = self.perf_model.scaled_to(self.backend.size)  # plan for this worker count, as the simulator

        self.controller = TensorFusionController(self.backend)
        self.timeline: Optional[Timeline] = Timeline() if timeline else None
        self._record: Optional[IterationRecord] = None
        self._profile: Dict[str, List[List[float]]] = {"A": [], "G": []}
        self._ready: Dict[str, List[float]] = {"A": [], "G": []}
        self._pass_t0: Dict[str, Optional[float]] = {"A": None, "G": None}
        self._factor_steps_seen = 0
        self._profile_after = 1  # factor steps up to this one are not sampled (the first is a warm-up)
        self._planned = fusion == "layerwise" or not precondition
        self._stash: List[Tuple[FactorKey, torch.Tensor]] = []

        self.placement_plan: PlacementPlan = place(
            placement, factor_list(self.layers), self.backend.size, *stage_costs(self.perf_model, compute_method)
        )
        # Layer name -> the rank that preconditions it (empty: every rank preconditions every layer).
        self.distribute_preconditioning = distribute_preconditioning
        self.overlap_preconditioning = overlap_preconditioning
        self.overlapped_steps = 0  # steps that preconditioned while gradients were still being averaged
        self.overlapped_factor_steps = 0  # of those, factor steps that preconditioned before waiting for the factors
        self.precondition_owner: Dict[str, int] = {}
        if distribute_preconditioning and self.backend.size > 1:
            costs = [preconditioning_cost(layer.a_dim, layer.g_dim) for layer in self.layers]
            owners = balance_by_cost(costs, self.backend.size)
            self.precondition_owner = {layer.name: rank for layer, rank in zip(self.layers, owners)}

        self._grad_handles: Dict[torch.Tensor, Handle] = {}
        # Names every rank agrees on (collectives are matched by name): the model's, else the position in the groups.
        self._param_names = {p: n for n, p in model.named_parameters()}
        for i, p in enumerate(p for group in self.param_groups for p in group["params"]):
            self._param_names.setdefault(p, f"param{i}")
        self._hook_handles: List[Any] = []
        for layer in self.layers:
            self._hook_handles.append(layer.module.register_forward_pre_hook(self._make_a_hook(layer)))
            self._hook_handles.append(layer.module.register_forward_hook(self._make_g_hook(layer)))
        if self.backend.size > 1 or accumulation_steps > 1:  # all-reduce, or count the backward passes
            for p in params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self._begin_iteration()

    # ------------------------------------------------------------------ schedule
    def _is_factor_step(self) -> bool:
        return self._resolve_schedule()[0]

    def _is_inverse_step(self) -> bool:
        return self._resolve_schedule()[1]

    def _resolve_schedule(self) -> Tuple[bool, bool]:
        """Fix this step's hyperparameters and whether it updates factors / inverses, once per step.

        Runs when the step first needs them (its first training forward, or
        ``step()``), so that a change made between two ``step()`` calls (a
        :class:`~spdkfac.schedules.KFACParamScheduler`, a write to
        ``param_groups``) holds for the whole next step. Callables are
        evaluated at the step counter, identically on every worker. A step
        updates factors (inverses) when ``steps % freq == 0`` with the
        frequency in force, and always while some layer has no inverse yet.
        """
        if self._step_kind is None:
            group = self.param_groups[0]
            values = self.schedule.resolve(self.steps, dict(damping=group["damping"], kl_clip=group["kl_clip"],
                                                            factor_update_freq=self.factor_update_freq,
                                                            inv_update_freq=self.inv_update_freq))
            for g in self.param_groups:
                g["damping"], g["kl_clip"] = values["damping"], values["kl_clip"]
            self.factor_update_freq, self.inv_update_freq = values["factor_update_freq"], values["inv_update_freq"]
            first = any(not layer.decomposed for layer in self.layers)
            self._step_kind = (
                self.precondition and (first or self.steps % self.factor_update_freq == 0),
                self.precondition and (first or self.steps % self.inv_update_freq == 0),
            )
        return self._step_kind

    @property
    def _profiling(self) -> bool:
        return not self._planned

    def _begin_iteration(self, abandon: bool = False) -> None:
        self._record = self.timeline.begin(self.steps) if self.timeline is not None else None
        self._ready = {"A": [], "G": []}
        self._pass_t0 = {"A": None, "G": None}
        self._stash = []
        self._grad_handles.clear()
        self._a_taken: set = set()
        self._loss_scale: Optional[float] = None
        self._grads_synchronized = False
        self._sync_queued = False
        self._backward_seen = False  # a backward pass ran since the last step()
        self._step_kind: Optional[Tuple[bool, bool]] = None  # (factor step, inverse step), fixed when first needed
        self._micro_factors: Dict[FactorKey, Tuple[int, Optional[torch.Tensor]]] = {}  # accumulated micro-batches: (count, sum)
        self._grad_counts: Dict[torch.Tensor, int] = {}  # backward passes that reached each parameter
        self.controller.begin_iteration(self._record, abandon=abandon)

    # ---------------------------------------------------------------------- hooks
    def _collecting(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self._is_factor_step()

    def _submit(self, layer: KFACLayer, kind: str, compute: Callable[[], torch.Tensor]) -> None:
        key = (kind, layer.name)
        self._backward_seen |= kind == "G"
        if kind == "A":
            self._a_taken.add(layer.name)
        count, total = self._micro_factors.get(key, (0, None))
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
            self._micro_factors[key] = (count + 1, factor if total is None else total.add_(factor))
            return
        self._micro_factors[key] = (count + 1, None)
        # The last micro-batch (the only one with k=1): timed and pipelined with the communication as usual.
        timed = self._record is not None or self._profiling
        if timed:
            if self._profiling and torch.cuda.is_available():
                torch.cuda.synchronize()
            t_start = Timeline.now()
            if self._pass_t0[kind] is None:
                self._pass_t0[kind] = t_start
        factor = compute()
        if total is not None:  # the mean over the micro-batches
            factor = total.add_(factor).div_(self.accumulation_steps)
        if timed:
            if self._profiling and factor.is_cuda:
                torch.cuda.synchronize()
            t_end = Timeline.now()
            self._ready[kind].append(t_end - self._pass_t0[kind])
            if self._record is not None:
                rec = self._record
                rec.factors[f"{kind}:{layer.name}"] = FactorEvent(kind, layer.name, rec.rel(t_start), rec.rel(t_end))
                self.controller.poll()
        if self.pipelining:
            self.controller.submit(key, factor)
        else:
            self._stash.append((key, factor))

    def finite_everywhere(self, value: torch.Tensor) -> bool:
        """True when ``value`` (e.g. the loss) is finite on every worker: one tiny all-reduce.

        The way to skip a bad batch after the forward pass: every worker must
        take the same decision, or their collectives no longer match.
        When it returns False, the factors this iteration's forward pass has
        sent or kept are dropped on every worker (their all-reduces waited
        for, so the collectives stay matched), and the next forward pass
        starts a fresh iteration. In the middle of an accumulated step (after
        a backward pass) the whole step is dropped, as ``zero_grad()`` would.
        """
        flag = torch.tensor([1.0 if all_finite(value.detach()) else 0.0], dtype=torch.float64, device=value.device)
        if self.backend.size > 1:
            self.backend.allreduce_async(flag, "spdkfac.finite_everywhere").wait()
        finite = bool(flag.item() == 1.0)
        if not finite:
            accumulated = self._backward_seen  # earlier micro-batches of this step (their gradients are only local)
            self.controller.discard()
            self._begin_iteration()
            if accumulated:
                super().zero_grad(set_to_none=True)
        return finite

    def _make_a_hook(self, layer: KFACLayer) -> Callable:
        def hook(module: nn.Module, inputs: Tuple[Any, ...]) -> None:
            if self._collecting(module):
                self._submit(layer, "A", lambda: layer.compute_a(inputs[0]))

        return hook

    def _make_g_hook(self, layer: KFACLayer) -> Callable:
        """Forward hook that attaches a gradient hook to the layer output.

        The output's gradient hook fires in the backward pass as soon as the
        gradient with respect to this layer's output is known, like a full
        backward hook, but it also works when the next operation modifies the
        output in place (``ReLU(inplace=True)``) and for a first layer whose
        input needs no gradient.
        """

        def g_ready(grad_output: torch.Tensor) -> None:
            # Each micro-batch loss carries 1/accumulation_steps: dividing it out like a loss scale gives its true G.
            scale = self._current_loss_scale() / self.accumulation_steps
            self._submit(layer, "G", lambda: layer.compute_g(grad_output, scale))

        def hook(module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
            if layer.name in self._a_taken and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(g_ready)

        return hook

    def _current_loss_scale(self) -> float:
        """The GradScaler's scale in this backward pass (1 without one); read once per iteration."""
        if self._loss_scale is None:
            self._loss_scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        return self._loss_scale

    def _start_grad_allreduce(self, p: torch.Tensor) -> None:
        self._grad_handles[p] = self.backend.allreduce_async(p.grad, f"spdkfac.grad.{self._param_names[p]}")

    def _grad_hook(self, p: torch.Tensor) -> None:
        passes = self._grad_counts.get(p, 0) + 1
        if passes > self.accumulation_steps or p in self._grad_handles:
            raise RuntimeError(
                f"parameter {self._param_names.get(p, '?')!r} received gradient number {passes} before step(), but "
                f"accumulation_steps is {self.accumulation_steps}: SPDKFACOptimizer averages gradients once per step, "
                f"after accumulation_steps backward passes (pass accumulation_steps=k to accumulate k of them)"
            )
        self._grad_counts[p] = passes
        self._backward_seen = True
        if passes < self.accumulation_steps:  # accumulating: autograd sums into p.grad, nothing to send yet
            return
        if self.backend.size > 1:
            self._start_grad_allreduce(p)
        if self.grad_scaler is not None and not self._sync_queued:
            # GradScaler reads the gradients between backward() and step(): average them before it does.
            torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
            self._sync_queued = True

    # ----------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Precondition the gradients and take one momentum-SGD step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_accumulated("step()")
        try:
            overlap = self._overlapping_preconditioning()
            factor_step = self._is_factor_step()
            if overlap:
                self._start_missing_grad_allreduces()  # every all-reduce in flight before waiting on any
                if factor_step:
                    # The inverses are kept this step, so the preconditioning does not need the new factors:
                    # it runs while their all-reduces are still in flight and the factors are taken after it.
                    self._submit_stashed_factors()
                self._precondition(wait_for_grads=True)
                self.synchronize()  # the parameters outside the preconditioned layers
                if factor_step:  # (after synchronize: a bad factor raises with no all-reduce left pending)
                    self._update_factors()
                    self.overlapped_factor_steps += 1
                self.overlapped_steps += 1
            else:
                self.synchronize()
                if factor_step:
                    self._update_factors()
                if self._is_inverse_step():
                    self._update_inverses()
                if self.precondition:
                    self._precondition()
            self._check_finite_update()
            self._sgd_update()
            self.steps += 1
            self.nonfinite.good_step()
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; after a skipped ``step()`` also discard that iteration's factors.

        A step is skipped when a GradScaler finds inf/NaN gradients (or the
        caller decides not to step after :meth:`synchronize`): the batch
        factors already sent are waited for, so collectives stay matched
        across workers, and dropped.

        Raises:
            RuntimeError: gradient all-reduces are still pending (``step()``
                or :meth:`synchronize` was not called after ``backward()``).
        """
        if self._grad_handles and not self._grads_synchronized:
            raise RuntimeError("zero_grad() called while gradient all-reduces are pending; call step() (or synchronize()) first")
        if self._backward_seen:  # that backward's step() was skipped (zero_grad between forward and backward is fine)
            self.controller.discard()
            self._begin_iteration()
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait until every gradient holds its average over the workers.

        ``step()`` does this itself. Call it between ``backward()`` and
        ``step()`` when the code in between reads the gradients, e.g.
        ``torch.nn.utils.clip_grad_norm_``; with ``grad_scaler`` it runs at
        the end of ``backward()`` automatically. Idempotent within a step.
        """
        if not self._grads_synchronized:
            self._check_accumulated("synchronize()")
        if self._grads_synchronized or self.backend.size == 1:
            self._grads_synchronized = True
            return
        self._start_missing_grad_allreduces()
        self._wait_grads(self._grad_handles)
        self._grads_synchronized = True

    def _check_accumulated(self, caller: str) -> None:
        """Raise unless accumulation_steps backward passes ran (checked before any collective: the same on every worker)."""
        passes = max(self._grad_counts.values(), default=self.accumulation_steps)  # no backward: other checks apply
        if passes != self.accumulation_steps:
            raise RuntimeError(
                f"{caller} after {passes} backward pass(es), but accumulation_steps is {self.accumulation_steps}: run "
                f"backward() exactly {self.accumulation_steps} times (each micro-batch loss divided by "
                f"{self.accumulation_steps}) before every step(); zero_grad() discards the partial accumulation"
            )

    def _start_missing_grad_allreduces(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self._grad_handles:
                    # Gradient set outside autograd's accumulation (or hook not fired): average it now.
                    self._start_grad_allreduce(p)

    def _wait_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Block until these parameters' gradient all-reduces are done (timed as non-overlapped GradComm)."""
        t0 = Timeline.now() if self._record is not None else 0.0
        for p in params:
            handle = self._grad_handles.get(p)
            if handle is not None:
                handle.wait()
        if self._record is not None:
            self._record.grad_wait += Timeline.now() - t0

    def _overlapping_preconditioning(self) -> bool:
        """Whether this step preconditions layers as their gradients arrive (see ``overlap_preconditioning``)."""
        if not (self.overlap_preconditioning and self.precondition and self.backend.size > 1):
            return False
        if self._grads_synchronized or self._is_inverse_step():
            return False
        if any(not layer.decomposed for layer in self.layers):
            return False  # the plain path raises the error
        return True

    def _submit_stashed_factors(self) -> None:
        """Without pipelining, send the factors the hooks kept back (D-KFAC: all at once after backward)."""
        for key, factor in self._stash:
            self.controller.submit(key, factor)
        self._stash = []

    def _update_factors(self) -> None:
        self._submit_stashed_factors()
        arrived = {kind: self.controller.arrival_order(kind) for kind in FACTOR_KINDS}
        factors = self.controller.wait_all()
        if not factors:
            raise RuntimeError(
                "step() was called on a factor-update step but no Kronecker factor was computed: run the "
                "forward and backward pass in training mode (model.train()) with gradients enabled before step()"
            )
        expected = {(kind, layer.name) for layer in self.layers for kind in FACTOR_KINDS}
        missing = sorted(expected - factors.keys())
        if missing:
            raise RuntimeError(f"no factor was computed for {missing} in this step; every preconditioned layer must run")
        bad = [key for key, mat in factors.items() if not all_finite(mat)]
        if bad:
            self.nonfinite.bad_step(NonFiniteFactorError(sorted(bad), self.steps))
        decay = self.param_groups[0]["factor_decay"]
        for (kind, name), mat in factors.items():
            self._layer_by_name[name].update_factor(kind, mat, decay)
        self._factor_steps_seen += 1
        if self._profiling:
            self._profile_and_plan(arrived)
        elif self._replan_due():
            self._planned = False  # sample the next profile_steps factor steps, keeping the current plan meanwhile
            self._profile_after = self._factor_steps_seen

    def _replan_due(self) -> bool:
        return (
            self.replan_interval is not None
            and self.fusion == "optimal"
            and self.pipelining
            and self._factor_steps_seen % self.replan_interval == 0
        )

    # ------------------------------------------------------------ fusion planning
    def _profile_and_plan(self, arrived: Dict[str, List[FactorKey]]) -> None:
        """Collect ready times; once enough are in, make the fusion plan from rank 0's profile."""
        if self._factor_steps_seen > self._profile_after:
            for kind in FACTOR_KINDS:
                self._profile[kind].append(list(self._ready[kind]))
        needed = self.profile_steps if self.fusion == "optimal" else 0
        if self._factor_steps_seen < self._profile_after + needed:
            return
        plans = {}
        for kind in FACTOR_KINDS:
            order = arrived[kind]
            if self.pipelining:
                samples = [s for s in self._profile[kind] if len(s) == len(order)]
                ready = [statistics.median(col) for col in zip(*samples)] if samples else [0.0] * len(order)
            else:
                ready = [0.0] * len(order)  # launched together after backward: no pipeline to exploit
            ready = self._agree_on_profile(kind, order, ready)
            ready = list(itertools.accumulate(ready, max))  # non-decreasing
            sizes = [triangle_size(self._layer_by_name[name].dim(k)) for k, name in order]
            groups = plan_groups(
                self.fusion,
                ready,
                sizes,
                self.perf_model.allreduce.alpha,
                self.perf_model.allreduce.beta,
                self.fusion_threshold_bytes,
                element_size=torch.finfo(self.layers[0].factor_dtype).bits // 8,
            )
            plans[kind] = [[order[i] for i in g] for g in groups]
        if self.fusion_plans_made and any(self.controller.plan(kind) != groups for kind, groups in plans.items()):
            self.fusion_plan_changes += 1
        for kind, groups in plans.items():
            self.controller.set_plan(kind, groups)
        self.fusion_plans_made += 1
        self._planned = True
        self._profile = {"A": [], "G": []}

    def _agree_on_profile(self, kind: str, order: List[FactorKey], ready: List[float]) -> List[float]:
        """Every rank adopts rank 0's ready times; the factor order must match everywhere."""
        if self.backend.size == 1:
            return ready
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        payload = torch.tensor([float(index[name]) for _, name in order] + ready, dtype=torch.float64,
                               device=self.layers[0].module.weight.device)  # NCCL broadcasts device tensors only
        self.backend.broadcast_async(payload, 0, f"spdkfac.profile.{kind}").wait()
        n = len(order)
        root_order = [int(v) for v in payload[:n].tolist()]
        if root_order != [index[name] for _, name in order]:
            raise RuntimeError(
                f"the {kind} factors were computed in a different order on rank {self.backend.rank} than on "
                "rank 0; all workers must run the same model graph"
            )
        return payload[n:].tolist()

    # -------------------------------------------------------------- inversions
    def _invert(self, layer: KFACLayer, kind: str, factor: torch.Tensor, damping: float) -> torch.Tensor:
        try:
            return invert_spd(factor, damping)
        except torch.linalg.LinAlgError as exc:
            # The factors were checked finite, so the damping lost to rounding: a factor of lower rank than its
            # dimension (fewer rows, samples x positions, than that) has only the damping on its null space, and
            # Cholesky's rounding error grows with the factor's scale. Say which, with a damping that would do.
            dim = factor.shape[0]
            scale = float(factor.diagonal().max())
            enough = dim * torch.finfo(factor.dtype).eps * scale
            raise torch.linalg.LinAlgError(
                f"factor {kind} of layer {layer.name!r} (dimension {dim}, largest diagonal entry {scale:.3g}) is not "
                f"positive definite even with damping {damping:g} at step {self.steps}. A factor of lower rank than "
                f"its dimension (from fewer rows, samples x positions, than that: a small batch) keeps only the "
                f"damping in its null space, and {factor.dtype} rounding at this scale is about {enough:.2g}: raise "
                f"damping well above that or the batch size; if training had been diverging, lower lr or kl_clip "
                f"instead. ({exc})"
            ) from exc

    def _eigen(self, layer: KFACLayer, kind: str, factor: torch.Tensor) -> torch.Tensor:
        try:
            return eigen_payload(factor)
        except torch.linalg.LinAlgError as exc:  # eigh did not converge (the factors were checked finite)
            raise torch.linalg.LinAlgError(
                f"the eigendecomposition of factor {kind} of layer {layer.name!r} (dimension {factor.shape[0]}) failed "
                f"at step {self.steps}; compute_method='inverse' does not need one. ({exc})"
            ) from exc

    def _update_inverses(self) -> None:
        """The decomposition stage: inverses or eigendecompositions, per ``compute_method``."""
        damping = self.param_groups[0]["damping"]
        # Packed: each factor is unpacked only where it is inverted.
        factors = {(kind, layer.name): layer.packed_factor(kind) for layer in self.layers for kind in FACTOR_KINDS}
        if self.compute_method == "eigen":
            eigens = compute_eigen(
                self.placement_plan,
                factors,
                self.backend,
                record=self._record,
                decompose=lambda key, matrix: self._eigen(self._layer_by_name[key[1]], key[0], matrix),
            )
            for (kind, name), eigen in eigens.items():
                self._layer_by_name[name].set_eigen(kind, eigen)
            return
        inverses = compute_inverses(
            self.placement_plan,
            factors,
            damping,
            self.backend,
            record=self._record,
            invert=lambda key, matrix: self._invert(self._layer_by_name[key[1]], key[0], matrix, damping),
        )
        for (kind, name), inverse in inverses.items():
            self._layer_by_name[name].set_inverse(kind, inverse)

    # ----------------------------------------------------------- preconditioning
    def _layer_grad(self, layer: KFACLayer, wait: bool) -> torch.Tensor:
        """The layer's averaged gradient matrix, first waiting for its all-reduces if ``wait``."""
        if wait:
            self._wait_grads([layer.module.weight, layer.module.bias] if layer.has_bias else [layer.module.weight])
        return cast(torch.Tensor, layer.grad_matrix())  # callers pass layers whose weight has a gradient

    def _precondition(self, wait_for_grads: bool = False) -> None:
        """Replace each layer's gradient by ``G_inv @ grad @ A_inv`` (KL-clipped).

        With ``wait_for_grads`` the gradient all-reduces are still running:
        layers are taken last first (the order their gradients were sent in)
        and each waits only for its own gradient.
        """
        group = self.param_groups[0]
        rec = self._record
        t0 = Timeline.now() if rec is not None else 0.0
        waited0 = rec.grad_wait if rec is not None else 0.0
        layers = [layer for layer in self.layers if layer.module.weight.grad is not None]
        if self.precondition_owner:
            grads, updates = self._precondition_distributed(layers, wait_for_grads)
        else:
            grads = [cast(torch.Tensor, None)] * len(layers)
            updates = [cast(torch.Tensor, None)] * len(layers)
            for i in reversed(range(len(layers))) if wait_for_grads else range(len(layers)):
                grads[i] = self._layer_grad(layers[i], wait_for_grads)
                updates[i] = layers[i].precondition(grads[i], group["damping"])
        scale = 1.0
        if group["kl_clip"] is not None:
            # The reference's KL clip: ν = min(1, sqrt(kl_clip / |Σ lr² v·grad|)) over every preconditioned layer.
            vg_sum = abs(sum(float((update * grad).sum()) for grad, update in zip(grads, updates)) * group["lr"] ** 2)
            if vg_sum > 0:
                scale = min(1.0, math.sqrt(group["kl_clip"] / vg_sum))
        for layer, update in zip(layers, updates):
            layer.write_grad(update.mul_(scale) if scale != 1.0 else update)
        if rec is not None:
            rec.precondition += Timeline.now() - t0 - (rec.grad_wait - waited0)

    def _precondition_distributed(
        self, layers: List[KFACLayer], wait_for_grads: bool
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Precondition this rank's layers, broadcast them fused, receive every other rank's.

        The broadcasts are issued in rank order on every rank (a receive
        before this rank's own work, so it completes while this rank
        computes). Returns every layer's averaged gradient and update.
        """
        missing = [layer.name for layer in layers if not layer.decomposed]
        if missing:  # checked on every rank before any broadcast, so no rank is left waiting
            raise RuntimeError(f"layers {missing} have no {self.compute_method} decompositions yet; factors were never updated")
        damping = self.param_groups[0]["damping"]
        owned: List[List[int]] = [[] for _ in range(self.backend.size)]
        for i, layer in enumerate(layers):
            owned[self.precondition_owner[layer.name]].append(i)
        grads: List[Optional[torch.Tensor]] = [None] * len(layers)
        pending: List[Tuple[Handle, torch.Tensor, List[int]]] = []
        for rank, indices in enumerate(owned):
            if not indices:
                continue
            dtype = layers[indices[0]].update_dtype
            for i in indices[1:]:
                dtype = torch.promote_types(dtype, layers[i].update_dtype)
            if rank == self.backend.rank:
                results: Dict[int, torch.Tensor] = {}
                for i in reversed(indices) if wait_for_grads else indices:
                    grads[i] = grad = self._layer_grad(layers[i], wait_for_grads)
                    results[i] = layers[i].precondition(grad, damping).reshape(-1).to(dtype)
                buffer = torch.cat([results[i] for i in indices])
            else:
                numel = sum(layers[i].g_dim * layers[i].a_dim for i in indices)
                buffer = torch.empty(numel, dtype=dtype, device=layers[indices[0]].module.weight.device)
            pending.append((self.backend.broadcast_async(buffer, rank, f"spdkfac.precondition.{rank}"), buffer, indices))
        t0 = Timeline.now()
        updates: List[Optional[torch.Tensor]] = [None] * len(layers)
        for handle, buffer, indices in pending:
            handle.wait()
            offset = 0
            for i in indices:
                shape = (layers[i].g_dim, layers[i].a_dim)
                updates[i] = buffer[offset : offset + shape[0] * shape[1]].view(shape)
                offset += shape[0] * shape[1]
        if self._record is not None:
            self._record.precondition_wait += Timeline.now() - t0
        for i, layer in enumerate(layers):
            if grads[i] is None:  # another rank's layer: its gradient is still needed for the KL clip
                grads[i] = self._layer_grad(layer, wait_for_grads)
        # every index belongs to exactly one rank's buffer and every gradient is now read
        return cast(List[torch.Tensor], grads), cast(List[torch.Tensor], updates)

    def _check_finite_update(self) -> None:
        """Skip (or refuse) a step whose averaged or preconditioned gradients hold NaN/Inf: never NaN parameters."""
        bad = non_finite((self._param_names.get(p, "?"), p.grad) for group in self.param_groups for p in group["params"])
        if not bad:
            return
        inverses = [f"{kind} of {layer.name!r}" for layer in self.layers for kind in ("A_inv", "G_inv")
                    if getattr(layer, kind) is not None and not all_finite(getattr(layer, kind))]
        cause = f"; the inverses {inverses} are non-finite (a damaged checkpoint?)" if inverses else ""
        self.nonfinite.bad_step(NonFiniteError(
            f"non-finite gradient(s) at step {self.steps} for {bad[:8]}{' ...' if len(bad) > 8 else ''}{cause}. "
            "No parameter was changed. Check the inputs/loss of that step (or lower the learning rate)."))

    def _sgd_update(self) -> None:
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if wd != 0:
                    d_p = d_p.add(p, alpha=wd)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d_p.detach().clone()
                    else:
                        buf.mul_(momentum).add_(d_p)
                    d_p = buf
                p.add_(d_p, alpha=-lr)

    # --------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """Optimizer state plus K-FAC state (step counter, method, factors, decompositions, update frequencies).

        The damping and KL clip in force are in ``param_groups``. Callable
        schedules cannot be saved: pass the same ones to the constructor of the
        optimizer that loads this (they are pure functions of the step counter).
        Save between steps (not between the backward passes of an accumulation).
        """
        sd = super().state_dict()
        sd["kfac"] = {
            "steps": self.steps,
            "update_freqs": [self.factor_update_freq, self.inv_update_freq],
            "compute_method": self.compute_method,
            "layers": {
                layer.name: {
                    "dims": [layer.a_dim, layer.g_dim],
                    "A": layer.A,
                    "G": layer.G,
                    "A_inv": layer.A_inv,
                    "G_inv": layer.G_inv,
                    **{f"{kind}_eigen": None if e is None else {"Q": e.Q, "d": e.d}
                       for kind, e in (("A", layer.A_eigen), ("G", layer.G_eigen))},
                }
                for layer in self.layers
            },
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` for the same model."""
        if not isinstance(state_dict, dict) or "kfac" not in state_dict:
            raise ValueError("not an SPDKFACOptimizer checkpoint: the 'kfac' entry is missing")
        kfac = state_dict["kfac"]
        method = kfac.get("compute_method", "inverse")  # checkpoints from before the eigen method hold inverses
        if method != self.compute_method:
            raise ValueError(
                f"checkpoint was saved with compute_method={method!r} but this optimizer uses "
                f"compute_method={self.compute_method!r}: its {'inverses' if method == 'inverse' else 'eigendecompositions'} "
                f"cannot precondition here; construct the optimizer with compute_method={method!r} to resume it"
            )
        saved = kfac.get("layers", {})
        mine = {layer.name: [layer.a_dim, layer.g_dim] for layer in self.layers}
        theirs = {name: list(entry.get("dims", [])) for name, entry in saved.items()}
        if mine != theirs:
            only_mine = sorted(set(mine) - set(theirs))
            only_theirs = sorted(set(theirs) - set(mine))
            differ = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
            raise ValueError(
                "checkpoint was saved for a different model: "
                f"layers missing from checkpoint {only_mine}, unknown layers in checkpoint {only_theirs}, "
                f"layers with different factor dimensions {differ}"
            )
        rest = {k: v for k, v in state_dict.items() if k != "kfac"}
        super().load_state_dict(rest)
        for layer in self.layers:
            entry = saved[layer.name]
            device = layer.module.weight.device
            for attr in ("A", "G", "A_inv", "G_inv"):
                value = entry.get(attr)
                setattr(layer, attr, value.detach().clone().to(device) if value is not None else None)
            for kind in FACTOR_KINDS:
                eig = entry.get(f"{kind}_eigen")
                if eig is not None:  # one fresh [Q, d] buffer: the layout the decomposition stage leaves
                    buffer = torch.cat([eig["Q"].reshape(-1), eig["d"]]).detach().to(device)
                    layer.set_eigen(kind, unpack_eigen(buffer, layer.dim(kind)))
        self.steps = int(kfac["steps"])
        if "update_freqs" in kfac:  # (absent from checkpoints made before schedules existed)
            self.factor_update_freq, self.inv_update_freq = (int(f) for f in kfac["update_freqs"])
        self._begin_iteration()

    # ------------------------------------------------------------ reporting
    def memory_usage(self) -> Dict[str, int]:
        """Bytes held by factors (packed running averages) and inverses (or eigendecompositions), per kind."""
        held = ("A_inv", "G_inv") if self.compute_method == "inverse" else ("A_eigen", "G_eigen")
        out = dict.fromkeys(FACTOR_KINDS + held, 0)
        for layer in self.layers:
            for attr in out:
                value = layer.packed_factor(attr) if attr in FACTOR_KINDS else getattr(layer, attr)
                for t in (value.Q, value.d) if isinstance(value, Eigen) else (value,):
                    if t is not None:
                        out[attr] += t.numel() * t.element_size()
        return out

    def fusion_plan(self) -> Dict[str, Optional[List[List[FactorKey]]]]:
        """Current fusion groups per pass (None while profiling, or for ``'layerwise'``)."""
        return {kind: self.controller.plan(kind) for kind in FACTOR_KINDS}

    def remove_hooks(self) -> None:
        """Detach every hook from the model (the optimizer is unusable afterwards)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def __repr__(self) -> str:
        g = self.param_groups[0]
        return (
            f"SPDKFACOptimizer(layers={len(self.layers)}, lr={g['lr']}, momentum={g['momentum']}, "
            f"weight_decay={g['weight_decay']}, damping={g['damping']}, factor_decay={g['factor_decay']}, "
            f"kl_clip={g['kl_clip']}, factor_update_freq={self.factor_update_freq}, "
            f"inv_update_freq={self.inv_update_freq}, accumulation_steps={self.accumulation_steps}, "
            f"backend={self.backend.name}(rank {self.backend.rank}/"
            f"{self.backend.size}), fusion={self.fusion!r}, pipelining={self.pipelining}, "
            f"placement={self.placement_strategy!r}, compute_method={self.compute_method!r}, distribute_preconditioning={self.distribute_preconditioning}, perf_model={self.perf_model.source!r})"
        )
