"""Hyperparameters that change during training: per-step callables and the per-epoch recipe.

Two ways to schedule K-FAC's damping, KL clip and update frequencies:

* pass a callable ``f(step) -> value`` instead of a number for ``damping``,
  ``kl_clip``, ``factor_update_freq`` or ``inv_update_freq`` of
  :class:`~spdkfac.SPDKFACOptimizer` (as KAISA does). ``step`` is the number of
  completed ``step()`` calls (0 for the first). The value is a pure function of
  the step counter, so every worker takes the same value at the same step with
  no communication; :class:`StepSchedule` evaluates and validates it.
* :class:`LambdaParamScheduler`, KAISA's: at each ``step()``, multiplies the
  :class:`~spdkfac.KFACPreconditioner`'s values by functions of the step;
* :class:`KFACParamScheduler`, stepped once per epoch like a
  ``torch.optim.lr_scheduler``: the recipe of Pauloski et al. (Sec. V-C of
  "Convolutional neural network training with distributed K-FAC"): the damping
  is multiplied by ``damping_alpha`` at each epoch of ``damping_schedule`` (large
  damping early, when the Fisher changes fast) and both update frequencies by
  ``update_freq_alpha`` at each epoch of ``update_freq_schedule`` (factors and
  inverses refreshed less often once the Fisher is stable).

The optimizer resolves the values in force for a step once, when that step
first needs them (its first training forward pass, or ``step()``), so a
scheduler's change between two ``step()`` calls applies to the whole next step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union

from .config import SCHEDULE_CHECKS, check_non_negative_int, check_positive_int

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import SPDKFACOptimizer
    from .preconditioner import KFACPreconditioner

__all__ = ["LAYER_WIDE_OPTIONS", "SCHEDULED_OPTIONS", "KFACParamScheduler", "LambdaParamScheduler", "Scheduled", "StepSchedule"]

#: The optimizer options that may be given as ``f(step) -> value``.
SCHEDULED_OPTIONS = ("damping", "kl_clip", "factor_update_freq", "inv_update_freq")
#: The param-group entries K-FAC reads from ``param_groups[0]`` for every layer at once (the base update's, such as
#: ``lr`` and ``weight_decay``, are each group's own): every group holds the same value.
LAYER_WIDE_OPTIONS = ("damping", "kl_clip", "factor_decay")

T = TypeVar("T")
#: A hyperparameter given as a value or as a function of the step counter.
Scheduled = Union[T, Callable[[int], T]]
#: ``check(name, value)``: raises naming ``name`` if ``value`` is invalid, else returns it as a plain value (float, int, None).
Validator = Callable[[str, Any], Any]


class StepSchedule:
    """Which of the optimizer's scheduled options are callables, and the values in force at a step.

    Options given as numbers are not kept here: their value lives where code
    reads and sets it (``param_groups[0]['damping']`` / ``['kl_clip']``, the
    optimizer's ``factor_update_freq`` / ``inv_update_freq``), so writing there
    keeps working; :meth:`resolve` only validates them. Callables cannot be
    pickled: ``state_dict`` stores the values in force and the callables are
    given again to the constructor on resume.
    """

    def __init__(self, options: Mapping[str, Any], validators: Mapping[str, Validator]) -> None:
        unknown = sorted(set(options) - set(SCHEDULED_OPTIONS))
        if unknown:
            raise ValueError(f"options {unknown} cannot be scheduled; only {SCHEDULED_OPTIONS}")
        self._validators = dict(validators)
        self.callables: dict[str, Callable[[int], Any]] = {name: v for name, v in options.items() if callable(v)}
        #: The layer-wide values last written to every group (:meth:`hold_layer_wide`): a group that differs from them
        #: and from ``param_groups[0]`` was written by itself.
        self._held: dict[str, Any] = {}

    def is_scheduled(self, name: str) -> bool:
        """Whether ``name`` was given as a callable of the step."""
        return name in self.callables

    def values_at(self, step: int, current: Mapping[str, Any]) -> dict[str, Any]:
        """The values at ``step`` as given, unchecked: callables evaluated at it, the rest taken from ``current``."""
        return {name: fn(step) if (fn := self.callables.get(name)) is not None else current[name] for name in self._validators}

    def resolve(self, step: int, current: Mapping[str, Any]) -> dict[str, Any]:
        """The validated values in force at ``step``: callables evaluated at it, the rest taken from ``current``.

        Raises:
            TypeError, ValueError: a value is invalid (the message names the
                option and the step), or ``inv_update_freq`` is not a multiple of
                ``factor_update_freq`` at this step.
        """
        values: dict[str, Any] = {}
        for name, value in self.values_at(step, current).items():
            try:
                values[name] = self._validators[name](name, value)  # the plain value (a numpy scalar becomes a float or int)
            except (TypeError, ValueError) as exc:
                source = f"the {name} schedule's value" if name in self.callables else f"the {name} in force"
                raise type(exc)(f"{exc} ({source} at step {step})") from None
        factor_freq, inv_freq = values["factor_update_freq"], values["inv_update_freq"]
        if inv_freq % factor_freq:
            raise ValueError(
                f"inv_update_freq ({inv_freq}) must be a multiple of factor_update_freq ({factor_freq}) at every step "
                f"(inverses are computed from freshly updated factors); it is not at step {step}"
            )
        return values

    def hold_layer_wide(self, param_groups: list[dict[str, Any]], loaded: bool = False) -> None:
        """Write ``param_groups[0]``'s layer-wide values (:data:`LAYER_WIDE_OPTIONS`) to every group and remember them.

        ``loaded``: the groups were just loaded from a checkpoint, whose steps
        used ``param_groups[0]``'s values (the others are taken as they are).

        Raises:
            ValueError: another group's value was changed by itself since they
                were last held (``param_groups[1]['damping'] = ...``): K-FAC
                would not use it, so it is refused rather than overwritten.
        """
        if not loaded:
            self._refuse_own_values(param_groups)
        self._spread(param_groups)

    def _refuse_own_values(self, param_groups: list[dict[str, Any]]) -> None:
        """ValueError for a group other than the first whose layer-wide value differs from the first's and from the
        value last held (it was written to that group alone)."""
        first = param_groups[0]
        for index, group in enumerate(param_groups[1:], start=1):
            for name in LAYER_WIDE_OPTIONS:
                value = group.get(name, first[name])
                if value != first[name] and (name not in self._held or value != self._held[name]):
                    raise ValueError(
                        f"param_groups[{index}]['{name}'] is {value!r} and param_groups[0]'s {first[name]!r}: K-FAC's "
                        f"{name} is one value for every layer, read from param_groups[0]; set it there (or in every "
                        "group alike)"
                    )

    def _spread(self, param_groups: list[dict[str, Any]]) -> None:
        """Copy the first group's layer-wide values to every group and remember them as held."""
        self._held = {name: param_groups[0][name] for name in LAYER_WIDE_OPTIONS}
        for group in param_groups:
            group.update(self._held)

    def fix_step(self, step: int, param_groups: list[dict[str, Any]], freqs: tuple[int, int]) -> tuple[int, int]:
        """Resolve the values in force at ``step``: damping and kl_clip written to every param group (with
        factor_decay, all ``param_groups[0]``'s: :meth:`hold_layer_wide`), the (factor, inverse) update frequencies
        returned."""
        self._refuse_own_values(param_groups)
        group = param_groups[0]
        values = self.resolve(
            step, dict(damping=group["damping"], kl_clip=group["kl_clip"], factor_update_freq=freqs[0], inv_update_freq=freqs[1])
        )
        group["damping"], group["kl_clip"] = values["damping"], values["kl_clip"]
        self._spread(param_groups)
        return values["factor_update_freq"], values["inv_update_freq"]


def _check_epochs(name: str, epochs: Iterable[int] | None) -> list[int]:
    """The epochs as a sorted list of plain ints (numpy integers taken)."""
    try:
        given: list[Any] = list(epochs) if epochs is not None else []
    except TypeError:
        raise ValueError(f"{name} must be a list of epochs (non-negative integers), got {epochs!r}") from None
    out = []
    for e in given:
        if isinstance(e, bool) or not isinstance(e, Integral) or int(e) < 0:
            raise ValueError(f"{name} must be a list of epochs (non-negative integers), got {epochs!r}")
        out.append(int(e))
    return sorted(out)


def _check_alpha(name: str, alpha: Any) -> float:
    """``alpha`` as a plain float (numpy scalars taken) if it is a positive finite number."""
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not (math.isfinite(alpha) and float(alpha) > 0):
        raise ValueError(f"{name} must be a positive number, got {alpha!r}")
    return float(alpha)


#: The rule of each entry of a :class:`KFACParamScheduler` state (the constructor's; each returns the plain value).
_STATE_CHECKS: dict[str, Validator] = {
    "damping_alpha": _check_alpha,
    "damping_schedule": _check_epochs,
    "update_freq_alpha": _check_alpha,
    "update_freq_schedule": _check_epochs,
    "base_damping": SCHEDULE_CHECKS["damping"],
    "base_factor_update_freq": check_positive_int,
    "base_inv_update_freq": check_positive_int,
    "epoch": check_non_negative_int,
}


def _checked_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a scheduler state as plain values, or a ValueError naming the first bad key."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        try:
            out[key] = _STATE_CHECKS[key](key, value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"KFACParamScheduler state: {exc}") from None
    factor, inverse = out["base_factor_update_freq"], out["base_inv_update_freq"]
    if inverse % factor:
        raise ValueError(
            f"KFACParamScheduler state: base_inv_update_freq ({inverse}) must be a multiple of base_factor_update_freq ({factor})"
        )
    return out


class KFACParamScheduler:
    """Damping decay and update-frequency scaling at fixed epochs, stepped like an LR scheduler.

    During epoch ``e`` (after ``e`` calls of :meth:`step`), with ``n(S)`` the
    number of epochs in schedule ``S`` that are ``<= e``::

        damping            = base_damping * damping_alpha ** n(damping_schedule)
        factor_update_freq = max(1, round(base_factor_freq * update_freq_alpha ** n(update_freq_schedule)))
        inv_update_freq    = factor_update_freq * (base_inv_freq // base_factor_freq)

    The base values are the optimizer's when the scheduler is made. Scaling the
    factor frequency and keeping the inverse/factor ratio keeps
    ``inv_update_freq`` a multiple of ``factor_update_freq``. A new damping takes
    effect at the next inverse update (the damping is part of the inverses).

    Usage, once per epoch as a ``torch.optim.lr_scheduler``::

        kfac_sched = KFACParamScheduler(opt, damping_alpha=0.5, damping_schedule=[40, 80],
                                        update_freq_alpha=10, update_freq_schedule=[40])
        for epoch in range(epochs):
            train_one_epoch(...)
            kfac_sched.step()

    Save :meth:`state_dict` with the optimizer's and restore it with
    :meth:`load_state_dict` after the optimizer's to resume exactly.
    """

    def __init__(
        self,
        optimizer: SPDKFACOptimizer,
        damping_alpha: float = 1.0,
        damping_schedule: Iterable[int] | None = None,
        update_freq_alpha: float = 1.0,
        update_freq_schedule: Iterable[int] | None = None,
    ) -> None:
        schedule = getattr(optimizer, "schedule", None)
        if not isinstance(schedule, StepSchedule):
            raise TypeError(f"optimizer must be an SPDKFACOptimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.damping_alpha = _check_alpha("damping_alpha", damping_alpha)
        self.damping_schedule = _check_epochs("damping_schedule", damping_schedule)
        self.update_freq_alpha = _check_alpha("update_freq_alpha", update_freq_alpha)
        self.update_freq_schedule = _check_epochs("update_freq_schedule", update_freq_schedule)
        touched = (["damping"] if self.damping_schedule else []) + (
            ["factor_update_freq", "inv_update_freq"] if self.update_freq_schedule else []
        )
        clash = [name for name in touched if schedule.is_scheduled(name)]
        if clash:
            raise ValueError(f"{clash} are already scheduled by a callable given to the optimizer; schedule them one way only")
        self.base_damping: float = optimizer.param_groups[0]["damping"]
        self.base_factor_update_freq: int = optimizer.factor_update_freq
        self.base_inv_update_freq: int = optimizer.inv_update_freq
        self.epoch = 0
        self.apply()

    def damping_at(self, epoch: int) -> float:
        """The damping during ``epoch``."""
        return self.base_damping * self.damping_alpha ** sum(e <= epoch for e in self.damping_schedule)

    def update_freqs_at(self, epoch: int) -> tuple[int, int]:
        """``(factor_update_freq, inv_update_freq)`` during ``epoch``."""
        scale = self.update_freq_alpha ** sum(e <= epoch for e in self.update_freq_schedule)
        factor = max(1, round(self.base_factor_update_freq * scale))
        return factor, factor * (self.base_inv_update_freq // self.base_factor_update_freq)

    def step(self) -> None:
        """End of an epoch: set the values of the next one."""
        self.epoch += 1
        self.apply()

    def apply(self) -> None:
        """Put the scheduled values of the current epoch in force (after the bases or rules were changed, too)."""
        if self.damping_schedule:
            damping = self.damping_at(self.epoch)
            for group in self.optimizer.param_groups:
                group["damping"] = damping
        if self.update_freq_schedule:
            self.optimizer.factor_update_freq, self.optimizer.inv_update_freq = self.update_freqs_at(self.epoch)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer (as ``torch.optim.lr_scheduler``)."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the optimizer's own checkpoint holds the values in force.

        Every value is checked by the constructor's rules (a damaged or
        edited checkpoint fails here, naming the key, not epochs later).
        """
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            raise ValueError(f"not a KFACParamScheduler state: keys {sorted(state_dict)}, expected {sorted(expected)}")
        self.__dict__.update(_checked_state(state_dict))

    def __repr__(self) -> str:
        return (
            f"KFACParamScheduler(epoch={self.epoch}, damping={self.damping_at(self.epoch):g} (x{self.damping_alpha:g} at "
            f"{self.damping_schedule}), update_freqs={self.update_freqs_at(self.epoch)} (x{self.update_freq_alpha:g} at "
            f"{self.update_freq_schedule}))"
        )


#: LambdaParamScheduler's arguments -> the preconditioner's properties they scale.
_LAMBDA_TARGETS = {
    "factor_update_steps_lambda": "factor_update_steps",
    "inv_update_steps_lambda": "inv_update_steps",
    "damping_lambda": "damping",
    "factor_decay_lambda": "factor_decay",
    "kl_clip_lambda": "kl_clip",
    "lr_lambda": "lr",
}


class LambdaParamScheduler:
    """KAISA's ``LambdaParamScheduler``: each :meth:`step` multiplies the preconditioner's values by functions of the step.

    ``f(step)`` gives the factor the value in force is multiplied by (the
    update frequencies then cast to int, as KAISA does); ``step`` is the
    preconditioner's completed steps unless given to :meth:`step`. A value the
    preconditioner was given as a function of the step cannot be scaled too
    (ValueError, as KAISA's), nor a KL clip that is off. The values in force
    are saved in the preconditioner's ``state_dict()`` (``lr``: not, as a
    number given to it is not), so a resumed run continues from them, as with
    KAISA's. Usage, as in KAISA's examples::

        scheduler = LambdaParamScheduler(preconditioner, damping_lambda=lambda epoch: 0.5 if epoch in (40, 80) else 1.0)
        for epoch in range(epochs):
            train_one_epoch(...)
            scheduler.step(epoch + 1)
    """

    def __init__(
        self,
        preconditioner: KFACPreconditioner,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        if not callable(getattr(preconditioner, "is_scheduled", None)):
            raise TypeError(
                f"preconditioner must be a KFACPreconditioner, got {type(preconditioner).__name__} (for SPDKFACOptimizer: "
                "functions of the step for its options, or KFACParamScheduler)"
            )
        given = dict(
            factor_update_steps_lambda=factor_update_steps_lambda,
            inv_update_steps_lambda=inv_update_steps_lambda,
            damping_lambda=damping_lambda,
            factor_decay_lambda=factor_decay_lambda,
            kl_clip_lambda=kl_clip_lambda,
            lr_lambda=lr_lambda,
        )
        self.preconditioner = preconditioner
        self.lambdas: dict[str, Callable[[int], float]] = {}
        for argument, fn in given.items():
            if fn is None:
                continue
            target = _LAMBDA_TARGETS[argument]
            if not callable(fn):
                raise TypeError(f"{argument} must be a function of the step, got {type(fn).__name__}")
            if preconditioner.is_scheduled(target):
                raise ValueError(
                    f"the preconditioner's {target} is already a function of the step (or follows the attached optimizer's "
                    f"learning rates): it cannot be scaled by {argument}"
                )
            if target == "kl_clip" and preconditioner.kl_clip is None:
                raise ValueError("kl_clip_lambda scales the KL clip, which is off (kl_clip=None)")
            self.lambdas[target] = fn

    def step(self, step: int | None = None) -> None:
        """Multiply each scheduled value by its function's value at ``step`` (the preconditioner's steps if None)."""
        at = self.preconditioner.steps if step is None else step
        for target, fn in self.lambdas.items():
            factor: Any = fn(at)
            if isinstance(factor, bool) or not isinstance(factor, Real):
                raise TypeError(f"the {target} lambda returned {factor!r} at step {at}, not a number")
            value = getattr(self.preconditioner, target) * float(factor)
            setattr(self.preconditioner, target, int(value) if target.endswith("_steps") else value)
