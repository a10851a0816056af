"""KAISA's gradient workers (Pauloski et al., SC'21, Section 3.1): who holds a layer's decompositions.

With ``g = grad_worker_fraction * P`` gradient workers per layer, the ``P``
ranks split into ``P / g`` *gradient-worker groups* of ``g`` consecutive
ranks (group ``k``: ranks ``k*g ... k*g + g - 1``). Each layer belongs to
one group: its factors are decomposed inside the group (one owner per
factor, placed by LBP among the group's ranks) and broadcast only to the
group, whose members precondition the layer. Every rank outside the group
receives the preconditioned gradient from the group member at its own
position ``j = rank % g``: the *receiver group* of position ``j`` is the
ranks ``j, j + g, j + 2g, ...``, holding exactly one member of every
gradient-worker group. ``g = P`` is COMM-OPT (every rank holds everything,
nothing preconditioned is broadcast); ``g = 1`` is MEM-OPT (each layer's
decompositions live on one rank, which broadcasts its result to all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["GradWorkerFraction", "GradWorkerGroups", "grad_worker_count", "valid_fractions"]

#: A fraction in ``(0, 1]`` or ``'auto'`` (chosen from the performance model, :mod:`spdkfac.plan.grad_worker_choice`).
GradWorkerFraction = Union[float, Literal["auto"]]


def valid_fractions(workers: int) -> list[float]:
    """The fractions that give whole groups at ``workers`` workers: ``d / P`` for every divisor ``d`` of ``P``."""
    return [d / workers for d in range(1, workers + 1) if workers % d == 0]


def grad_worker_count(fraction: float, workers: int) -> int:
    """Gradient workers per layer, ``max(1, fraction * P)``; a ValueError unless that is a divisor of ``P``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"grad_worker_fraction must be a number in (0, 1] or 'auto', got {fraction!r}")
    exact = float(fraction) * workers
    count = max(1, round(exact))
    if (exact >= 1.0 and abs(exact - count) > 1e-6) or workers % count:
        choices = ", ".join(f"{f:g}" for f in valid_fractions(workers))
        raise ValueError(
            f"grad_worker_fraction={fraction!r} gives {exact:g} gradient workers per layer at {workers} workers; "
            f"it must be a whole divisor of the worker count: one of {choices} (or 'auto')"
        )
    return count


@dataclass(frozen=True)
class GradWorkerGroups:
    """The gradient-worker groups and receiver groups of ``workers`` ranks with ``grad_workers`` per layer."""

    workers: int
    grad_workers: int

    def __post_init__(self) -> None:
        if self.workers < 1 or not 1 <= self.grad_workers <= self.workers or self.workers % self.grad_workers:
            raise ValueError(f"{self.grad_workers} gradient workers per layer do not divide {self.workers} workers into groups")

    @property
    def count(self) -> int:
        """Number of gradient-worker groups."""
        return self.workers // self.grad_workers

    @property
    def fraction(self) -> float:
        return self.grad_workers / self.workers

    def members(self, group: int) -> tuple[int, ...]:
        """The ranks of gradient-worker group ``group``."""
        return tuple(range(group * self.grad_workers, (group + 1) * self.grad_workers))

    def group_of(self, rank: int) -> int:
        return rank // self.grad_workers

    def receivers(self, position: int) -> tuple[int, ...]:
        """The ranks at ``position`` of every group: each gets a layer's result from that group's member there."""
        return tuple(range(position, self.workers, self.grad_workers))

    @property
    def everyone_holds_everything(self) -> bool:
        """COMM-OPT: one group of all ranks."""
        return self.grad_workers == self.workers
