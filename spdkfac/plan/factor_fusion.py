"""Which Kronecker factors to fuse into one all-reduce (paper Eq. 14-15).

Pure functions over plain lists, so every policy is unit-tested without any
process. A *plan* is a list of groups; each group is a list of factor
positions in the order the factors become ready (forward order for A,
backward order for G), and is all-reduced as one fused buffer as soon as its
last member is ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from ..options import Option

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "FusionPolicy",
    "plan_groups",
    "plan_layerwise",
    "plan_naive",
    "plan_optimal",
    "plan_threshold",
    "serve_in_order",
    "simulate_plan",
]


class FusionPolicy(Option):
    """How the factor all-reduces are grouped (``fusion``)."""

    OPTIMAL = "optimal"  # Eq. (15), from measured ready times
    THRESHOLD = "threshold"  # fill a buffer of fusion_threshold_bytes
    LAYERWISE = "layerwise"  # no fusion
    NAIVE = "naive"  # one all-reduce per pass


#: The ``'threshold'`` policy's buffer size unless configured (the optimizer's and the simulator's default).
DEFAULT_THRESHOLD_BYTES = 64 * 1024 * 1024

Plan = list[list[int]]


def _check(ready_times: Sequence[float], sizes: Sequence[int]) -> None:
    if len(ready_times) != len(sizes):
        raise ValueError(f"{len(ready_times)} ready times but {len(sizes)} sizes")
    if any(b < a for a, b in zip(ready_times, ready_times[1:])):
        raise ValueError("ready_times must be non-decreasing (factors in the order they become ready)")
    if any(s < 0 for s in sizes):
        raise ValueError("sizes must be non-negative")


def plan_optimal(ready_times: Sequence[float], sizes: Sequence[int], alpha: float, beta: float) -> Plan:
    """The MG-WFBP merge rule of Eq. (15), applied greedily in readiness order.

    The current group's all-reduce can start at ``start = max(ready of its last
    member, end of the previous all-reduce)``. The next factor joins the group
    when that makes the next factor's communication finish strictly earlier,
    which is exactly Eq. (15): ``ready_next < start + alpha`` (with ``alpha >
    0``; at ``alpha == 0`` merging never helps, so nothing is merged).

    Args:
        ready_times: time at which each factor is computed, non-decreasing.
        sizes: number of elements each factor sends (upper triangle).
        alpha, beta: all-reduce model ``t(m) = alpha + beta * m``.
    """
    _check(ready_times, sizes)
    if alpha < 0 or beta < 0:
        raise ValueError("alpha and beta must be non-negative")
    if not sizes:
        return []
    groups: Plan = []
    current = [0]
    current_size = sizes[0]
    comm_free = 0.0  # when the engine finishes the previously launched group
    for i in range(1, len(sizes)):
        start = max(ready_times[current[-1]], comm_free)
        merged_end = max(ready_times[i], start) + alpha + beta * (current_size + sizes[i])
        separate_end = max(ready_times[i], start + alpha + beta * current_size) + alpha + beta * sizes[i]
        if merged_end < separate_end:
            current.append(i)
            current_size += sizes[i]
        else:
            groups.append(current)
            comm_free = start + alpha + beta * current_size
            current = [i]
            current_size = sizes[i]
    groups.append(current)
    return groups


def plan_threshold(sizes: Sequence[int], threshold_bytes: int, element_size: int = 4) -> Plan:
    """Horovod-style fusion: consecutive factors share a buffer up to ``threshold_bytes``.

    A single factor larger than the threshold travels alone.
    """
    if threshold_bytes <= 0:
        raise ValueError("threshold_bytes must be positive")
    groups: Plan = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        nbytes = size * element_size
        if current and used + nbytes > threshold_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    if current:
        groups.append(current)
    return groups


def plan_layerwise(count: int) -> Plan:
    """No fusion: every factor is its own all-reduce, launched as soon as it is ready."""
    return [[i] for i in range(count)]


def plan_naive(count: int) -> Plan:
    """All factors of a pass in one all-reduce, launched after the last one is computed."""
    return [list(range(count))] if count else []


def plan_groups(
    policy: str,
    ready_times: Sequence[float],
    sizes: Sequence[int],
    alpha: float,
    beta: float,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    element_size: int = 4,
) -> Plan:
    """Dispatch to the planner of ``policy`` (a :class:`FusionPolicy` or its string)."""
    policy = FusionPolicy.parse("fusion", policy)
    if policy is FusionPolicy.OPTIMAL:
        return plan_optimal(ready_times, sizes, alpha, beta)
    if policy is FusionPolicy.THRESHOLD:
        return plan_threshold(sizes, threshold_bytes, element_size)
    if policy is FusionPolicy.LAYERWISE:
        return plan_layerwise(len(sizes))
    return plan_naive(len(sizes))


def serve_in_order(launches: Sequence[tuple[float, int]], cost: Callable[[int], float]) -> list[float]:
    """End time of each launch ``(time, elements)`` on one communication engine, served in the given order.

    The one queue model of the planner and the simulator: a launch starts
    when it is made and the engine has finished the previous one, and takes
    ``cost(elements)`` (``alpha + beta*m`` for an all-reduce).
    """
    ends: list[float] = []
    free = 0.0
    for at, elements in launches:
        free = max(free, at) + cost(elements)
        ends.append(free)
    return ends


def simulate_plan(plan: Plan, ready_times: Sequence[float], sizes: Sequence[int], alpha: float, beta: float) -> tuple[float, float]:
    """Predicted (communication end, non-overlapped communication) of a plan.

    Communication runs one group at a time (:func:`serve_in_order`); a group
    starts once its last member is ready and the engine is free. The
    non-overlapped part is how far communication runs past the last factor's
    readiness.
    """
    _check(ready_times, sizes)
    launches = [(ready_times[group[-1]], sum(sizes[i] for i in group)) for group in plan]
    ends = serve_in_order(launches, lambda m: alpha + beta * m)
    comm_free = ends[-1] if ends else 0.0
    last_ready = ready_times[-1] if ready_times else 0.0
    return comm_free, max(0.0, comm_free - last_ready)
