"""A checkpoint's decompositions gathered on one rank: every worker's, so that a resume recomputes none of them.

With ``grad_worker_fraction`` below 1 (or ``distribute_preconditioning``)
each worker keeps the decompositions of its own layers only, so one
worker's ``state_dict()`` lacks the others', and a resume from it
recomputes them all from the running factors at its first step: one early
refresh, not the uninterrupted run. :func:`gather_decompositions` sends the
saving rank what it lacks, one factor at a time (each as its method's
payload, the form the decomposition stage broadcasts, rebuilt bitwise), and
keeps them in host memory: the device holds one factor's payload more, never
every layer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm import CommBackend
from ..kfac.layers import FACTOR_KINDS, KFACLayer

__all__ = ["gather_decompositions"]


def gather_decompositions(
    layers: Sequence[KFACLayer], holders: Callable[[str], Sequence[int]], to: int, backend: CommBackend
) -> dict[str, dict[str, Any]]:
    """Collective: the checkpoint entries (``{'A_inv': ..., 'G_inv': ...}`` per layer name, on the CPU) of the
    decompositions rank ``to`` does not hold, on rank ``to``; ``{}`` on the others.

    ``holders(name)`` are the ranks holding a layer's decompositions, the same
    on every rank; the first of them sends. Every rank takes part in the same
    broadcasts, in layer order.
    """
    if not 0 <= to < backend.size:
        raise ValueError(f"to={to} is not a rank of this job ({backend.size} workers)")
    wanted = [layer for layer in layers if layer.preconditions and to not in holders(layer.name)]
    if not wanted:
        return {}
    # Decompositions dropped by a load from an incomplete checkpoint are recomputed by every worker at the next
    # step: none to send then, and the holders alone know it.
    lacking = sum(not layer.decomposed for layer in layers if layer.preconditions and backend.rank in holders(layer.name))
    if any(values[0] for values in backend.gather_values([float(lacking)], "spdkfac.checkpoint.lacking")):
        return {}
    gathered: dict[str, dict[str, Any]] = {}
    for layer in wanted:
        ranks = holders(layer.name)
        method, source = layer.method, ranks[0]
        entry: dict[str, Any] = {}
        for kind in FACTOR_KINDS:
            shape, factor = layer.shape(kind), layer.packed_factor(kind)
            assert factor is not None  # (decomposed on its holders: every rank holds the running factors)
            if backend.rank == source:
                payload = method.payload(layer.decomposition(kind), shape).contiguous()
            else:
                payload = torch.empty(method.payload_size(shape), dtype=factor.dtype, device=factor.device)
            backend.broadcast_async(payload, source, f"spdkfac.checkpoint.{kind}.{layer.name}").wait()
            if backend.rank == to:
                entry[f"{kind}{method.suffix}"] = method.save(method.received(payload.cpu(), shape))
        gathered[layer.name] = entry
    return gathered if backend.rank == to else {}
