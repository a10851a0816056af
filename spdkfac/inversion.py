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

from collections.abc import Hashable, Sequence
from typing import Any, Callable, cast

import torch

from .comm import CommBackend, Handle
from .decomposition import Eigen, eigen_payload, payload_size, unpack_eigen
from .layers import FACTOR_KINDS, FactorKey, KFACLayer
from .linalg import invert_spd, pack_upper, unpack_upper
from .placement import ALL, PlacementPlan
from .timeline import IterationRecord, Timeline

#: torch's error for a failed factorization (torch's stubs do not re-export it from torch.linalg).
LinAlgError: type[RuntimeError] = torch.linalg.LinAlgError  # type: ignore[attr-defined]

__all__ = ["DecompositionStage", "compute_eigen", "compute_inverses"]

Inverter = Callable[[Hashable, torch.Tensor], torch.Tensor]
Decomposer = Callable[[Hashable, torch.Tensor], torch.Tensor]


def compute_inverses(
    plan: PlacementPlan,
    factors: dict[Hashable, torch.Tensor],
    damping: float,
    backend: CommBackend,
    record: IterationRecord | None = None,
    invert: Inverter | None = None,
) -> dict[Hashable, torch.Tensor]:
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

    def owned(key: Hashable, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload = pack_upper(inv_fn(key, matrix))
        # Keep what the receivers rebuild, not the inverse itself: bitwise the same on every rank even for an
        # ``invert`` whose result is not exactly symmetric and row-major.
        return unpack_upper(payload, matrix.shape[0]), payload

    return _stage(plan, factors, backend, record, "inverse", owned, inv_fn, unpack_upper)


def compute_eigen(
    plan: PlacementPlan,
    factors: dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: IterationRecord | None = None,
    decompose: Decomposer | None = None,
) -> dict[Hashable, Eigen]:
    """Return ``{key: Eigen(Q, d)}`` of every factor in ``plan``, bit-identical on every rank.

    ``decompose`` is ``(key, matrix) -> flat [Q, d] buffer``, defaulting to
    :func:`~spdkfac.decomposition.eigen_payload` (the optimizer passes one that
    names the layer in its errors). The damping is applied when
    preconditioning, so none is taken here.
    """
    dec_fn: Decomposer = decompose or (lambda key, m: eigen_payload(m))

    def owned(key: Hashable, matrix: torch.Tensor) -> tuple[Eigen, torch.Tensor]:
        buffer = dec_fn(key, matrix)
        return unpack_eigen(buffer, matrix.shape[0]), buffer  # kept as sent: the receivers' layout exactly

    return _stage(
        plan, factors, backend, record, "eigen", owned, lambda key, matrix: unpack_eigen(dec_fn(key, matrix), matrix.shape[0]), unpack_eigen
    )


def _stage(
    plan: PlacementPlan,
    factors: dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: IterationRecord | None,
    method: str,
    owned: Callable[[Hashable, torch.Tensor], tuple[Any, torch.Tensor]],
    local: Callable[[Hashable, torch.Tensor], Any],
    received: Callable[[torch.Tensor, int], Any],
) -> dict[Hashable, Any]:
    """Run the stage: ``owned`` gives (kept, flat payload), ``local`` the kept value, ``received`` unpacks a payload."""
    rank = backend.rank
    t0 = Timeline.now() if record is not None else 0.0
    out: dict[Hashable, Any] = {}
    pending: list[tuple[Handle, torch.Tensor, Hashable, int, int]] = []
    for a in plan.broadcast_order():
        ref = factors[a.key]
        if a.owner == rank:
            out[a.key], payload = owned(a.key, _full(ref, a.dim))
        else:
            payload = torch.empty(payload_size(method, a.dim), dtype=ref.dtype, device=ref.device)
        handle = backend.broadcast_async(payload, a.owner, f"spdkfac.{method}.{_collective_name(a.key)}")
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


def _collective_name(key: Hashable) -> str:
    """``A.layer1`` for the factor key ``('A', 'layer1')`` (the same on every rank)."""
    return ".".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _full(factor: torch.Tensor, dim: int) -> torch.Tensor:
    """The full symmetric matrix of a factor given full or as its packed upper triangle."""
    return factor if factor.dim() == 2 else unpack_upper(factor, dim)


class DecompositionStage:
    """The optimizer's decomposition stage: decomposes its layers' factors per the plan and stores the results.

    Wraps :func:`compute_inverses` / :func:`compute_eigen` with errors that
    name the layer, the factor and the step, and a damping that would work.
    """

    def __init__(self, layers: Sequence[KFACLayer], plan: PlacementPlan, backend: CommBackend, compute_method: str) -> None:
        self.layers = {layer.name: layer for layer in layers}
        self.plan = plan
        self.backend = backend
        self.compute_method = compute_method
        self.step = 0  # for the messages

    def run(self, damping: float, step: int, record: IterationRecord | None = None) -> None:
        """Decompose every factor (this rank's share, the rest received) and store them in the layers."""
        self.step = step
        # Packed: each factor is unpacked only where it is decomposed.
        factors: dict[Hashable, torch.Tensor] = {}
        for name, layer in self.layers.items():
            for kind in FACTOR_KINDS:
                packed = layer.packed_factor(kind)
                if packed is None:
                    raise RuntimeError(f"factor {kind} of layer {name!r} was never computed; nothing to decompose")
                factors[(kind, name)] = packed
        if self.compute_method == "eigen":
            eigens = compute_eigen(self.plan, factors, self.backend, record=record, decompose=self.eigen)
            for key, eigen in eigens.items():
                kind, name = cast(FactorKey, key)
                self.layers[name].set_eigen(kind, eigen)
            return
        inverses = compute_inverses(
            self.plan, factors, damping, self.backend, record=record, invert=lambda key, matrix: self.invert(key, matrix, damping)
        )
        for key, inverse in inverses.items():
            kind, name = cast(FactorKey, key)
            self.layers[name].set_inverse(kind, inverse)

    def invert(self, key: Hashable, factor: torch.Tensor, damping: float) -> torch.Tensor:
        """``(factor + damping*I)^-1``; a failure names the factor and a damping that float rounding needs."""
        kind, name = cast(FactorKey, key)
        try:
            return invert_spd(factor, damping)
        except LinAlgError as exc:
            # The factors were checked finite, so the damping lost to rounding: a factor of lower rank than its
            # dimension (fewer rows, samples x positions, than that) has only the damping on its null space, and
            # Cholesky's rounding error grows with the factor's scale. Say which, with a damping that would do.
            dim = factor.shape[0]
            scale = float(factor.diagonal().max())
            enough = dim * torch.finfo(factor.dtype).eps * scale
            raise LinAlgError(
                f"factor {kind} of layer {name!r} (dimension {dim}, largest diagonal entry {scale:.3g}) is not "
                f"positive definite even with damping {damping:g} at step {self.step}. A factor of lower rank than "
                f"its dimension (from fewer rows, samples x positions, than that: a small batch) keeps only the "
                f"damping in its null space, and {factor.dtype} rounding at this scale is about {enough:.2g}: raise "
                f"damping well above that or the batch size; if training had been diverging, lower lr or kl_clip "
                f"instead. ({exc})"
            ) from exc

    def eigen(self, key: Hashable, factor: torch.Tensor) -> torch.Tensor:
        """The flat ``[Q, d]`` buffer of ``factor``; a failure names the factor."""
        kind, name = cast(FactorKey, key)
        try:
            return eigen_payload(factor)
        except LinAlgError as exc:  # eigh did not converge (the factors were checked finite)
            raise LinAlgError(
                f"the eigendecomposition of factor {kind} of layer {name!r} (dimension {factor.shape[0]}) failed "
                f"at step {self.step}; compute_method='inverse' does not need one. ({exc})"
            ) from exc
