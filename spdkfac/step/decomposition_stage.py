"""The decomposition stage: every rank ends up holding every factor's inverse (or eigendecomposition).

Follows a :class:`~spdkfac.plan.placement.PlacementPlan`: an owner decomposes its
factors, largest first, and starts an asynchronous broadcast of each result
right after computing it, so the broadcast overlaps its next decomposition;
the others post the matching receive at once. Factors placed on ``ALL`` are
then decomposed locally while the broadcasts are in flight. Broadcasts are
issued in :meth:`PlacementPlan.broadcast_order` on every rank, which
torch.distributed requires. A factor placed among a layer's gradient workers
(KAISA, :mod:`spdkfac.plan.grad_workers`) is broadcast to them only and kept by
them only.

What travels is the compute method's payload (:mod:`spdkfac.kfac.methods`): an
inverse's upper triangle(s), or an eigendecomposition's ``Q`` and ``d`` in
one buffer, which every rank, owner included, keeps as views into that
buffer; a grouped layer's blocks travel as one buffer. :func:`compute_inverses`
and :func:`compute_eigen` run the stage for plain dense factors.

A factor whose decomposition fails is decomposed by the method's fallback
where it has one (the inverse method's clamped ``eigh``: docs/fault-tolerance.md),
on the rank that decomposes it, and named once in a
:class:`~spdkfac.kfac.methods.DecompositionFallbackWarning`; without one the
error names the factor and the step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Callable, cast

import torch

from ..comm import CommBackend, Handle
from ..kfac.eigenbasis import Eigen, eigen_payload, unpack_eigen
from ..kfac.factor_shape import FactorShape
from ..kfac.layers import FactorKey, KFACLayer
from ..kfac.linalg import invert_spd, pack_upper, triangle_size, unpack_upper
from ..kfac.methods import DecompositionFallbackWarning, LinAlgError
from ..kfac.methods.warm import RefreshStatistics
from ..plan.placement import ALL, PlacementPlan
from .timeline import IterationRecord, Timeline

__all__ = ["DecompositionStage", "compute_eigen", "compute_inverses"]

#: Factors named in a fallback warning; the rest are counted.
_NAMED = 5

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
    """Return ``{key: (factor + damping*I)^-1}`` for every dense factor in ``plan``, on every rank.

    Args:
        plan: who inverts what (identical on every rank).
        factors: the (already averaged, identical) factors by key, as full
            matrices or packed upper triangles (a packed one is unpacked only
            on the rank that inverts it).
        damping: Tikhonov damping.
        backend: communication engine.
        record: timeline record to charge the stage and its blocking wait to.
        invert: ``(key, matrix) -> inverse``; defaults to :func:`invert_spd`.
    """
    inv_fn: Inverter = invert or (lambda key, m: invert_spd(m, damping))

    def owned(key: Hashable, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload = pack_upper(inv_fn(key, matrix))
        # Keep what the receivers rebuild, not the inverse itself: bitwise the same on every rank even for an
        # ``invert`` whose result is not exactly symmetric and row-major.
        return unpack_upper(payload, matrix.shape[0]), payload

    return _stage(
        plan,
        factors,
        backend,
        record,
        "inverse",
        _dense_full,
        lambda key, dim: triangle_size(dim),
        owned,
        inv_fn,
        lambda key, payload, dim: unpack_upper(payload, dim),
    )


def compute_eigen(
    plan: PlacementPlan,
    factors: dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: IterationRecord | None = None,
    decompose: Decomposer | None = None,
) -> dict[Hashable, Eigen]:
    """Return ``{key: Eigen(Q, d)}`` of every dense factor in ``plan``, bit-identical on every rank.

    ``decompose`` is ``(key, matrix) -> flat [Q, d] buffer``, defaulting to
    :func:`~spdkfac.kfac.eigenbasis.eigen_payload`. The damping is applied when
    preconditioning, so none is taken here.
    """
    dec_fn: Decomposer = decompose or (lambda key, m: eigen_payload(m))

    def owned(key: Hashable, matrix: torch.Tensor) -> tuple[Eigen, torch.Tensor]:
        buffer = dec_fn(key, matrix)
        return unpack_eigen(buffer, matrix.shape[0]), buffer  # kept as sent: the receivers' layout exactly

    return _stage(
        plan,
        factors,
        backend,
        record,
        "eigen",
        _dense_full,
        lambda key, dim: dim * dim + dim,
        owned,
        lambda key, matrix: unpack_eigen(dec_fn(key, matrix), matrix.shape[0]),
        lambda key, payload, dim: unpack_eigen(payload, dim),
    )


@contextlib.contextmanager
def _timed(record: IterationRecord | None, key: Hashable) -> Iterator[None]:
    """Around one decomposition: its seconds recorded under the factor's name in ``record.decompositions``."""
    started = Timeline.now() if record is not None else 0.0
    yield
    if record is not None:
        ended = Timeline.now()
        record.decompositions[_collective_name(key)] = ended - started
        record.span(f"decompose {_collective_name(key)}", started, ended)


def _stage(
    plan: PlacementPlan,
    factors: dict[Hashable, torch.Tensor],
    backend: CommBackend,
    record: IterationRecord | None,
    method: str,
    full: Callable[[Hashable, torch.Tensor, int], torch.Tensor],
    payload_size: Callable[[Hashable, int], int],
    owned: Callable[[Hashable, torch.Tensor], tuple[Any, torch.Tensor]],
    local: Callable[[Hashable, torch.Tensor], Any],
    received: Callable[[Hashable, torch.Tensor, int], Any],
) -> dict[Hashable, Any]:
    """Run the stage: ``full`` unpacks a factor, ``owned`` gives (kept, flat payload), ``local`` the kept value,
    ``received`` rebuilds it from a payload of ``payload_size(key, dim)`` elements."""
    rank = backend.rank
    t0 = Timeline.now() if record is not None else 0.0
    out: dict[Hashable, Any] = {}
    pending: list[tuple[Handle, torch.Tensor, Hashable, bool, int]] = []
    for a in plan.broadcast_order():
        ref = factors[a.key]
        name = f"spdkfac.{method}.{_collective_name(a.key)}"
        if a.owner == rank:
            with _timed(record, a.key):
                out[a.key], payload = owned(a.key, full(a.key, ref, a.dim))
        else:  # a non-holder posts an empty buffer, or without sub-group broadcasts receives one to drop
            size = payload_size(a.key, a.dim) if a.holds(rank) or not backend.native_subgroups else 0
            payload = torch.empty(size, dtype=ref.dtype, device=ref.device)
        if a.members is None:
            handle = backend.broadcast_async(payload, a.owner, name)
        else:
            handle = backend.broadcast_within_async(payload, a.owner, a.members, name)
        pending.append((handle, payload, a.key, a.owner != rank and a.holds(rank), a.dim))
    for a in plan.assignments:
        if a.owner == ALL and a.holds(rank):
            with _timed(record, a.key):
                out[a.key] = local(a.key, full(a.key, factors[a.key], a.dim))
    t_wait = Timeline.now() if record is not None else 0.0
    for handle, payload, key, keep, dim in pending:
        handle.wait()
        if keep:
            out[key] = received(key, payload, dim)
    if record is not None:
        t1 = Timeline.now()
        record.inverse_wait += t1 - t_wait
        record.inverse_stage += t1 - t0
        record.span("wait: decompositions", t_wait, t1)
        record.span("decompositions", t0, t1)
    return out


def _collective_name(key: Hashable) -> str:
    """``A.layer1`` for the factor key ``('A', 'layer1')`` (the same on every rank)."""
    return ".".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _dense_full(key: Hashable, factor: torch.Tensor, dim: int) -> torch.Tensor:
    """The full symmetric matrix of a factor given full or as its packed upper triangle."""
    return factor if factor.dim() == 2 else unpack_upper(factor, dim)


class DecompositionStage:
    """The optimizer's decomposition stage: decomposes its layers' factors per the plan and stores the results.

    What a factor becomes, how it travels and how a failure is explained
    belong to the layers' compute method (:mod:`spdkfac.kfac.methods`); the
    stage adds the layer, factor and step to the message.
    """

    def __init__(self, layers: Sequence[KFACLayer], plan: PlacementPlan, backend: CommBackend) -> None:
        self.layers = {layer.name: layer for layer in layers}
        self.plan = plan
        self.backend = backend
        self.method = layers[0].method if layers else None
        self.step = 0  # for the messages
        self.fallen_back: set[Hashable] = set()  # factors the method's fallback was used for (each warned about once)
        self.refreshes = RefreshStatistics()  # how each eigenbasis was refreshed (eigen_refresh='warm'; else empty)

    def _shape(self, key: Hashable) -> FactorShape:
        kind, name = cast(FactorKey, key)
        return self.layers[name].shape(kind)

    def run(self, damping: float, step: int, record: IterationRecord | None = None) -> None:
        """Decompose every factor (this rank's share, the rest received) and store them in the layers."""
        self.step = step
        method = self.method
        if method is None:
            return
        # Packed: each factor is unpacked only where it is decomposed.
        factors: dict[Hashable, torch.Tensor] = {}
        for name, layer in self.layers.items():
            for kind, packed in layer.factors_to_decompose().items():
                factors[(kind, name)] = packed

        fell_back: dict[Hashable, str] = {}  # factor -> why its plain decomposition failed

        def owned(key: Hashable, factor: torch.Tensor) -> tuple[Any, torch.Tensor]:
            result: tuple[Any, torch.Tensor] = self._guarded(
                key, factor, damping, lambda: method.owned(self._shape(key), factor, damping, self._previous(key)), fell_back
            )
            return result

        def local(key: Hashable, factor: torch.Tensor) -> Any:
            compute = lambda: method.local(self._shape(key), factor, damping, self._previous(key))  # noqa: E731
            return self._guarded(key, factor, damping, compute, fell_back, kept_only=True)

        results = _stage(
            self.plan,
            factors,
            self.backend,
            record,
            method.name,
            lambda key, factor, dim: self._shape(key).unpack(factor) if factor.dim() == 1 else factor,
            lambda key, dim: method.payload_size(self._shape(key)),
            owned,
            local,
            lambda key, payload, dim: method.received(payload, self._shape(key)),
        )
        for key, value in results.items():
            kind, name = cast(FactorKey, key)
            self.layers[name].set_decomposition(kind, value)
            refresh = method.refresh_record(value)
            if refresh is not None:
                self.refreshes.record(f"{name}/{kind}", self._shape(key).dim, *refresh)
        self._warn_fallbacks(fell_back, damping)

    def _previous(self, key: Hashable) -> Any:
        """The factor's current decomposition (every rank holds it bitwise alike): a warm start's origin."""
        kind, name = cast(FactorKey, key)
        return self.layers[name].decomposition(kind)

    def _guarded(
        self,
        key: Hashable,
        factor: torch.Tensor,
        damping: float,
        compute: Callable[[], Any],
        fell_back: dict[Hashable, str],
        kept_only: bool = False,
    ) -> Any:
        """``compute()``; where its factorization fails, the method's fallback (the key noted in ``fell_back``),
        or without one the error re-raised with the method's explanation, naming the factor.

        The decision is the factor's alone: its owner takes it and broadcasts
        the result, and a factor every rank decomposes is bitwise equal on
        every rank, so each takes the same one.
        """
        kind, name = cast(FactorKey, key)
        assert self.method is not None
        try:
            return compute()
        except LinAlgError as exc:
            message = self.method.failure(f"factor {kind} of layer {name!r}", self._shape(key), factor, damping, self.step, exc)
            fallback = self.method.fallback(self._shape(key), factor, damping, self._previous(key))
            if fallback is None:
                raise LinAlgError(message) from exc
            fell_back[key] = message
            return fallback[0] if kept_only else fallback

    def _warn_fallbacks(self, failures: dict[Hashable, str], damping: float) -> None:
        """One warning for the factors that needed the fallback for the first time (each factor is named once):
        the first one's explanation, the others named."""
        new = [key for key in failures if key not in self.fallen_back]
        if not new:
            return
        self.fallen_back.update(new)
        assert self.method is not None
        others = ", ".join(f"{kind} of {name!r}" for kind, name in cast("list[FactorKey]", new[1 : 1 + _NAMED]))
        more = f" and {len(new) - 1 - _NAMED} more" if len(new) > 1 + _NAMED else ""
        also = f" So were factors {others}{more}." if others else ""
        warnings.warn(
            f"{failures[new[0]]}{also} Each was {self.method.fallback_label} instead (DecompositionFallbackWarning, "
            f"docs/fault-tolerance.md); each factor is named once.",
            DecompositionFallbackWarning,
            stacklevel=3,
        )
