"""The inversion stage: every rank ends up holding every damped inverse.

Follows a :class:`~spdkfac.placement.PlacementPlan`: an owner inverts its
factors, largest first, and starts an asynchronous broadcast of each inverse's
upper triangle right after computing it, so the broadcast overlaps its next
inversion; the others post the matching receive at once. Factors placed on
``ALL`` are then inverted locally while the broadcasts are in flight.
Broadcasts are issued in :meth:`PlacementPlan.broadcast_order` on every rank,
which torch.distributed requires.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

from .comm import CommBackend, Handle
from .linalg import invert_spd, pack_upper, triangle_size, unpack_upper
from .placement import ALL, PlacementPlan
from .timeline import IterationRecord, Timeline

__all__ = ["compute_inverses"]

Inverter = Callable[[Hashable, torch.Tensor], torch.Tensor]


def compute_inverses(
    plan: PlacementPlan,
    factors: Dict[Hashable, torch.Tensor],
    damping: float,
    backend: CommBackend,
    record: Optional[IterationRecord] = None,
    invert: Optional[Inverter] = None,
) -> Dict[Hashable, torch.Tensor]:
    """Return ``{key: (factor + damping*I)^-1}`` for every factor in ``plan``, on every rank.

    Args:
        plan: who inverts what (identical on every rank).
        factors: the (already averaged, identical) factors by key, as full
            matrices or packed upper triangles (a packed one is unpacked only
            on the rank that inverts it).
        damping: Tikhonov damping.
        backend: communication engine.
        record: timeline record to charge the stage and its blocking wait to.
        invert: ``(key, matrix) -> inverse``; defaults to :func:`invert_spd`
            (the optimizer passes one that names the layer in its errors).
    """
    inv_fn: Inverter = invert or (lambda key, m: invert_spd(m, damping))
    rank = backend.rank
    t0 = Timeline.now() if record is not None else 0.0
    out: Dict[Hashable, torch.Tensor] = {}
    pending: List[Tuple[Handle, torch.Tensor, Hashable, int, int]] = []
    for a in plan.broadcast_order():
        ref = factors[a.key]
        if a.owner == rank:
            out[a.key] = inv_fn(a.key, _full(ref, a.dim))
            packed = pack_upper(out[a.key])
        else:
            packed = torch.empty(triangle_size(a.dim), dtype=ref.dtype, device=ref.device)
        handle = backend.broadcast_async(packed, a.owner, f"spdkfac.inverse.{a.key}")
        pending.append((handle, packed, a.key, a.owner, a.dim))
    for a in plan.assignments:
        if a.owner == ALL:
            out[a.key] = inv_fn(a.key, _full(factors[a.key], a.dim))
    t_wait = Timeline.now() if record is not None else 0.0
    for handle, packed, key, owner, dim in pending:
        handle.wait()
        if owner != rank:
            out[key] = unpack_upper(packed, dim)
    if record is not None:
        t1 = Timeline.now()
        record.inverse_wait += t1 - t_wait
        record.inverse_stage += t1 - t0
    return out


def _full(factor: torch.Tensor, dim: int) -> torch.Tensor:
    """The full symmetric matrix of a factor given full or as its packed upper triangle."""
    return factor if factor.dim() == 2 else unpack_upper(factor, dim)
