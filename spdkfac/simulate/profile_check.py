"""Every value of a loaded profile checked against its field's type, so a bad file fails on load.

A NaN time would otherwise become a ``nan`` prediction, and a missing time or a
negative dimension a traceback deep inside the simulator. The rules follow
the dataclass annotations of :mod:`.profile_file`, so a new field is checked
by the rule of its type (a test keeps every annotation covered).
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real
from typing import Any, Callable, Optional

from ..kfac.factor_shape import FactorKind

__all__ = ["ProfileValueError", "check_profile"]

#: Integer fields that may be 0 (element counts); every other integer is a dimension or a count >= 1.
NON_NEGATIVE_INTS = frozenset({"grad_numel", "other_grad_numel"})


class ProfileValueError(ValueError):
    """A profile holds a value its field cannot have; the message names the file and the field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _time(name: str, value: Any) -> str | None:
    ok = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value) and float(value) >= 0
    return None if ok else "must be a finite non-negative number of seconds"


def _integer(name: str, value: Any) -> str | None:
    if name in NON_NEGATIVE_INTS:
        return None if _is_int(value) and value >= 0 else "must be a non-negative integer"
    return None if _is_int(value) and value >= 1 else "must be a positive integer"


def _text(name: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if name == "kind" and value not in FactorKind.choices():
        return f"must be one of {FactorKind.choices()}"
    return None


def _flag(name: str, value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _cores(name: str, value: Any) -> str | None:
    ok = isinstance(value, tuple) and all(_is_int(c) and c >= 0 for c in value)
    return None if ok else "must be a list of core numbers (non-negative integers)"


def _times(name: str, value: Any) -> str | None:
    ok = isinstance(value, tuple) and all(_time(name, v) is None for v in value)
    return None if ok else "must be a list of finite non-negative numbers of seconds (one per rank)"


Rule = Callable[[str, Any], Optional[str]]
#: The rule of each annotation used in the profile dataclasses (``None`` is allowed where the annotation says so).
RULES: dict[str, Rule] = {
    "float": _time,
    "int": _integer,
    "str": _text,
    "bool": _flag,
    "tuple[int, ...]": _cores,
    "tuple[float, ...]": _times,
}
#: Fields holding tuples of nested dataclasses, checked element by element.
NESTED = ("tuple[FactorProfile, ...]", "tuple[LayerPreconditionProfile, ...]")


def _rule(annotation: str) -> tuple[Rule | None, bool]:
    """The rule of ``annotation`` and whether it allows None (``X | None``)."""
    base, optional = annotation, annotation.endswith(" | None")
    if optional:
        base = annotation[: -len(" | None")]
    return RULES.get(base), optional


def _check(obj: Any, where: str, source: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{where}{f.name}"
        annotation = str(f.type)
        if annotation in NESTED:
            if not isinstance(value, tuple):
                raise ProfileValueError(f"profile {source}: field {path} must be a list, got {value!r}")
            for i, item in enumerate(value):
                layer = getattr(item, "layer", None)
                _check(item, f"{path}[{i}]{f' (layer {layer})' if isinstance(layer, str) else ''}.", source)
            continue
        rule, optional = _rule(annotation)
        if rule is None or (optional and value is None):
            continue  # unknown annotations are caught by the test of RULES, not at a user's run
        problem = rule(f.name, value)
        if problem:
            raise ProfileValueError(f"profile {source}: field {path} {problem}, got {value!r}")


def check_profile(profile: Any, source: str) -> None:
    """Raise :class:`ProfileValueError` naming ``source`` and the first field of ``profile`` with an impossible value."""
    _check(profile, "", source)
