"""KFACPreconditioner: K-FAC for any torch optimizer, in KAISA's usage and with KAISA's option names.

``step()`` averages every gradient across the workers and replaces each
preconditioned layer's by its K-FAC preconditioned, KL-clipped gradient in
place; the user's own optimizer (SGD, AdamW, LAMB, anything) then steps on
them. It is :class:`~spdkfac.SPDKFACOptimizer`'s machinery without the base
update (:meth:`SPDKFACOptimizer.run_step <spdkfac.SPDKFACOptimizer.run_step>`
with ``base_update=False``): the same engines, pipelining, placement, compute
methods, gradient workers, non-finite handling and checkpoints. This class
only turns KAISA's keyword arguments into that optimizer's and feeds it the
learning rate the KL clip needs. See ``docs/preconditioner.md``.
"""

from __future__ import annotations

import enum
import logging
import re
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from .comm import CommBackend
from .config import EigenOptions, EigenRefresh, EKFACOptions, EKFACUpdate, FusionPolicy, Placement, check_number
from .kfac.layers import FactorKey, KFACLayer, LayerFilter
from .optimizer import SPDKFACOptimizer
from .perfmodels import PerfModel
from .plan.factor_fusion import DEFAULT_THRESHOLD_BYTES
from .schedules import Scheduled
from .step.adaptive_damping import AdaptiveDamping
from .step.data_parallel import bare_model
from .update.added_groups import average_gradients_now, not_in_model
from .update.your_optimizer import OptimizerAttachment, check_attachable, refuse_averaging_optimizer, unwatch, watch

__all__ = ["KAISA_STRATEGIES", "KFACPreconditioner", "kaisa_grad_workers", "kaisa_skip_layers"]

#: KAISA's ``DistributedStrategy`` names for ``grad_worker_fraction`` -> this project's (fraction, distribute_preconditioning).
KAISA_STRATEGIES: dict[str, tuple[float | None, bool]] = {
    "comm_opt": (None, False),  # every worker a gradient worker (fraction 1)
    "hybrid_opt": (0.5, False),
    "mem_opt": (None, True),  # fraction 1/P
}

#: Options of this project's optimizer that this class takes under KAISA's name.
_RENAMED = {"factor_update_freq": "factor_update_steps", "inv_update_freq": "inv_update_steps", "pipelining": "update_factors_in_hook"}

_YOUR_OPTIMIZER = (
    "it belongs to the update, which your own optimizer makes: pass it to that optimizer "
    "(or use SPDKFACOptimizer(model, base=..., ...), which preconditions and updates in one)"
)

#: Options (KAISA's, or the optimizer's own) this class refuses, with what to use instead.
_REFUSED: dict[str, str] = {
    "distribute_preconditioning": "KAISA's MEM-OPT is grad_worker_fraction='mem_opt' (or 0): one gradient worker per layer",
    "precondition": "precondition=False is plain gradient averaging: use SPDKFACOptimizer(model, precondition=False) or DDP",
    **dict.fromkeys(("momentum", "weight_decay", "betas", "eps", "base"), _YOUR_OPTIMIZER),
    "update_fusion": "the parameter update is your optimizer's; update fusion needs SPDKFACOptimizer(model, update_fusion=...)",
}


#: KAISA's ``AssignmentStrategy`` names: how its placement estimated a decomposition's cost (here: ``placement``).
KAISA_ASSIGNMENT_STRATEGIES = ("compute", "memory")
#: The loggers' name (KAISA's ``loglevel`` is the level of the summary logged at construction).
LOGGER = logging.getLogger("spdkfac")


def _choice_name(value: Any) -> Any:
    """A KAISA enum member (``ComputeMethod.EIGEN``) or a string in any case, as this project's lower-case name."""
    if isinstance(value, enum.Enum):
        return value.name.lower()
    return value.lower() if isinstance(value, str) else value


def kaisa_grad_workers(value: Any) -> tuple[float | str | None, bool]:
    """KAISA's ``grad_worker_fraction`` (a number, 0 for ``1/P``, or a ``DistributedStrategy``) as this project's
    ``(grad_worker_fraction, distribute_preconditioning)``."""
    name = _choice_name(value)
    if isinstance(name, str) and name in KAISA_STRATEGIES:
        return KAISA_STRATEGIES[name]
    if isinstance(name, str):
        if name != "auto":
            raise ValueError(f"grad_worker_fraction must be a number in [0, 1], 'auto' or one of {tuple(KAISA_STRATEGIES)}, got {value!r}")
        return "auto", False
    if value is None:
        return None, False
    if check_number("grad_worker_fraction", value, 0.0, 1.0, high_open=False) == 0:  # KAISA: 0 means 1/P
        return None, True
    return value, False


def kaisa_fusion(bucket_cap_mb: Any, fusion: FusionPolicy | str, threshold_bytes: int) -> tuple[FusionPolicy | str, int]:
    """KAISA's ``allreduce_bucket_cap_mb`` (fixed buckets of the factor all-reduces; 0: none) as this project's
    ``(fusion, fusion_threshold_bytes)``; None (not given) keeps ``fusion``. With a ``fusion`` other than the
    default it is refused: the two say how to fuse in two ways."""
    if bucket_cap_mb is None:
        return fusion, threshold_bytes
    mb = check_number("allreduce_bucket_cap_mb", bucket_cap_mb, 0.0)
    if fusion != FusionPolicy.OPTIMAL:  # (a str enum: the string 'optimal' too)
        raise ValueError(f"give allreduce_bucket_cap_mb (KAISA's fixed buckets) or fusion={fusion!r}, not both")
    if mb == 0:
        return FusionPolicy.LAYERWISE, threshold_bytes
    warnings.warn(
        f"allreduce_bucket_cap_mb={bucket_cap_mb}: the factor all-reduces go in KAISA's fixed {bucket_cap_mb} MB buckets "
        "(fusion='threshold'); leave it out for the default 'optimal' plan, made from the layers' measured times "
        "(docs/fusion.md)",
        stacklevel=3,
    )
    return FusionPolicy.THRESHOLD, max(1, int(mb * 2**20))


def kaisa_placement_hints(colocate_factors: Any, assignment_strategy: Any, compute_eigenvalue_outer_product: Any) -> list[str]:
    """Check KAISA's options for what ``placement`` and the eigen method decide here; the lines that say so."""
    if not isinstance(colocate_factors, bool) or not isinstance(compute_eigenvalue_outer_product, bool):
        raise TypeError("colocate_factors and compute_eigenvalue_outer_product must be bools")
    strategy = _choice_name(assignment_strategy)
    if strategy not in KAISA_ASSIGNMENT_STRATEGIES:
        raise ValueError(
            f"assignment_strategy must be one of {KAISA_ASSIGNMENT_STRATEGIES} (or KAISA's member), got {assignment_strategy!r}"
        )
    return [
        f"colocate_factors={colocate_factors} and assignment_strategy={strategy!r} are taken for KAISA scripts: placement "
        "decides which worker decomposes each factor, from the performance model's measured costs (docs/placement.md)",
        f"compute_eigenvalue_outer_product={compute_eigenvalue_outer_product} is taken for KAISA scripts: the eigen method "
        "damps the eigenvalue products with the damping of the step it preconditions",
    ]


def kaisa_skip_layers(model: nn.Module, patterns: Sequence[LayerFilter] | None) -> tuple[LayerFilter, ...]:
    """KAISA's ``skip_layers`` as this project's: each string a regular expression searched in every module's name
    and class name (KAISA's rule), replaced by the names of the modules it finds; ``'kind:...'`` entries and classes
    are kept. A pattern that finds no module raises ValueError naming it."""
    out: list[LayerFilter] = []
    for pattern in patterns or ():
        if not isinstance(pattern, str) or pattern.startswith("kind:"):
            out.append(pattern)
            continue
        regex = re.compile(pattern)
        found = [name for name, module in model.named_modules() if name and (regex.search(name) or regex.search(type(module).__name__))]
        if not found:
            raise ValueError(f"skip_layers pattern {pattern!r} (a regular expression, as KAISA's) finds no module's name or class name")
        out.extend(name for name in found if name not in out)
    return tuple(out)


class KFACPreconditioner:
    """Preconditions the gradients in place for any torch optimizer (KAISA's ``KFACPreconditioner``).

    Usage::

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # or AdamW, LAMB, any
        preconditioner = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
        loss.backward(); preconditioner.step(); optimizer.step(); optimizer.zero_grad()

    or, for a training loop that calls only ``optimizer.step()`` and saves
    only ``optimizer.state_dict()`` (Lightning, Hugging Face's ``Trainer``)::

        KFACPreconditioner(model, optimizer=optimizer)   # preconditions inside optimizer.step()

    After :meth:`step` every gradient holds its average over the workers (the
    loss must be a mean over the local batch; do not also average them) and
    each preconditioned layer's its K-FAC preconditioned, KL-clipped
    gradient. With ``torch.optim.SGD`` this is exactly
    ``SPDKFACOptimizer(base='sgd')``, and with ``torch.optim.AdamW`` its
    ``base='adamw'``. A step skipped over NaN/Inf (``skip_nonfinite``) sets
    every gradient to None, so a torch optimizer's next ``step()`` changes
    nothing.

    Args (KAISA's names and meanings; defaults KAISA's):
        model: the model; its layers are chosen as by ``SPDKFACOptimizer``.
        factor_update_steps, inv_update_steps: update the factors (the
            decompositions) at the steps where ``steps % n == 0`` and at the
            first; ``inv_update_steps`` a multiple of ``factor_update_steps``;
            a number or ``f(step) -> int``.
        damping: Tikhonov damping, a number or ``f(step) -> float``.
        factor_decay: running-average weight of the old factor (a number).
        kl_clip: KL-clip bound (None: no clip), a number or ``f(step)``.
        lr: the learning rate the KL clip assumes (give your optimizer's),
            a number or ``f(step) -> float``; by default the attached
            ``optimizer``'s (its first parameter group's, read at each step),
            else KAISA's 0.1.
        optimizer: your ``torch.optim.Optimizer``, to attach the
            preconditioner to (not a KAISA option): its ``step()`` then
            preconditions first (after the closure's backward pass, if it is
            given one), so :meth:`step` is not called by you; its
            ``state_dict()`` holds the K-FAC state and its
            ``load_state_dict()`` restores it; a step its ``GradScaler``
            skips drops that batch's factors. :mod:`spdkfac.update.your_optimizer`.
        accumulation_steps: backward passes per ``step()``.
        compute_method: ``'eigen'`` (KAISA's default), ``'inverse'`` or
            ``'ekfac'``; KAISA's ``ComputeMethod`` members are taken too.
        grad_worker_fraction: KAISA's fraction of gradient workers per layer:
            a number in [0, 1] (0: ``1/P``), ``'auto'``, or KAISA's
            ``DistributedStrategy`` (``COMM_OPT``, ``HYBRID_OPT``,
            ``MEM_OPT``) or its name.
        skip_layers: the modules left out of K-FAC: regular expressions
            searched in each module's name and class name (KAISA's rule;
            :func:`kaisa_skip_layers`), classes, or ``'kind:depthwise'`` /
            ``'kind:grouped'`` (``docs/layers.md``).
        update_factors_in_hook: ``pipelining``: all-reduce each factor from
            its hook (True) or all after the backward pass.
        symmetry_aware: taken for KAISA scripts; symmetric factors always
            travel as upper triangles here.
        allreduce_bucket_cap_mb: KAISA's fixed buckets for the factor
            all-reduces (MB; 0: none): ``fusion='threshold'`` with that size
            (``'layerwise'`` for 0), with a warning that the default
            ``'optimal'`` plan is left; None (the default here): ``fusion``.
        colocate_factors, assignment_strategy, compute_eigenvalue_outer_product:
            taken for KAISA scripts, checked, without effect: ``placement``
            and the eigen method decide (logged at ``loglevel``).
        factor_dtype, inv_dtype: None (KAISA's default); a dtype is refused
            (factors in the weights' dtype, at least float32).
        loglevel: the ``logging`` level at which the construction logs
            :meth:`kfac_summary` to the ``'spdkfac'`` logger (KAISA's: DEBUG).
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 loop; call
            ``scaler.unscale_(optimizer)`` before :meth:`step`, and allow
            overflowing steps with ``skip_nonfinite`` (``docs/preconditioner.md``).
        backend, fusion, placement, eigen_refresh, eigen_full_every, ekfac_decay, ekfac_update, eigen, ekfac, memory_budget,
        overlap_preconditioning, perf_model, fusion_threshold_bytes, profile_steps, replan_interval, timeline,
        skip_nonfinite, max_factor_dim: as :class:`~spdkfac.SPDKFACOptimizer`.

    Raises:
        ValueError: an option KAISA has but this project does not (or one of
            the update's), naming what to use instead; TypeError: an unknown
            option.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Scheduled[int] = 1,
        inv_update_steps: Scheduled[int] = 1,
        damping: Scheduled[float] = 0.001,
        factor_decay: float = 0.95,
        kl_clip: Scheduled[float | None] = 0.001,
        lr: Scheduled[float] | None = None,
        accumulation_steps: int = 1,
        compute_method: Any = "eigen",
        grad_worker_fraction: Any = None,
        skip_layers: Sequence[LayerFilter] | None = None,
        update_factors_in_hook: bool = True,
        symmetry_aware: bool = False,
        grad_scaler: Any | None = None,
        backend: str | CommBackend = "auto",
        fusion: FusionPolicy | str = FusionPolicy.OPTIMAL,
        placement: Placement | str = Placement.LBP,
        eigen_refresh: EigenRefresh | str = EigenRefresh.EXACT,
        eigen_full_every: int = 10,
        ekfac_decay: float = 0.95,
        ekfac_update: EKFACUpdate | str = EKFACUpdate.NATURAL,
        eigen: EigenOptions | None = None,
        ekfac: EKFACOptions | None = None,
        memory_budget: int | None = None,
        overlap_preconditioning: bool = True,
        perf_model: str | PerfModel | None = None,
        fusion_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        profile_steps: int = 3,
        replan_interval: int | None = None,
        timeline: bool = False,
        skip_nonfinite: int = 0,
        max_factor_dim: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        allreduce_bucket_cap_mb: float | None = None,
        colocate_factors: bool = True,
        assignment_strategy: Any = "compute",
        compute_eigenvalue_outer_product: bool = True,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loglevel: int = logging.DEBUG,
        **unsupported: Any,
    ) -> None:
        for name, dtype in (("factor_dtype", factor_dtype), ("inv_dtype", inv_dtype)):
            if dtype is not None:
                raise ValueError(
                    f"KFACPreconditioner has no option {name!r} other than None: the factors are kept in the weights' dtype "
                    "(at least float32) and the decompositions in the factors'; remove the option"
                )
        hints = kaisa_placement_hints(colocate_factors, assignment_strategy, compute_eigenvalue_outer_product)
        fusion, fusion_threshold_bytes = kaisa_fusion(allreduce_bucket_cap_mb, fusion, fusion_threshold_bytes)
        for name in unsupported:
            if name in _RENAMED:
                raise ValueError(f"KFACPreconditioner takes {name} under KAISA's name: {_RENAMED[name]}=...")
            if name in _REFUSED:
                raise ValueError(f"KFACPreconditioner has no option {name!r}: {_REFUSED[name]}")
            raise TypeError(f"KFACPreconditioner() got an unexpected keyword argument {name!r} (docs/preconditioner.md lists the options)")
        if isinstance(damping, (str, AdaptiveDamping)):
            raise ValueError(
                "KFACPreconditioner takes a number or a function of the step for damping: damping='adaptive' needs the "
                "update inside the optimizer, SPDKFACOptimizer(model, damping='adaptive', base=...).step(closure)"
            )
        if callable(factor_decay):
            raise ValueError("factor_decay must be a number: a scheduled factor_decay is not supported (damping and kl_clip may be)")
        if not isinstance(update_factors_in_hook, bool) or not isinstance(symmetry_aware, bool):
            raise TypeError("update_factors_in_hook and symmetry_aware must be bools")
        if grad_scaler is not None and callable(grad_scaler) and not hasattr(grad_scaler, "get_scale"):
            raise ValueError("grad_scaler must be a torch.amp.GradScaler (a callable returning the scale is not supported)")
        if EKFACUpdate.ADAM in (ekfac_update, None if ekfac is None else ekfac.update):
            raise ValueError(
                "ekfac_update='adam' makes the step's direction, not a gradient for another optimizer; "
                "use SPDKFACOptimizer(model, compute_method='ekfac', ekfac_update='adam', base='adamw')"
            )
        if isinstance(optimizer, SPDKFACOptimizer):
            raise TypeError(
                "optimizer= is your own torch optimizer for KFACPreconditioner to precondition for; an SPDKFACOptimizer "
                "preconditions its gradients itself (it would be preconditioned twice): use it alone"
            )
        if optimizer is not None:
            check_attachable(optimizer)
        fraction, distribute = kaisa_grad_workers(grad_worker_fraction)
        self._lr = lr
        self._optimizer = optimizer
        self._factors_note_said = False  # state_dict(include_factors=False) said once that the factors are kept
        self.kfac = SPDKFACOptimizer(
            model,
            lr=self._lr_at(0),
            momentum=0.0,  # no base update runs: the gradients are the user's optimizer's to step on
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            factor_update_freq=factor_update_steps,
            inv_update_freq=inv_update_steps,
            backend=backend,
            fusion=fusion,
            pipelining=update_factors_in_hook,
            placement=placement,
            compute_method=_choice_name(compute_method),
            eigen_refresh=eigen_refresh,
            eigen_full_every=eigen_full_every,
            ekfac_decay=ekfac_decay,
            ekfac_update=ekfac_update,
            eigen=eigen,
            ekfac=ekfac,
            distribute_preconditioning=distribute,
            grad_worker_fraction=fraction,  # type: ignore[arg-type]  # checked by KFACConfig
            memory_budget=memory_budget,
            overlap_preconditioning=overlap_preconditioning,
            perf_model=perf_model,
            fusion_threshold_bytes=fusion_threshold_bytes,
            profile_steps=profile_steps,
            replan_interval=replan_interval,
            timeline=timeline,
            grad_scaler=grad_scaler,
            accumulation_steps=accumulation_steps,
            skip_nonfinite=skip_nonfinite,
            max_factor_dim=max_factor_dim,
            skip_layers=kaisa_skip_layers(bare_model(model), skip_layers),
        )
        self._attachment = None if optimizer is None else OptimizerAttachment(optimizer, self)
        if self._attachment is not None:
            self.kfac._scaler_skipped = self._scaler_skipped
            if lr is None:  # the KL clip's rates are your optimizer's, each layer its group's (layer-wise rates)
                self.kfac._lr_groups = self._attached_groups
        #: The groups of your optimizer (attached; unattached on several workers, of each one seen stepping) when last
        #: looked at for parameters outside the model (:meth:`_groups_changed`).
        self._groups_seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()
        if self._attachment is None and self.kfac.backend.size > 1:
            watch(self)
        outside = self._outside_model()
        if outside:
            self.kfac.add_param_group({"params": outside})  # (averaged from the first step)
        if LOGGER.isEnabledFor(loglevel):
            for line in [repr(self), self.kfac_summary(), *hints]:
                LOGGER.log(loglevel, line)

    def _attached_groups(self) -> list[dict[str, Any]]:
        assert self._optimizer is not None  # (read only when attached)
        return self._optimizer.param_groups

    def _lr_at(self, step: int) -> float:
        if self._lr is None:  # the attached optimizer's, as it is now (its scheduler's value), else KAISA's default
            lr: Any = 0.1 if self._optimizer is None else self._optimizer.param_groups[0]["lr"]
            lr = float(lr) if isinstance(lr, torch.Tensor) else lr
            suffix = f" (the lr of {type(self._optimizer).__name__}'s first parameter group)" if self._optimizer is not None else ""
        else:
            lr = self._lr(step) if callable(self._lr) else self._lr
            suffix = f" (the lr schedule's value at step {step})" if callable(self._lr) else ""
        try:
            return check_number("lr", lr, 0.0)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc}{suffix}") from None

    def step(self) -> None:
        """Average every gradient and precondition the K-FAC layers' in place; call between ``backward()`` and your
        optimizer's ``step()`` (attached to it, ``optimizer=``, its ``step()`` calls this)."""
        if self._attachment is not None and not self._attachment.in_step:
            raise RuntimeError(
                f"this preconditioner is attached to your {type(self._optimizer).__name__} (optimizer=...), whose step() "
                "preconditions first; calling step() yourself as well would precondition the gradients twice: remove the call"
            )
        self._step_from_optimizer()

    def _outside_model(self) -> list[torch.Tensor]:
        """The attached optimizer's parameters outside the model that are not averaged yet (a loss's own weights,
        a second head), when its groups changed since last asked."""
        if self._optimizer is None or not self._groups_changed(self._optimizer):
            return []
        self._groups_seen[self._optimizer] = self._signature(self._optimizer)
        return self._not_averaged(self._optimizer)

    @staticmethod
    def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """How many groups and parameters ``optimizer`` holds: changed by ``add_param_group()``."""
        return len(optimizer.param_groups), sum(len(group["params"]) for group in optimizer.param_groups)

    def _groups_changed(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._groups_seen.get(optimizer) != self._signature(optimizer)

    def _not_averaged(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """``optimizer``'s parameters outside the model that this preconditioner does not average yet."""
        averaged = {id(p) for group in self.kfac.param_groups for p in group["params"]}
        return [p for p in not_in_model(self.kfac.model, optimizer.param_groups) if id(p) not in averaged]  # (frozen too: may thaw)

    @torch.no_grad()
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """(Unattached, on several workers.) Before any optimizer's ``step()``: one that trains this model hands over
        its parameters outside the model (a loss's own weights), their gradients averaged now (every worker steps it
        at the same point) and from the backward pass on; KAISA's usage gave no way to know them."""
        if optimizer is self.kfac or self.kfac._taken_over or not self._groups_changed(optimizer):
            return
        if self.kfac._kind is not None or self.kfac.kfac_step.backward_seen:  # (preconditioner.step() not called)
            return
        own = {id(p) for p in self.kfac.model.parameters()}
        trains_model = any(id(p) in own for group in optimizer.param_groups for p in group["params"])  # (else another's)
        if trains_model:
            refuse_averaging_optimizer(optimizer)  # (before it is marked as seen: refused at every step)
        self._groups_seen[optimizer] = self._signature(optimizer)
        if not trains_model:
            return
        added = self._not_averaged(optimizer)
        if added:
            average_gradients_now(self.kfac.backend, added, "spdkfac.added_grad")
            self.kfac.add_param_group({"params": added})  # (averaged in the backward pass from the next step on)

    @torch.no_grad()
    def _step_from_optimizer(self) -> None:
        self.kfac.param_groups[0]["lr"] = self._lr_at(self.kfac.steps)  # the KL clip's learning rate this step
        added = self._outside_model()  # (a group added to the attached optimizer since the last step)
        stepped = self.kfac.run_step(base_update=False)
        if stepped:
            average_gradients_now(self.kfac.backend, added, "spdkfac.added_grad")
        else:  # skipped over NaN/Inf: the user's optimizer must not step
            for p in [p for group in self.kfac.param_groups for p in group["params"]] + added:
                p.grad = None
        if added:
            self.kfac.add_param_group({"params": added})  # (averaged in the backward pass from the next step on)

    def reset_batch(self) -> None:
        """Drop the factors and gradient state of backward passes whose ``step()`` is skipped (e.g. by a GradScaler's
        inf check); the gradients themselves are your optimizer's ``zero_grad()``'s to clear."""
        self.kfac._drop_batch()

    def _scaler_skipped(self) -> bool:
        """Whether the attached optimizer's ``GradScaler`` skipped the step of the backward passes before: it lowered
        its scale since (its ``step()`` then never called the optimizer's)."""
        scaler, scale = self.kfac.grad_scaler, self.kfac._scale
        return scaler is not None and scale is not None and float(scaler.get_scale()) < scale

    def synchronize(self) -> None:
        """Wait until every gradient holds its average (before reading them ahead of :meth:`step`)."""
        self.kfac.synchronize()

    def finite_everywhere(self, value: torch.Tensor) -> bool:
        """True when ``value`` (e.g. the loss) is finite on every worker; if not, this step's factors are dropped."""
        return self.kfac.finite_everywhere(value)

    @property
    def steps(self) -> int:
        """The number of completed (not skipped) steps."""
        return self.kfac.steps

    @property
    def layers(self) -> list[KFACLayer]:
        """The preconditioned layers."""
        return self.kfac.layers

    # ------------------------------------------- hyperparameters (KAISA's properties)
    def _in_force(self) -> dict[str, Any]:
        """Damping, KL clip and update frequencies for the next step (schedules evaluated at :attr:`steps`; the step
        checks them)."""
        kfac, group = self.kfac, self.kfac.param_groups[0]
        current = dict(damping=group["damping"], kl_clip=group["kl_clip"], factor_update_freq=kfac.factor_update_freq)
        return kfac.schedule.values_at(self.steps, dict(current, inv_update_freq=kfac.inv_update_freq))

    def is_scheduled(self, name: str) -> bool:
        """Whether the hyperparameter ``name`` (KAISA's: ``damping``, ``kl_clip``, ``lr``, ``factor_update_steps``,
        ``inv_update_steps``, ``factor_decay``) was given as a function of the step (``lr``: or follows the attached
        optimizer's learning rates, none being given)."""
        if name == "lr":
            return callable(self._lr) or (self._lr is None and self._optimizer is not None)
        option = {"factor_update_steps": "factor_update_freq", "inv_update_steps": "inv_update_freq"}.get(name, name)
        return self.kfac.schedule.is_scheduled(option)

    def _set(self, name: str, option: str, value: Any) -> None:
        """Write a hyperparameter given as a number (every parameter group alike); refused where it is scheduled."""
        if self.is_scheduled(name):
            how = (
                "follows the attached optimizer's learning rates"
                if name == "lr" and self._lr is None
                else "was given as a function of the step"
            )
            raise ValueError(f"{name} {how}: it cannot also be set")
        if name == "lr":
            self._lr = check_number("lr", value, 0.0)
        elif option in ("factor_update_freq", "inv_update_freq"):
            setattr(self.kfac, option, int(value))
        else:
            for group in self.kfac.param_groups:
                group[option] = value

    @property
    def damping(self) -> float:
        """The damping of the next step; settable where it was given as a number."""
        return float(self._in_force()["damping"])

    @damping.setter
    def damping(self, value: float) -> None:
        self._set("damping", "damping", value)

    @property
    def kl_clip(self) -> float | None:
        """The KL-clip bound of the next step (None: no clip); settable where it was given as a number."""
        value = self._in_force()["kl_clip"]
        return None if value is None else float(value)

    @kl_clip.setter
    def kl_clip(self, value: float | None) -> None:
        self._set("kl_clip", "kl_clip", value)

    @property
    def factor_decay(self) -> float:
        """The running-average weight of the old factor; settable."""
        return float(self.kfac.param_groups[0]["factor_decay"])

    @factor_decay.setter
    def factor_decay(self, value: float) -> None:
        self._set("factor_decay", "factor_decay", check_number("factor_decay", value, 0.0, 1.0, high_open=False))

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, for the next step; settable where it was given as a number."""
        return int(self._in_force()["factor_update_freq"])

    @factor_update_steps.setter
    def factor_update_steps(self, value: int) -> None:
        self._set("factor_update_steps", "factor_update_freq", value)

    @property
    def inv_update_steps(self) -> int:
        """Steps between decomposition updates, for the next step; settable where it was given as a number."""
        return int(self._in_force()["inv_update_freq"])

    @inv_update_steps.setter
    def inv_update_steps(self, value: int) -> None:
        self._set("inv_update_steps", "inv_update_freq", value)

    @property
    def lr(self) -> float:
        """The learning rate the KL clip assumes at the next step; settable where it was given as a number (or not given)."""
        return self._lr_at(self.steps)

    @lr.setter
    def lr(self, value: float) -> None:
        self._set("lr", "lr", value)

    # --------------------------------------------------------------- state
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The K-FAC state (step counter, factors, decompositions, update frequencies), as ``SPDKFACOptimizer``'s.

        Your optimizer's state is its own ``state_dict()``'s; callables (``lr``
        and schedules) are not saved: pass the same ones on resume.
        ``include_factors`` is KAISA's: False (its smaller checkpoint, whose
        resume starts the factors afresh) still includes them here, with a
        warning once, so that a resume continues the run exactly.
        """
        if not include_factors and not self._factors_note_said:
            self._factors_note_said = True
            warnings.warn(
                "state_dict(include_factors=False): the factors are kept in the checkpoint all the same, so that a resume "
                "continues the run bit for bit (docs/preconditioner.md)",
                stacklevel=2,
            )
        return self.kfac.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` (for the same model and compute method). ``compute_inverses`` is KAISA's and
        changes nothing: the decompositions saved are restored, and those missing recomputed at the first step."""
        if not isinstance(compute_inverses, bool):
            raise TypeError("compute_inverses must be a bool")
        self.kfac.load_state_dict(state_dict)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: every worker's decompositions for rank ``to``'s next :meth:`state_dict` (and your optimizer's,
        when attached), so that a resume recomputes none: :meth:`SPDKFACOptimizer.consolidate_state_dict
        <spdkfac.SPDKFACOptimizer.consolidate_state_dict>`."""
        self.kfac.consolidate_state_dict(to)

    # ------------------------------------------------------------ reporting
    def memory_usage(self) -> dict[str, int]:
        """Bytes this worker holds in factors and decompositions, per kind."""
        return self.kfac.memory_usage()

    def kfac_summary(self) -> str:
        """Which modules K-FAC preconditions, and which it leaves out and why."""
        return self.kfac._kfac_summary("Your optimizer's update")

    def fusion_plan(self) -> dict[str, list[list[FactorKey]] | None]:
        """Current fusion groups of the factor all-reduces per pass (None while profiling, or for ``'layerwise'``)."""
        return self.kfac.fusion_plan()

    def replan(self) -> None:
        """Plan fusion, placement and gradient workers anew at the engine's current size (Horovod elastic resets):
        :meth:`SPDKFACOptimizer.replan <spdkfac.SPDKFACOptimizer.replan>`."""
        self.kfac.replan()

    def remove_hooks(self) -> None:
        """Detach every hook from the model and the attached optimizer (the preconditioner is unusable afterwards)."""
        if self._attachment is not None:
            self._attachment.remove()
        unwatch(self)
        self.kfac.remove_hooks()

    def __repr__(self) -> str:
        kfac, group = self.kfac, self.kfac.param_groups[0]
        options = ", ".join(f"{k}={v!r}" for k, v in kfac.config.as_dict().items() if k not in ("base", "update_fusion", "precondition"))
        return (
            f"KFACPreconditioner(layers={len(kfac.layers)}, lr={self._lr!r}, damping={group['damping']}, "
            f"factor_decay={group['factor_decay']}, kl_clip={group['kl_clip']}, factor_update_steps={kfac.factor_update_freq}, "
            f"inv_update_steps={kfac.inv_update_freq}, backend={kfac.backend.name}(rank {kfac.backend.rank}/{kfac.backend.size}), "
            f"{options}, perf_model={kfac.perf_model.source!r})"
        )
