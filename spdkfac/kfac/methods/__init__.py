"""The compute methods, one class each, registered here: ``compute_method`` name -> class.

Adding a method is one file (a :class:`DecompositionMethod` subclass) and one
line in :data:`METHODS`.
"""

from __future__ import annotations

from typing import Any, Callable

from ...perfmodels import PerfModel
from ..factor_shape import FactorShape
from .base import DecompositionFallbackWarning, DecompositionMethod, LinAlgError
from .eigen import EigenMethod
from .ekfac import EKFACMethod
from .inverse import InverseMethod

__all__ = [
    "COMPUTE_METHODS",
    "METHODS",
    "DecompositionFallbackWarning",
    "DecompositionMethod",
    "EKFACMethod",
    "EigenMethod",
    "InverseMethod",
    "LinAlgError",
    "get_method",
    "payload_size",
    "stage_costs",
]

METHODS: dict[str, type[DecompositionMethod]] = {
    InverseMethod.name: InverseMethod,
    EigenMethod.name: EigenMethod,
    EKFACMethod.name: EKFACMethod,
}
COMPUTE_METHODS = tuple(METHODS)


def get_method(method: str | DecompositionMethod, options: Any = None) -> DecompositionMethod:
    """The method object for a ``compute_method`` value (an object is returned as it is).

    ``options`` (a :class:`~spdkfac.config.KFACConfig`) configures it
    (``eigen_refresh``, ``eigen_full_every``, ``ekfac_decay``); None: defaults.
    """
    if isinstance(method, DecompositionMethod):
        return method
    cls = METHODS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise ValueError(f"compute_method must be one of {tuple(METHODS)}, got {method!r}")
    return cls.from_options(options)


def payload_size(method: str | DecompositionMethod, dim: int) -> int:
    """Elements broadcast for one dense ``dim x dim`` factor (:meth:`DecompositionMethod.payload_size`)."""
    return get_method(method).payload_size(FactorShape(dim))


def stage_costs(perf: PerfModel, method: str | DecompositionMethod) -> tuple[Callable[[int], float], Callable[[int], float]]:
    """Modelled seconds to decompose and to broadcast a dense ``d x d`` factor, as the placement solvers take them."""
    m = get_method(method)
    return lambda dim: m.cost(perf, FactorShape(dim)), lambda dim: m.broadcast_cost(perf, FactorShape(dim))
