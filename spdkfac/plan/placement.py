"""Where each factor inversion runs (paper Section IV-B, Algorithm 1).

A placement answers one question per factor: which rank inverts it and
broadcasts the (upper-triangular) inverse, or ``ALL`` when every rank inverts
it locally (a *non-communicated tensor*). The solvers are pure functions over
``(key, dim)`` lists and cost callables, so they are tested for any world
size without processes.

* ``lbp``   (SPD-KFAC): Algorithm 1. Factors sorted by dimension, descending;
  a factor whose modelled inversion is cheaper than its modelled broadcast is
  inverted everywhere; otherwise it goes to the least-loaded rank. Load is
  measured in *modelled seconds* (inversion + broadcast for an owned factor,
  inversion for a local one) rather than the paper's ``d``: seconds are what
  the makespan (Eq. 21) adds up, and they stay correct when inversion grows
  faster than the broadcast (cubic vs quadratic in ``d``). As a safeguard the
  solver also evaluates the sequential placement and keeps it in the rare
  case the greedy makespan is predicted worse.
* ``seq``   (MPD-KFAC, Eq. 22): round-robin in model order, all broadcast.
* ``local`` (D-KFAC): every rank inverts everything, nothing is broadcast.

:func:`balance_by_cost` places whole layers instead of factors: each layer to a
group of gradient workers (KAISA, :mod:`spdkfac.plan.grad_workers`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

from ..options import Option

__all__ = [
    "ALL",
    "Assignment",
    "Placement",
    "PlacementPlan",
    "balance_by_cost",
    "place",
    "place_lbp",
    "place_local",
    "place_seq",
    "preconditioning_cost",
]

ALL = -1  # owner value of a factor every rank inverts


class Placement(Option):
    """Who decomposes each factor (``placement``)."""

    LBP = "lbp"  # Algorithm 1: load-balanced owners, or every rank where broadcasting costs more
    SEQ = "seq"  # MPD-KFAC's Eq. (22): owners in turn
    LOCAL = "local"  # D-KFAC: every rank decomposes every factor


CostFn = Callable[[int], float]
#: Modelled (decomposition, broadcast) seconds per factor key, where the costs depend on more than the dimension.
Costs = Mapping[Hashable, tuple[float, float]]
CostOf = Callable[[Hashable, int], tuple[float, float]]


def _cost_of(t_comp: CostFn | None, t_comm: CostFn | None, costs: Costs | None) -> CostOf:
    """``(key, dim) -> (t_comp, t_comm)``: from ``costs`` by key if given, else the cost functions of the dimension."""
    if costs is not None:
        table = costs
        return lambda key, dim: table[key]
    if t_comp is None or t_comm is None:
        raise TypeError("pass the cost functions t_comp and t_comm, or costs by factor key")
    comp, comm = t_comp, t_comm
    return lambda key, dim: (comp(dim), comm(dim))


@dataclass(frozen=True)
class Assignment:
    """One factor's placement and its modelled costs (seconds)."""

    key: Hashable
    dim: int
    owner: int  # rank, or ALL
    t_comp: float
    t_comm: float
    #: The ranks that hold the result (the layer's gradient workers); None: every rank.
    members: tuple[int, ...] | None = None

    @property
    def is_local(self) -> bool:
        return self.owner == ALL

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` keeps this factor's decomposition."""
        return self.members is None or rank in self.members

    def computes(self, rank: int) -> bool:
        """Whether ``rank`` decomposes this factor (its owner, or every holder of a local one)."""
        return self.owner == rank or (self.owner == ALL and self.holds(rank))


class PlacementPlan:
    """The placement of every factor; identical on every rank."""

    def __init__(self, strategy: str, world_size: int, assignments: Sequence[Assignment]) -> None:
        self.strategy = strategy
        self.world_size = world_size
        self.assignments: list[Assignment] = list(assignments)
        self._by_key: dict[Hashable, Assignment] = {a.key: a for a in self.assignments}

    def owner(self, key: Hashable) -> int:
        """Rank that inverts ``key``, or :data:`ALL`."""
        return self._by_key[key].owner

    def broadcast_order(self) -> list[Assignment]:
        """The order in which every rank issues the broadcasts of owned factors.

        Round ``k`` holds each rank's ``k``-th owned factor, so an owner issues
        its broadcast right after inverting the factor, and the order is the
        same on every rank (required by torch.distributed).
        """
        per_rank = [[a for a in self.assignments if a.owner == r] for r in range(self.world_size)]
        order: list[Assignment] = []
        for k in range(max((len(p) for p in per_rank), default=0)):
            for p in per_rank:
                if k < len(p):
                    order.append(p[k])
        return order

    def makespans(self) -> list[float]:
        """Modelled time for each rank to hold every inverse (Eq. 21)."""
        spans = [0.0] * self.world_size
        for a in self.assignments:
            if a.owner == ALL:
                for r in range(self.world_size):
                    spans[r] += a.t_comp if a.holds(r) else 0.0
            else:
                spans[a.owner] += a.t_comp + (a.t_comm if self.world_size > 1 else 0.0)
        return spans

    @property
    def makespan(self) -> float:
        return max(self.makespans(), default=0.0)

    def table(self, key_format: Callable[[Hashable], str] = str) -> str:
        """A printable table: factor, dimension, owner, modelled times, makespans."""
        lines = [f"placement '{self.strategy}' on {self.world_size} worker(s)"]
        lines.append(f"{'factor':<40} {'dim':>6} {'owner':>6} {'t_inv(ms)':>10} {'t_bcast(ms)':>11}")
        for a in self.assignments:
            owner = "all" if a.owner == ALL else str(a.owner)
            lines.append(f"{key_format(a.key):<40} {a.dim:>6} {owner:>6} {a.t_comp * 1e3:>10.3f} {a.t_comm * 1e3:>11.3f}")
        spans = ", ".join(f"rank {r}: {s * 1e3:.2f} ms" for r, s in enumerate(self.makespans()))
        lines.append(f"predicted makespan: {spans} (max {self.makespan * 1e3:.2f} ms)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n_local = sum(a.is_local for a in self.assignments)
        return (
            f"PlacementPlan({self.strategy!r}, world_size={self.world_size}, factors={len(self.assignments)}, "
            f"local={n_local}, makespan={self.makespan * 1e3:.2f} ms)"
        )


def _validate(factors: Sequence[tuple[Hashable, int]], world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    keys = [k for k, _ in factors]
    if len(set(keys)) != len(keys):
        raise ValueError("factor keys must be unique")
    for k, d in factors:
        if d < 1:
            raise ValueError(f"factor {k!r} has invalid dimension {d}")


Factors = Sequence[tuple[Hashable, int]]


def place_local(
    factors: Factors, world_size: int, t_comp: CostFn | None = None, t_comm: CostFn | None = None, costs: Costs | None = None
) -> PlacementPlan:
    """D-KFAC: every rank inverts every factor."""
    _validate(factors, world_size)
    cost = _cost_of(t_comp, t_comm, costs)
    return PlacementPlan("local", world_size, [Assignment(k, d, ALL, *cost(k, d)) for k, d in factors])


def place_seq(
    factors: Factors, world_size: int, t_comp: CostFn | None = None, t_comm: CostFn | None = None, costs: Costs | None = None
) -> PlacementPlan:
    """MPD-KFAC (Eq. 22): factor ``i`` (model order) goes to rank ``i % P``; all are broadcast."""
    _validate(factors, world_size)
    if world_size == 1:
        return place_local(factors, world_size, t_comp, t_comm, costs)
    cost = _cost_of(t_comp, t_comm, costs)
    return PlacementPlan("seq", world_size, [Assignment(k, d, i % world_size, *cost(k, d)) for i, (k, d) in enumerate(factors)])


def _algorithm1(factors: Factors, world_size: int, cost: CostOf) -> PlacementPlan:
    load = [0.0] * world_size
    order = sorted(range(len(factors)), key=lambda i: (-factors[i][1], i))  # stable: ties keep model order
    out: list[Assignment] = []
    for i in order:
        key, dim = factors[i]
        comp, comm = cost(key, dim)
        if comp < comm:
            out.append(Assignment(key, dim, ALL, comp, comm))
            for r in range(world_size):
                load[r] += comp
        else:
            p = min(range(world_size), key=lambda r: (load[r], r))
            out.append(Assignment(key, dim, p, comp, comm))
            load[p] += comp + comm
    return PlacementPlan("lbp", world_size, out)


def place_lbp(
    factors: Factors, world_size: int, t_comp: CostFn | None = None, t_comm: CostFn | None = None, costs: Costs | None = None
) -> PlacementPlan:
    """SPD-KFAC's load-balancing placement (Algorithm 1), never predicted worse than ``seq``."""
    _validate(factors, world_size)
    if world_size == 1:
        plan = place_local(factors, world_size, t_comp, t_comm, costs)
        plan.strategy = "lbp"
        return plan
    plan = _algorithm1(factors, world_size, _cost_of(t_comp, t_comm, costs))
    seq = place_seq(factors, world_size, t_comp, t_comm, costs)
    if seq.makespan < plan.makespan:
        return PlacementPlan("lbp", world_size, sorted(seq.assignments, key=lambda a: -a.dim))
    return plan


def place(
    strategy: str,
    factors: Factors,
    world_size: int,
    t_comp: CostFn | None = None,
    t_comm: CostFn | None = None,
    costs: Costs | None = None,
) -> PlacementPlan:
    """Dispatch to ``place_<strategy>`` (a :class:`Placement` or its string).

    Costs come from ``t_comp(dim)`` / ``t_comm(dim)``, or from ``costs`` by
    factor key (a block-diagonal or diagonal factor costs more, or less,
    than its block dimension says).
    """
    solvers: dict[Placement, Callable[..., PlacementPlan]] = {
        Placement.LBP: place_lbp,
        Placement.SEQ: place_seq,
        Placement.LOCAL: place_local,
    }
    return solvers[Placement.parse("placement", strategy)](factors, world_size, t_comp, t_comm, costs)


def preconditioning_cost(a_dim: int, g_dim: int, a_diagonal: bool = False, g_diagonal: bool = False) -> float:
    """Relative cost of ``G_inv @ grad @ A_inv`` for a ``g_dim x a_dim`` gradient (half its matmul flops); a diagonal
    factor scales the gradient, one product per element."""
    return float(g_dim * a_dim * ((1 if g_diagonal else g_dim) + (1 if a_diagonal else a_dim)))


def balance_by_cost(costs: Sequence[float], world_size: int) -> list[int]:
    """Rank for each item so that the largest per-rank total cost is small (greedy, largest first).

    Deterministic (ties go to the lower index and the lower rank), so every
    worker computes the same assignment without communicating.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(not c >= 0 for c in costs):
        raise ValueError("costs must be non-negative numbers")
    load = [0.0] * world_size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner
