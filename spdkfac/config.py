"""The optimizer's fixed options: validated once, frozen, shown whole by ``repr``.

:class:`SPDKFACOptimizer <spdkfac.SPDKFACOptimizer>` keeps its hyperparameters
that may change during training (``lr``, ``momentum``, ``weight_decay``,
``factor_decay``, ``damping``, ``kl_clip``) in ``param_groups``, and the update
frequencies as attributes (both may be scheduled, :mod:`spdkfac.schedules`).
Everything else decides *how* the step is computed and is fixed for the
optimizer's life: that is :class:`KFACConfig`. None of it changes the
result, except ``precondition`` (K-FAC on or off), ``compute_method``,
``skip_layers``, ``norm_layers`` and ``base``, which are what a checkpoint must agree on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any, Literal

from .kfac.layer_types import NormLayers
from .kfac.layers import LayerFilter
from .kfac.methods import METHODS, ComputeMethod, EigenOptions, EigenRefresh, EKFACOptions, EKFACUpdate
from .options import Option
from .plan.factor_fusion import DEFAULT_THRESHOLD_BYTES, FusionPolicy
from .plan.placement import Placement
from .update.base_update import BaseOptimizer
from .update.update_fusion import UpdateFusion
from .update.weight_decay import check_no_weight_decay

# The enumerated options' types (each declared beside the code that chooses among its values, gathered here):
# string enums, so a user passes 'lbp' or Placement.LBP alike, and a bad value raises naming the choices.
__all__ = [
    "HYPERPARAMETER_CHECKS",
    "SCHEDULE_CHECKS",
    "BaseOptimizer",
    "ComputeMethod",
    "EKFACOptions",
    "EKFACUpdate",
    "EigenOptions",
    "EigenRefresh",
    "FusionPolicy",
    "KFACConfig",
    "NormLayers",
    "Option",
    "Placement",
    "UpdateFusion",
    "check_hyperparameters",
    "check_non_negative_int",
    "check_number",
    "check_positive_int",
]


def check_number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = True) -> float:
    """``value`` as a plain float, or a TypeError/ValueError naming ``name`` and the allowed interval.

    Any real number is taken (``numpy.float32(0.1)`` too) and returned as a
    Python float, so that ``state_dict`` holds plain values that
    ``torch.load(weights_only=True)`` reads; bools are refused.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return v


def _integer(value: Any) -> int | None:
    """``value`` as a plain int if it is an integer (``numpy.int64`` too; not a bool), else None."""
    return None if isinstance(value, bool) or not isinstance(value, Integral) else int(value)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as a plain int if it is an integer >= 1, else a ValueError naming ``name``."""
    number = _integer(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as a plain int if it is an integer >= 0, else a ValueError naming ``name``."""
    number = _integer(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return number


#: Validators of the SGD / running-average hyperparameters (each returns the plain value).
HYPERPARAMETER_CHECKS = dict(
    lr=lambda n, v: check_number(n, v, 0.0),
    momentum=lambda n, v: check_number(n, v, 0.0, 1.0),
    weight_decay=lambda n, v: check_number(n, v, 0.0),
    factor_decay=lambda n, v: check_number(n, v, 0.0, 1.0),
)


def check_hyperparameters(lr: Any, momentum: Any, weight_decay: Any, factor_decay: Any) -> dict[str, float]:
    """The SGD / running-average hyperparameters as plain floats; raises naming the first out of its range."""
    given = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, factor_decay=factor_decay)
    return {name: HYPERPARAMETER_CHECKS[name](name, value) for name, value in given.items()}


#: Validators of the options that may be scheduled (:mod:`spdkfac.schedules`), checked at every step.
SCHEDULE_CHECKS = dict(
    damping=lambda n, v: check_number(n, v, 0.0, low_open=True),
    kl_clip=lambda n, v: None if v is None else check_number(n, v, 0.0, low_open=True),
    factor_update_freq=check_positive_int,
    inv_update_freq=check_positive_int,
)


def _compute_method(value: Any) -> ComputeMethod | str:
    """A built-in method as its :class:`ComputeMethod`, a method registered at run time as its name."""
    if not isinstance(value, str) or value not in METHODS:  # the registry as it is now
        raise ValueError(f"compute_method must be one of {tuple(METHODS)}, got {value!r}")
    return ComputeMethod(value) if value in ComputeMethod.choices() else value


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


#: The enumerated options, in the order they are checked (compute_method: by the registry of methods).
_ENUMERATED: tuple[tuple[str, type[Option] | None], ...] = (
    ("fusion", FusionPolicy),
    ("placement", Placement),
    ("base", BaseOptimizer),
    ("compute_method", None),
    ("update_fusion", UpdateFusion),
    ("eigen_refresh", EigenRefresh),
    ("ekfac_update", EKFACUpdate),
    ("norm_layers", NormLayers),
)

#: The grouped per-method options: keyword -> (type, its attribute -> the flat field it stands for).
_GROUPS: dict[str, tuple[type[Any], dict[str, str]]] = {
    "eigen": (EigenOptions, {"refresh": "eigen_refresh", "full_every": "eigen_full_every"}),
    "ekfac": (EKFACOptions, {"decay": "ekfac_decay", "update": "ekfac_update"}),
}


@dataclass(frozen=True)
class KFACConfig:
    """How the K-FAC step is computed and communicated (invalid values raise, naming the option).

    The optimizer takes each of these as a keyword argument. An enumerated
    option takes its string or its enum member (``placement='lbp'`` or
    ``Placement.LBP``: :class:`FusionPolicy`, :class:`Placement`,
    :class:`ComputeMethod`, :class:`EigenRefresh`, :class:`EKFACUpdate`,
    :class:`UpdateFusion`, :class:`BaseOptimizer`) and is stored as the
    member, which is its string. The per-method options may also be passed
    grouped, ``eigen=EigenOptions(refresh, full_every)`` and
    ``ekfac=EKFACOptions(decay, update)`` (:meth:`from_options`), and are
    read grouped as :attr:`eigen` and :attr:`ekfac`.

    Attributes:
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
            ``'ekfac'`` (George et al.'s eigenvalue-corrected K-FAC: the eigen
            method's bases, the scaling re-estimated every step from the
            averaged gradient, :mod:`spdkfac.kfac.methods.ekfac`).
        eigen_refresh: how ``'eigen'`` and ``'ekfac'`` refresh a basis:
            ``'exact'`` (a full ``eigh`` every time) or ``'warm'`` (one
            subspace-iteration step from the previous basis, with a full
            ``eigh`` every ``eigen_full_every`` refreshes or when the previous
            basis drifted, :mod:`spdkfac.kfac.methods.warm`).
        eigen_full_every: with ``eigen_refresh='warm'``, every this many
            refreshes is a full ``eigh``.
        ekfac_decay: β of EKFAC's running average of the scaling.
        ekfac_update: what ``'ekfac'`` does in its eigenbasis: ``'natural'``
            (George et al.: divide by the damped running scaling) or
            ``'adam'`` (SOAP's update with K-FAC's basis: Adam's moments,
            the second one in the eigenbasis with ``β2 = ekfac_decay``,
            ``β1`` and ``eps`` the AdamW base's; needs ``base='adamw'``,
            which then steps along it with its decoupled decay,
            :mod:`spdkfac.kfac.methods.ekfac`).
        distribute_preconditioning: ``grad_worker_fraction=1/P`` (KAISA's
            MEM-OPT) under its older name: each layer's decompositions are
            held and its gradient preconditioned by one worker, which
            broadcasts the result. Cannot be combined with
            ``grad_worker_fraction``.
        grad_worker_fraction: KAISA's share of the workers that hold each
            layer's decompositions and precondition its gradient
            (:mod:`spdkfac.plan.grad_workers`): ``1/P`` is MEM-OPT, 1 is COMM-OPT
            (the default, None), anything with ``fraction * P`` a divisor of
            ``P`` in between; ``'auto'`` chooses it from the performance
            model (:mod:`spdkfac.plan.grad_worker_choice`). Memory of the
            decompositions per worker falls with the fraction; the
            preconditioned gradients are broadcast to the other workers.
            Same result. With ``eigen_refresh='warm'`` every worker still
            holds every basis (each refresh starts from the previous one):
            the fraction splits only the preconditioning.
        memory_budget: with ``grad_worker_fraction='auto'``, the bytes of
            K-FAC state (running factors and decompositions) a worker may
            hold; the fastest modelled fraction within it is chosen.
        overlap_preconditioning: on steps that keep the current inverses
            (all but one in ``inv_update_freq``), precondition each layer as
            soon as its averaged gradient arrives, last layer first, so that
            the gradient all-reduce of the earlier layers hides behind the
            preconditioning matmuls of the later ones; on such steps that
            update the factors, the preconditioning (which reads only the
            kept inverses) also runs before waiting for the factor
            all-reduces, hiding them as well (not in the paper; the D-KFAC
            and MPD-KFAC baselines turn it off). Same result.
        fusion_threshold_bytes: buffer size of the ``'threshold'`` policy.
        profile_steps: factor-update steps timed (after one warm-up step)
            before the ``'optimal'`` fusion plan is made.
        replan_interval: re-profile every this many factor-update steps and
            replace the ``'optimal'`` plan if the per-layer times have drifted
            (None: plan once). The current plan stays in use while the new
            profile is taken; every worker switches at the same step.
        timeline: record a per-iteration :class:`~spdkfac.step.timeline.Timeline`.
        precondition: False turns K-FAC off: the optimizer is then plain
            distributed momentum SGD with the same gradient communication
            (the S-SGD baseline of the benchmarks).
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
            update): module names (``'encoder.layers.0.linear1'``; shell
            wildcards match several: ``'blocks.*.dw'``), class names
            (``'Linear'``), classes, or layer kinds: ``'kind:depthwise'``
            (convolutions with ``groups == in_channels > 1``) and
            ``'kind:grouped'`` (any ``groups > 1``). Layers whose weight is used
            without their ``forward()`` (``nn.MultiheadAttention.out_proj``)
            are left out automatically, with a notice, and so are modules
            sharing a weight that cannot be one layer
            (:func:`~spdkfac.kfac.layers.untied_layers`). An embedding tied
            to its output Linear is preconditioned with both uses' factors
            (:mod:`spdkfac.kfac.tied_factors`); naming both here leaves the
            weight to the base update (naming one does too, with a notice).
        update_fusion: where the parameter update runs
            (:mod:`spdkfac.update.update_fusion`): ``'none'`` (in ``step()``),
            ``'forward'`` (each module's parameters just before its next
            forward pass; the rest at the next ``step()``, ``flush()`` or any
            ``state_dict()``), ``'backward'`` (each layer as soon as its
            averaged gradient exists, during ``backward()``; on steps that
            recompute the decompositions, at ``step()``). The parameters after
            every step are bitwise the same. ``'backward'`` refuses what needs
            all gradients before any update (a KL clip, a GradScaler,
            distributed preconditioning, clipping after ``synchronize()``);
            both need ``base='sgd'``.
        norm_layers: what the affine parameters of ``nn.BatchNorm1d/2d/3d``,
            ``nn.LayerNorm`` and ``nn.GroupNorm`` get: ``'plain'`` (the
            base update, unpreconditioned) or ``'kfac'`` (their per-channel
            2x2 Fisher blocks of scale and shift,
            :mod:`spdkfac.kfac.layer_types.norm`); a checkpoint resumes only
            with the same choice (its layers differ).
        max_factor_dim: a dense factor wider than this is kept as its
            diagonal (None: none is): ``d`` memory and an elementwise
            decomposition instead of ``d^2`` and ``d^3``, keeping each
            coordinate's curvature and dropping their correlations. For the
            layers a full factor would not fit: a language model's output
            layer, whose ``G`` is as wide as the vocabulary, and wide MLPs
            (``docs/layers.md``); a block-diagonal factor keeps its blocks. A
            checkpoint resumes only with the same value (its factors differ).
        base: the update after preconditioning: ``'sgd'`` (momentum SGD),
            ``'adamw'`` or ``'lamb'`` (:mod:`spdkfac.update.base_update`); a
            checkpoint resumes only with the same base (its state differs).
        no_weight_decay: the parameters the base update does not decay
            (parameter-name patterns, ``'kind:bias'``, ``'kind:norm'``,
            ``'kind:vector'``; :mod:`spdkfac.update.weight_decay`): a second
            parameter group with ``weight_decay=0``.
    """

    fusion: FusionPolicy = FusionPolicy.OPTIMAL
    pipelining: bool = True
    placement: Placement = Placement.LBP
    compute_method: ComputeMethod | str = ComputeMethod.INVERSE
    eigen_refresh: EigenRefresh = EigenRefresh.EXACT
    eigen_full_every: int = 10
    ekfac_decay: float = 0.95
    ekfac_update: EKFACUpdate = EKFACUpdate.NATURAL
    distribute_preconditioning: bool = False
    grad_worker_fraction: float | Literal["auto"] | None = None
    memory_budget: int | None = None
    overlap_preconditioning: bool = True
    fusion_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    profile_steps: int = 3
    replan_interval: int | None = None
    timeline: bool = False
    precondition: bool = True
    accumulation_steps: int = 1
    skip_nonfinite: int = 0
    skip_layers: tuple[LayerFilter, ...] = ()
    update_fusion: UpdateFusion = UpdateFusion.NONE
    base: BaseOptimizer = BaseOptimizer.SGD
    norm_layers: NormLayers = NormLayers.PLAIN
    no_weight_decay: tuple[str, ...] = ()
    max_factor_dim: int | None = None

    def __post_init__(self) -> None:
        # Each enumerated option stored as its enum member (a string: command lines, repr and files see no change).
        for name, option in _ENUMERATED:
            value = _compute_method(self.compute_method) if option is None else option.parse(name, getattr(self, name))
            object.__setattr__(self, name, value)
        if self.ekfac_update is EKFACUpdate.ADAM and (self.compute_method != ComputeMethod.EKFAC or self.base is not BaseOptimizer.ADAMW):
            raise ValueError(
                "ekfac_update='adam' is Adam in EKFAC's eigenbasis: it needs compute_method='ekfac' and base='adamw' "
                f"(got compute_method={self.compute_method!r}, base={self.base!r})"
            )
        for name in ("pipelining", "distribute_preconditioning", "overlap_preconditioning"):
            _check_bool(name, getattr(self, name))
        object.__setattr__(self, "eigen_full_every", check_positive_int("eigen_full_every", self.eigen_full_every))
        object.__setattr__(self, "ekfac_decay", check_number("ekfac_decay", self.ekfac_decay, 0.0, 1.0))
        if self.eigen_refresh is EigenRefresh.WARM and self.compute_method == ComputeMethod.INVERSE:
            raise ValueError("eigen_refresh='warm' refreshes an eigenbasis: it needs compute_method='eigen' or 'ekfac'")
        # Integers stored as plain ints (numpy integers are taken): the options are saved in state_dict.
        for name in ("accumulation_steps", "profile_steps", "fusion_threshold_bytes"):
            object.__setattr__(self, name, check_positive_int(name, getattr(self, name)))
        for name in ("replan_interval", "max_factor_dim"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_positive_int(name, getattr(self, name)))
        object.__setattr__(self, "skip_nonfinite", check_non_negative_int("skip_nonfinite", self.skip_nonfinite))
        self._check_grad_workers()
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        object.__setattr__(self, "no_weight_decay", check_no_weight_decay(self.no_weight_decay))

    @property
    def splits_preconditioning(self) -> bool:
        """Whether some layer is preconditioned (and its decompositions kept) on only some of the workers."""
        fraction = self.grad_worker_fraction
        return self.distribute_preconditioning or (fraction is not None and fraction != 1)

    def _check_grad_workers(self) -> None:
        fraction: Any = self.grad_worker_fraction  # from a command line or JSON: anything
        if fraction is not None and fraction != "auto":
            if isinstance(fraction, str):
                raise ValueError(f"grad_worker_fraction must be a number in (0, 1] or 'auto', got {fraction!r}")
            object.__setattr__(self, "grad_worker_fraction", check_number("grad_worker_fraction", fraction, 0.0, 1.0, True, False))
        if fraction is not None and self.distribute_preconditioning:
            raise ValueError(
                "distribute_preconditioning=True is grad_worker_fraction=1/P (MEM-OPT) under its older name; "
                f"pass only one of them (got grad_worker_fraction={fraction!r} too)"
            )
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", check_positive_int("memory_budget", self.memory_budget))
            if fraction != "auto":
                raise ValueError("memory_budget is what grad_worker_fraction='auto' chooses within; set grad_worker_fraction='auto'")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> KFACConfig:
        """The config of the entries of ``options`` named like its fields (e.g. a constructor's ``locals()``).

        A grouped entry (``eigen=EigenOptions(...)``, ``ekfac=EKFACOptions(...)``)
        gives its flat fields; those must then be left at their defaults.
        """
        names = {f.name for f in fields(cls)}
        flat = {name: value for name, value in options.items() if name in names}
        for group, (kind, members) in _GROUPS.items():
            value = options.get(group)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise TypeError(f"{group} must be a {kind.__name__}, got {type(value).__name__}")
            defaults = kind()
            for attr, name in members.items():
                if name in flat and flat[name] != getattr(defaults, attr):
                    raise ValueError(f"pass {group}={kind.__name__}(...) or {name}={flat[name]!r}, not both")
                flat[name] = getattr(value, attr)
        return cls(**flat)

    @property
    def replans(self) -> bool:
        """Whether the fusion plan is re-profiled during training (``'optimal'`` pipelined fusion only)."""
        return self.replan_interval is not None and self.fusion is FusionPolicy.OPTIMAL and self.pipelining

    @property
    def eigen(self) -> EigenOptions:
        """The eigenbasis methods' options (``eigen_refresh``, ``eigen_full_every``) as one value."""
        return EigenOptions(self.eigen_refresh, self.eigen_full_every)

    @property
    def ekfac(self) -> EKFACOptions:
        """EKFAC's options (``ekfac_decay``, ``ekfac_update``) as one value."""
        return EKFACOptions(self.ekfac_decay, self.ekfac_update)

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (enum members as their strings, ``skip_layers`` classes by name), as saved
        in ``state_dict`` (``torch.load(weights_only=True)`` reads them)."""
        out = {name: value.plain() if isinstance(value, Option) else value for name, value in asdict(self).items()}
        out["skip_layers"] = [f if isinstance(f, str) else getattr(f, "__name__", repr(f)) for f in self.skip_layers]
        out["no_weight_decay"] = list(self.no_weight_decay)
        return out
