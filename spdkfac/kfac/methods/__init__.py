"""The compute methods, one class each, registered here: ``compute_method`` name -> class.

Adding a method is one file (a :class:`DecompositionMethod` subclass) and, in
this file, its name in :class:`ComputeMethod` and its class in :data:`METHODS`.
A class registered at run time (``METHODS['mine'] = Mine``) is accepted by
its plain string name too.
"""

from __future__ import annotations

from typing import Any, Callable

from ...options import Option
from ...perfmodels import PerfModel
from ..factor_shape import FactorShape
from .base import DecompositionFallbackWarning, DecompositionMethod, LinAlgError, MethodState
from .eigen import EigenMethod, EigenOptions, EigenRefresh
from .ekfac import EKFACMethod, EKFACOptions, EKFACUpdate
from .inverse import InverseMethod

__all__ = [
    "METHODS",
    "ComputeMethod",
    "DecompositionFallbackWarning",
    "DecompositionMethod",
    "EKFACMethod",
    "EKFACOptions",
    "EKFACUpdate",
    "EigenMethod",
    "EigenOptions",
    "EigenRefresh",
    "InverseMethod",
    "LinAlgError",
    "MethodState",
    "get_method",
    "payload_size",
    "stage_costs",
]


class ComputeMethod(Option):
    """The built-in compute methods (``compute_method``)."""

    INVERSE = "inverse"  # the paper's damped inverses
    EIGEN = "eigen"  # KAISA's eigendecompositions
    EKFAC = "ekfac"  # George et al.'s eigenvalue-corrected K-FAC


#: ``compute_method`` -> class (a class whose name is not a :class:`ComputeMethod` fails here, at import).
METHODS: dict[str, type[DecompositionMethod]] = {ComputeMethod(cls.name): cls for cls in (InverseMethod, EigenMethod, EKFACMethod)}


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
