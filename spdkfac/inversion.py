"""The decomposition stage: every rank ends up holding every factor's inverse (or eigendecomposition).

Follows a :class:`~spdkfac.placement.PlacementPlan`: an owner decomposes its
factors, largest first, and starts an asynchronous broadcast of each result
right after computing it, so the broadcast overlaps its next decomposition;
the others post the matching receive at once. Factors placed on ``ALL`` are
then decomposed locally while the broadcasts are in flight. Broadcasts are
issued in :meth:`PlacementPlan.broadcast_order` on every rank, which
torch.distributed requires.

What travels is :func:`~spdkfac.decomposition.payload_size` elements per
factor: an inverse's upper triangle (:func:`compute_inverses`), or an
eigendecomposition's ``Q`` and ``d`` in one buffer (:func:`compute_eigen`),
which every rank, owner included, keeps as views into that buffer.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch

from .comm import CommBackend, Handle
from .decomposition import Eigen, eigen_payload, payload_size, unpack_eigen
from .linalg import invert_spd, pack_upper, unpack_upper
from .placement import ALL, PlacementPlan
from .timeline import IterationRecord, Timeline

__all__ = ["compute_inverses", "compute_eigen"]

Inverter = Callable[[Hashable, torch.Tensor], torch.Tensor]
Decomposer = Callable[[Hashable, torch.Tensor], torch.Tensor]


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

    def owned(key: Hashable, matrix: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        inverse = inv_fn(key, matrix)
        return inverse, pack_upper(inverse)

    return _stage(plan, factors, backend, record, "inverse", owned, inv_fn, unpack_upper)


def compute_eigen(
    plan: PlacementPlan,
    factors: Dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: Optional[IterationRecord] = None,
    decompose: Optional[Decomposer] = None,
) -> Dict[Hashable, Eigen]:
    """Return ``{key: Eigen(Q, d)}`` of every factor in ``plan``, bit-identical on every rank.

    ``decompose`` is ``(key, matrix) -> flat [Q, d] buffer``, defaulting to
    :func:`~spdkfac.decomposition.eigen_payload` (the optimizer passes one that
    names the layer in its errors). The damping is applied when
    preconditioning, so none is taken here.
    """
    dec_fn: Decomposer = decompose or (lambda key, m: eigen_payload(m))

    def owned(key: Hashable, matrix: torch.Tensor) -> Tuple[Eigen, torch.Tensor]:
        buffer = dec_fn(key, matrix)
        return unpack_eigen(buffer, matrix.shape[0]), buffer  # kept as sent: the receivers' layout exactly

    return _stage(plan, factors, backend, record, "eigen", owned,
                  lambda key, matrix: unpack_eigen(dec_fn(key, matrix), matrix.shape[0]), unpack_eigen)


def _stage(
    plan: PlacementPlan,
    factors: Dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: Optional[IterationRecord],
    method: str,
    owned: Callable[[Hashable, torch.Tensor], Tuple[Any, torch.Tensor]],
    local: Callable[[Hashable, torch.Tensor], Any],
    received: Callable[[torch.Tensor, int], Any],
) -> Dict[Hashable, Any]:
    """Run the stage: ``owned`` gives (kept, flat payload), ``local`` the kept value, ``received`` unpacks a payload."""
    rank = backend.rank
    t0 = Timeline.now() if record is not None else 0.0
    out: Dict[Hashable, Any] = {}
    pending: List[Tuple[Handle, torch.Tensor, Hashable, int, int]] = []
    for a in plan.broadcast_order():
        ref = factors[a.key]
        if a.owner == rank:
            out[a.key], payload = owned(a.key, _full(ref, a.dim))
        else:
            payload = torch.empty(payload_size(method, a.dim), dtype=ref.dtype, device=ref.device)
        handle = backend.broadcast_async(payload, a.owner, f"spdkfac.{method}.{a.key}")
        pending.append((handle, payload, a.key, a.owner, a.dim))
    for a in plan.assignments:
        if a.owner == ALL:
            out[a.key] = local(a.key, _full(factors[a.key], a.dim))
    t_wait = Timeline.now() if record is not None else 0.0
    for handle, payload, key, owner, dim in pending:
        handle.wait()
        if owner != rank:
            out[key] = received(payload, dim)
    if record is not None:
        t1 = Timeline.now()
        record.inverse_wait += t1 - t_wait
        record.inverse_stage += t1 - t0
    return out


def _full(factor: torch.Tensor, dim: int) -> torch.Tensor:
    """The full symmetric matrix of a factor given full or as its packed upper triangle."""
    return factor if factor.dim() == 2 else unpack_upper(factor, dim)
