"""The fitted performance models at the predicted worker count (one implementation: :meth:`PerfModel.scaled_to`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..kfac.factor_shape import FactorShape
from ..kfac.methods import get_method, payload_size
from ..perfmodels import PerfModel

__all__ = ["ScaledModels"]


@dataclass
class ScaledModels:
    """The fitted models extrapolated to ``workers`` (:meth:`PerfModel.scaled_to`), with no communication for one."""

    perf: PerfModel
    workers: int
    scaled: PerfModel = field(init=False)

    def __post_init__(self) -> None:
        self.scaled = self.perf.scaled_to(self.workers)

    def allreduce(self, elements: float) -> float:
        return self.ar_alpha + self.ar_beta * elements

    @property
    def ar_alpha(self) -> float:
        return self.scaled.allreduce.alpha if self.workers > 1 else 0.0

    @property
    def ar_beta(self) -> float:
        return self.scaled.allreduce.beta if self.workers > 1 else 0.0

    def broadcast(self, dim: int, method: str = "inverse") -> float:
        """Broadcast of one factor's result (:func:`~spdkfac.kfac.methods.payload_size` elements)."""
        if self.workers == 1:
            return 0.0
        return self.scaled.broadcast.payload(payload_size(method, dim))

    def broadcast_elements(self, elements: float) -> float:
        """Broadcast of a flat buffer, from the same fit (its ``m`` is ``d(d+1)/2`` there)."""
        if self.workers == 1 or elements == 0:
            return 0.0
        return self.scaled.broadcast.alpha + self.scaled.broadcast.beta * elements

    def inverse(self, dim: int) -> float:
        return self.perf.inverse(dim)

    def decomposition_cost(self, method: str, shape: FactorShape) -> float:
        """Modelled seconds of one factor's decomposition (batched for a block-diagonal factor)."""
        return get_method(method).cost(self.perf, shape)

    def stage_costs(self, method: str) -> tuple[Callable[[int], float], Callable[[int], float]]:
        """(decomposition, broadcast) seconds of a ``d x d`` factor for ``compute_method`` at ``workers``."""
        return get_method(method).curve(self.perf), lambda dim: self.broadcast(dim, method)
