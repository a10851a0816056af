"""A checkpoint's decompositions gathered on one rank: every worker's, so that a resume recomputes none of them.

With ``grad_worker_fraction`` below 1 (or ``distribute_preconditioning``)
each worker keeps the decompositions of its own layers only, so one
worker's ``state_dict()`` lacks the others', and a resume from it
recomputes them all from the running factors at its first step: one early
refresh, not the uninterrupted run. :func:`gather_decompositions` sends the
saving rank what it lacks, one factor at a time (each as its method's
payload, the form the decomposition stage broadcasts, rebuilt bitwise), and
keeps them in host memory: the device holds one factor's payload more, never
every layer's. :func:`gather_method_states` does the same for a method's
per-layer state (EKFAC's scaling), kept only where the layer is
preconditioned: that one cannot be recomputed, so a checkpoint without it is
refused.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm import CommBackend
from ..kfac.layers import FACTOR_KINDS, KFACLayer

__all__ = ["gather_decompositions", "gather_method_states"]


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


def gather_method_states(
    layers: Sequence[KFACLayer], keepers: Callable[[str], Sequence[int]], to: int, backend: CommBackend
) -> dict[str, dict[str, Any]]:
    """Collective: ``{name: {'method_state': saved}}`` (on the CPU) of the layers whose per-layer method state rank
    ``to`` does not keep, on rank ``to``; ``{}`` on the others (and for a method without one).

    ``keepers(name)``: the ranks that precondition a layer, and so keep its
    state (the first sends it, serialised as a checkpoint writes it: its
    form varies with the method and the step).
    """
    if not 0 <= to < backend.size:
        raise ValueError(f"to={to} is not a rank of this job ({backend.size} workers)")
    gathered: dict[str, dict[str, Any]] = {}
    for layer in layers:
        ranks = keepers(layer.name)
        if not layer.preconditions or not layer.method.stateful or to in ranks:
            continue
        device = layer.helper.weight.device
        name = f"spdkfac.checkpoint.state.{layer.name}"
        data = torch.empty(0, dtype=torch.uint8)
        if backend.rank == ranks[0]:
            buffer = io.BytesIO()
            torch.save(layer.method.save_state(layer.method_state), buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        backend.broadcast_async(size, ranks[0], f"{name}.size").wait()
        payload = data.to(device) if backend.rank == ranks[0] else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        backend.broadcast_async(payload, ranks[0], name).wait()
        if backend.rank == to:
            saved = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
            gathered[layer.name] = {"method_state": saved}
    return gathered if backend.rank == to else {}
