"""The decisions every worker makes alike, and the simulator replays: one implementation of each.

* :func:`fusion_groups`: which factors of a pass are all-reduced together
  (Eq. 15 for ``'optimal'``), from their ready times and sizes;
* :class:`WorkPlan`: who decomposes each factor (and broadcasts it to whom),
  who preconditions each layer (KAISA's gradient workers), and the order of
  the broadcasts;
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
from dataclasses import dataclass, field, replace

from ..kfac.factor_shape import FactorKind, FactorShape
from ..kfac.layers import FACTOR_KINDS, KFACLayer
from ..kfac.methods import DecompositionMethod, get_method
from ..perfmodels import PerfModel
from .factor_fusion import Plan, plan_groups
from .grad_workers import GradWorkerGroups
from .placement import ALL, Assignment, PlacementPlan, balance_by_cost, place, preconditioning_cost

__all__ = [
    "ALL",
    "LayerShape",
    "ResultBroadcast",
    "WorkPlan",
    "fusion_groups",
    "group_launch_times",
    "layer_seconds",
    "overlaps_preconditioning",
    "preconditioning_seconds",
]

#: The dimension at which the inversion curve's per-``d^3`` rate is read (:func:`preconditioning_seconds`).
RATE_DIM = 1024


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
    convolution has ``blocks`` of each, an embedding a diagonal ``A``, and a
    factor wider than ``max_factor_dim`` is diagonal.
    """

    name: str
    a_dim: int
    g_dim: int
    blocks: int = 1
    a_diagonal: bool = False
    g_diagonal: bool = False

    @classmethod
    def of(cls, layer: KFACLayer) -> LayerShape:
        a, g = layer.shape("A"), layer.shape("G")
        return cls(layer.name, a.dim, g.dim, max(a.blocks, g.blocks), a.diagonal, g.diagonal)

    def dim(self, kind: str) -> int:
        return self.a_dim if kind == FactorKind.A else self.g_dim

    def factor_shape(self, kind: str) -> FactorShape:
        if self.a_diagonal if kind == FactorKind.A else self.g_diagonal:
            return FactorShape(self.dim(kind), diagonal=True)
        return FactorShape(self.dim(kind), blocks=self.blocks)


def preconditioning_seconds(perf: PerfModel, method: DecompositionMethod, shape: LayerShape) -> float:
    """Modelled seconds of preconditioning one layer's gradient, every step.

    Its multiply-adds (``g a (g + a)`` per block, a diagonal factor's side
    counting 1 for its dimension, for each of the method's
    :attr:`~spdkfac.kfac.methods.DecompositionMethod.precondition_products`) at
    the fitted inversion curve's rate per ``d^3``: an inversion and a
    ``G grad A`` product are both about ``d^3`` multiply-adds.
    """
    curve = perf.inverse
    rate = max(curve.fitted(RATE_DIM) - curve.fitted(1), 0.0) / RATE_DIM**3
    cost = preconditioning_cost(shape.a_dim, shape.g_dim, shape.a_diagonal, shape.g_diagonal)
    return method.precondition_products * shape.blocks * cost * rate


def layer_seconds(perf: PerfModel, method: DecompositionMethod, shape: LayerShape, inv_update_freq: int) -> float:
    """Modelled seconds per step a layer's gradient workers spend on it: its two decompositions, once per
    ``inv_update_freq`` steps, and its preconditioning, every step (what the layer groups are balanced by)."""
    decompositions = sum(method.cost(perf, shape.factor_shape(kind)) for kind in FACTOR_KINDS)
    return decompositions / inv_update_freq + preconditioning_seconds(perf, method, shape)


@dataclass(frozen=True)
class ResultBroadcast:
    """One fused broadcast of preconditioned gradients: ``root`` sends its group's ``layers`` to ``members``."""

    root: int
    members: tuple[int, ...]  # the ranks taking part, root included
    layers: tuple[str, ...]  # in model order


@dataclass(frozen=True)
class WorkPlan:
    """Who decomposes each factor, who preconditions each layer; identical on every rank.

    ``inversion`` places every factor (Algorithm 1 for ``'lbp'``, Eq. 22 for
    ``'seq'``, everywhere for ``'local'``), costed with the performance model:
    ``inversion.owner(key)`` is the rank that decomposes a factor and
    broadcasts it (or ``ALL``: every rank that holds it decomposes it),
    ``inversion.broadcast_order()`` the order every rank issues the
    broadcasts in. ``groups`` are KAISA's gradient-worker groups
    (:mod:`spdkfac.plan.grad_workers`; None: COMM-OPT, every rank holds every
    decomposition and preconditions every layer); ``layer_groups`` maps a
    layer to its group, whose ranks alone hold its decompositions (each
    factor placed among them). ``native_subgroups``: the engine broadcasts
    to a subset of ranks; without it a group's decompositions are broadcast
    to every rank (the others drop them) and each group's results are sent
    to all from its first rank. ``held_everywhere``: for a method that
    starts each decomposition from the previous one (a warm eigenbasis),
    every rank holds every decomposition (placed over all ranks, as
    COMM-OPT) and the groups split only the preconditioning.
    """

    inversion: PlacementPlan
    layers: tuple[LayerShape, ...]
    layer_groups: dict[str, int] = field(default_factory=dict)
    groups: GradWorkerGroups | None = None
    native_subgroups: bool = False
    held_everywhere: bool = False

    @classmethod
    def make(
        cls,
        layers: Sequence[LayerShape],
        workers: int,
        perf: PerfModel,
        placement: str,
        compute_method: str | DecompositionMethod,
        distribute_preconditioning: bool = False,
        *,
        grad_workers: int | None = None,
        native_subgroups: bool = False,
        inv_update_freq: int = 1,
    ) -> WorkPlan:
        """The plan for ``layers`` (in model order) on ``workers`` workers with ``grad_workers`` per layer.

        ``perf`` must already describe this worker count
        (:meth:`~spdkfac.perfmodels.PerfModel.scaled_to`). Each factor is one
        task (a grouped layer's blocks are decomposed in one batched call and
        sent as one buffer), costed by the compute method
        (:meth:`~spdkfac.kfac.methods.DecompositionMethod.cost`). ``grad_workers``
        None means all (COMM-OPT), or one with ``distribute_preconditioning``
        (MEM-OPT, its old name). Layers go to groups balanced by the work a
        group does for them per step (:func:`layer_seconds`: decompositions
        every ``inv_update_freq`` steps, preconditioning every step); inside a
        group the factors are placed by ``placement`` among its ranks, costed
        with broadcasts to the group.
        """
        method = get_method(compute_method)
        if grad_workers is None:
            grad_workers = 1 if distribute_preconditioning else workers
        groups = GradWorkerGroups(workers, grad_workers)
        if groups.everyone_holds_everything:
            return cls(_place_factors(layers, workers, perf, placement, method, None), tuple(layers))
        if method.starts_from_previous:
            # The previous decomposition must be where the next is made, and in a checkpoint: all hold all.
            group_of = balance_by_cost([preconditioning_seconds(perf, method, s) for s in layers], groups.count)
            inversion = _place_factors(layers, workers, perf, placement, method, None)
            layer_groups = {s.name: g for s, g in zip(layers, group_of)}
            return cls(inversion, tuple(layers), layer_groups, groups, native_subgroups, held_everywhere=True)
        group_of = balance_by_cost([layer_seconds(perf, method, s, inv_update_freq) for s in layers], groups.count)
        in_group = perf.scaled_to(grad_workers) if native_subgroups else perf
        assignments: list[Assignment] = []
        for k in range(groups.count):
            members = groups.members(k)
            mine = [s for s, g in zip(layers, group_of) if g == k]
            local = _place_factors(mine, grad_workers, in_group, placement, method, members)
            assignments += local.assignments
        inversion = PlacementPlan(placement, workers, assignments)
        layer_groups = {s.name: g for s, g in zip(layers, group_of)}
        return cls(inversion, tuple(layers), layer_groups, groups, native_subgroups)

    @property
    def workers(self) -> int:
        return self.inversion.world_size

    @property
    def grad_workers(self) -> int:
        """Gradient workers per layer (``P`` for COMM-OPT)."""
        return self.groups.grad_workers if self.groups is not None else self.workers

    @property
    def grad_worker_fraction(self) -> float:
        return self.grad_workers / self.workers

    def gradient_workers(self, layer: str) -> tuple[int, ...]:
        """The ranks that precondition ``layer`` (and hold its decompositions, as every rank does if :attr:`held_everywhere`)."""
        if self.groups is None:
            return tuple(range(self.workers))
        return self.groups.members(self.layer_groups[layer])

    def holders(self, layer: str) -> tuple[int, ...]:
        """The ranks that keep ``layer``'s decompositions: its gradient workers, or every rank."""
        return tuple(range(self.workers)) if self.held_everywhere else self.gradient_workers(layer)

    def holds(self, rank: int, layer: str) -> bool:
        """Whether ``rank`` keeps ``layer``'s decompositions (it may precondition it only if a gradient worker of it)."""
        return rank in self.holders(layer)

    @property
    def preconditioners(self) -> dict[str, int]:
        """MEM-OPT's one preconditioning rank per layer (empty for any other fraction)."""
        if self.groups is None or self.groups.grad_workers != 1:
            return {}
        return {name: self.groups.members(k)[0] for name, k in self.layer_groups.items()}

    def preconditioner(self, layer: str) -> int | None:
        """The one rank that preconditions ``layer`` in MEM-OPT (None otherwise)."""
        return self.preconditioners.get(layer)

    def result_broadcasts(self, names: Sequence[str]) -> list[ResultBroadcast]:
        """The fused broadcasts of preconditioned gradients for the layers ``names``, in the order every rank issues them.

        With sub-group broadcasts: for each group and each position ``j`` in
        it, the member at ``j`` sends the group's layers to the receiver
        group ``j`` (none for COMM-OPT). Without: each group's first rank
        sends them to every rank.
        """
        if self.groups is None:
            return []
        out: list[ResultBroadcast] = []
        everyone = tuple(range(self.workers))
        for k in range(self.groups.count):
            layers = tuple(n for n in names if self.layer_groups[n] == k)
            if not layers:
                continue
            members = self.groups.members(k)
            if not self.native_subgroups:
                out.append(ResultBroadcast(members[0], everyone, layers))
                continue
            for j, root in enumerate(members):
                receivers = self.groups.receivers(j)
                if len(receivers) > 1:
                    out.append(ResultBroadcast(root, receivers, layers))
        return out

    def preconditioning_ranks(self, layer: str) -> tuple[int, ...]:
        """The ranks that compute ``layer``'s preconditioned gradient (and keep a method's per-layer state of it): every
        rank, its gradient workers, or without sub-group broadcasts its group's first rank alone."""
        broadcasts = self.result_broadcasts([layer])
        return tuple(range(self.workers)) if not broadcasts else tuple(sorted({b.root for b in broadcasts}))

    def preconditioned_here(self, rank: int, names: Sequence[str]) -> list[str]:
        """The layers of ``names`` that ``rank`` preconditions itself (the rest it receives)."""
        broadcasts = self.result_broadcasts(names)
        if not broadcasts:
            return list(names)
        return [n for b in broadcasts if b.root == rank for n in b.layers]


def _place_factors(
    layers: Sequence[LayerShape],
    workers: int,
    perf: PerfModel,
    placement: str,
    method: DecompositionMethod,
    members: tuple[int, ...] | None,
) -> PlacementPlan:
    """``placement`` of the layers' factors over ``workers`` ranks; with ``members``, those ranks (local index -> rank)."""
    factors: list[tuple[Hashable, int]] = []
    costs: dict[Hashable, tuple[float, float]] = {}
    for s in layers:
        for kind in FACTOR_KINDS:
            shape = s.factor_shape(kind)
            factors.append(((kind, s.name), shape.dim))
            costs[(kind, s.name)] = (method.cost(perf, shape), method.broadcast_cost(perf, shape))
    plan = place(placement, factors, workers, costs=costs)
    if members is None:
        return plan
    return PlacementPlan(
        plan.strategy,
        workers,
        [replace(a, owner=a.owner if a.owner == ALL else members[a.owner], members=members) for a in plan.assignments],
    )
