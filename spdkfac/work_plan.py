"""The decisions every worker makes alike, and the simulator replays: one implementation of each.

* :func:`fusion_groups`: which factors of a pass are all-reduced together
  (Eq. 15 for ``'optimal'``), from their ready times and sizes;
* :class:`WorkPlan`: who decomposes each factor (and broadcasts it), who
  preconditions each layer, and the order of the broadcasts;
* :func:`overlaps_preconditioning`: whether a step preconditions layers while
  the gradient all-reduces are still running.

They are pure functions of the model's shapes, the worker count and the
fitted performance model, so every rank computes the same answer without
communicating, and :mod:`spdkfac.simulate` predicts exactly the schedule the
optimizer runs (it only adds costs).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .factor_shape import FactorShape
from .fusion.planner import Plan, plan_groups
from .methods import DecompositionMethod, get_method
from .perfmodels import PerfModel
from .placement import ALL, PlacementPlan, balance_by_cost, place, preconditioning_cost

if TYPE_CHECKING:  # pragma: no cover
    from .layers import KFACLayer

__all__ = ["ALL", "LayerShape", "WorkPlan", "fusion_groups", "group_launch_times", "overlaps_preconditioning"]


def fusion_groups(
    policy: str,
    pipelining: bool,
    ready: Sequence[float],
    sizes: Sequence[int],
    alpha: float,
    beta: float,
    threshold_bytes: int,
    element_size: int = 4,
) -> Plan:
    """Fusion groups (indices into the pass's factors, in arrival order) for one pass.

    ``ready`` are the factors' ready times in arrival order (made
    non-decreasing here: a group cannot launch before an earlier member).
    Without pipelining every factor is sent together after the backward pass,
    so there is no pipeline to exploit: all are planned as ready at once.
    ``alpha``/``beta`` are the all-reduce model ``t(m) = alpha + beta*m`` at
    this worker count.
    """
    times = list(itertools.accumulate(ready, max)) if pipelining else [0.0] * len(sizes)
    return plan_groups(policy, times, sizes, alpha, beta, threshold_bytes, element_size=element_size)


def group_launch_times(groups: Plan, ready: Sequence[float], pipelining: bool, backward_end: float) -> list[float]:
    """When each fusion group of :func:`fusion_groups` is all-reduced.

    With pipelining, as soon as its last member is ready (no earlier than
    any earlier factor, as in :func:`fusion_groups`); without, all after the
    backward pass (``backward_end``).
    """
    if not pipelining:
        return [backward_end] * len(groups)
    times = list(itertools.accumulate(ready, max))
    return [times[group[-1]] for group in groups]


def overlaps_preconditioning(enabled: bool, precondition: bool, workers: int, inverse_step: bool) -> bool:
    """Whether a step preconditions each layer as soon as its averaged gradient arrives.

    Only on steps that keep the current inverses (the preconditioning then
    does not need this step's factors), with K-FAC on, several workers (one
    has nothing to wait for) and the option enabled.
    """
    return enabled and precondition and workers > 1 and not inverse_step


@dataclass(frozen=True)
class LayerShape:
    """What the plan needs of a preconditioned layer: its name and factor shapes.

    ``a_dim`` / ``g_dim`` are the dimensions of one block; a grouped
    convolution has ``blocks`` of each, an embedding a diagonal ``A``.
    """

    name: str
    a_dim: int
    g_dim: int
    blocks: int = 1
    a_diagonal: bool = False

    @classmethod
    def of(cls, layer: KFACLayer) -> LayerShape:
        a, g = layer.shape("A"), layer.shape("G")
        return cls(layer.name, a.dim, g.dim, max(a.blocks, g.blocks), a.diagonal)

    def dim(self, kind: str) -> int:
        return self.a_dim if kind == "A" else self.g_dim

    def factor_shape(self, kind: str) -> FactorShape:
        if kind == "A" and self.a_diagonal:
            return FactorShape(self.a_dim, diagonal=True)
        return FactorShape(self.dim(kind), blocks=self.blocks)


@dataclass(frozen=True)
class WorkPlan:
    """Who decomposes each factor, who preconditions each layer; identical on every rank.

    ``inversion`` places every factor (Algorithm 1 for ``'lbp'``, Eq. 22 for
    ``'seq'``, everywhere for ``'local'``), costed with the performance model
    at this worker count: ``inversion.owner(key)`` is the rank that decomposes
    a factor and broadcasts it (or ``ALL``), ``inversion.broadcast_order()``
    the order every rank issues the broadcasts in. ``preconditioners`` maps a
    layer to the one rank that preconditions it and broadcasts the result
    (empty: every rank preconditions every layer).
    """

    inversion: PlacementPlan
    layers: tuple[LayerShape, ...]
    preconditioners: dict[str, int] = field(default_factory=dict)

    @classmethod
    def make(
        cls,
        layers: Sequence[LayerShape],
        workers: int,
        perf: PerfModel,
        placement: str,
        compute_method: str | DecompositionMethod,
        distribute_preconditioning: bool = False,
    ) -> WorkPlan:
        """The plan for ``layers`` (in model order) on ``workers`` workers.

        ``perf`` must already describe this worker count
        (:meth:`~spdkfac.perfmodels.PerfModel.scaled_to`). Each factor is one
        task (a grouped layer's blocks are decomposed in one batched call and
        sent as one buffer), costed by the compute method
        (:meth:`~spdkfac.methods.DecompositionMethod.cost`).
        """
        method = get_method(compute_method)
        factors: list[tuple[Hashable, int]] = []
        costs: dict[Hashable, tuple[float, float]] = {}
        for s in layers:
            for kind in ("A", "G"):
                shape = s.factor_shape(kind)
                factors.append(((kind, s.name), shape.dim))
                costs[(kind, s.name)] = (method.cost(perf, shape), method.broadcast_cost(perf, shape))
        inversion = place(placement, factors, workers, costs=costs)
        preconditioners: dict[str, int] = {}
        if distribute_preconditioning and workers > 1:
            owners = balance_by_cost([s.blocks * preconditioning_cost(s.a_dim, s.g_dim) for s in layers], workers)
            preconditioners = {s.name: rank for s, rank in zip(layers, owners)}
        return cls(inversion, tuple(layers), preconditioners)

    @property
    def workers(self) -> int:
        return self.inversion.world_size

    def preconditioner(self, layer: str) -> int | None:
        """The rank that preconditions ``layer`` (None: every rank does)."""
        return self.preconditioners.get(layer)

    def preconditioned_by_rank(self, names: Sequence[str]) -> list[list[int]]:
        """Indices into ``names`` of the layers each rank preconditions (distributed preconditioning)."""
        owned: list[list[int]] = [[] for _ in range(self.workers)]
        for i, name in enumerate(names):
            owned[self.preconditioners[name]].append(i)
        return owned
