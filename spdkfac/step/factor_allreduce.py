"""TensorFusionController: packs ready factors into fused buffers and all-reduces them.

Hooks hand each freshly computed batch factor to :meth:`submit` (by
reference). The controller copies its flat form (a full matrix's upper
triangle; the layers hand over packed triangles or a diagonal) into the buffer
of the factor's fusion group; when the group's last member arrives it starts an
asynchronous all-reduce and returns at once, so the communication of early
layers runs while later layers compute. :meth:`wait_all` (called from
``step()``) blocks on the handles and returns the averaged factors as packed
upper triangles (views into the fused buffers; the layers keep their running
averages packed, so nothing is unpacked here).

Without a plan for a pass (the first iterations, while the per-layer times
are being profiled) every factor is launched alone, in arrival order; so is
a factor the plan does not hold (a layer that did not run in the profiled
steps). With a :class:`~spdkfac.step.collective_order.CollectiveOrder` the
launches are issued in the order every rank agrees on (a layer may run on
some ranks only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..comm.base import CommBackend, Handle
from ..kfac.layers import FactorKey
from ..kfac.linalg import pack_upper, triangle_size
from .collective_order import CollectiveOrder, DeferredHandle
from .timeline import IterationRecord, Timeline

__all__ = ["FactorKey", "TensorFusionController", "group_name"]


def group_name(members: Sequence[FactorKey]) -> str:
    """The collective name of a fused group (the same on every rank): its kind, first member and size."""
    return f"spdkfac.factor.{members[0][0]}.{members[0][1]}.{len(members)}"


@dataclass
class _Group:
    members: list[FactorKey]
    gid: int
    arrived: dict[FactorKey, torch.Tensor] = field(default_factory=dict)


@dataclass
class _InFlight:
    handle: Handle
    buffer: torch.Tensor
    layout: list[tuple[FactorKey, int, int]]  # (key, elements, offset)
    gid: int
    kind: str


class TensorFusionController:
    """Fuses and all-reduces Kronecker factors as they become ready."""

    def __init__(self, backend: CommBackend, order: CollectiveOrder | None = None) -> None:
        self.backend = backend
        self.order = order  # None: each all-reduce issued when its group is complete
        self.record: IterationRecord | None = None
        self._plans: dict[str, list[list[FactorKey]] | None] = {"A": None, "G": None}
        self._group_of: dict[FactorKey, _Group] = {}
        self._groups: list[_Group] = []
        self._in_flight: list[_InFlight] = []
        self._local: dict[FactorKey, torch.Tensor] = {}
        self._submitted: set[FactorKey] = set()  # this iteration's keys (each factor is sent once per step)
        self._next_gid = 0

    # -- configuration -------------------------------------------------------------
    def set_plan(self, kind: str, groups: Sequence[Sequence[FactorKey]] | None) -> None:
        """Use ``groups`` (lists of factor keys) for pass ``kind``; None means layer-wise."""
        if self._in_flight or any(g.arrived for g in self._groups):
            raise RuntimeError("cannot change the fusion plan while factors are in flight")
        self._plans[kind] = [list(g) for g in groups] if groups is not None else None

    def plan(self, kind: str) -> list[list[FactorKey]] | None:
        return self._plans[kind]

    @property
    def pending(self) -> int:
        """All-reduces launched and not yet collected by :meth:`wait_all` (0 between steps)."""
        return len(self._in_flight)

    # -- per iteration ---------------------------------------------------------------
    def begin_iteration(self, record: IterationRecord | None = None, abandon: bool = False) -> None:
        """Reset per-iteration state; ``record`` receives timeline events if given.

        ``abandon`` drops what the last iteration left in flight without
        complaint: after an error those collectives may never complete.
        """
        if not abandon and (self._in_flight or any(g.arrived for g in self._groups)):
            raise RuntimeError("previous iteration's factors were never waited for")
        self._in_flight = []
        self.record = record
        self._submitted = set()
        self._local = {}
        self._groups = []
        self._group_of = {}
        self._next_gid = 0
        for plan in self._plans.values():
            if plan is None:
                continue
            for members in plan:
                group = _Group(members=members, gid=self._next_gid)
                self._next_gid += 1
                self._groups.append(group)
                for key in members:
                    self._group_of[key] = group

    def submit(self, key: FactorKey, factor: torch.Tensor, alone: bool = False) -> None:
        """Hand over a freshly computed batch factor; may launch an all-reduce (``alone``: at once, outside the plan)."""
        if key in self._submitted:
            raise RuntimeError(
                f"factor {key[0]} of layer {key[1]!r} was sent twice in one step (the factor hooks send each factor once per step)"
            )
        self._submitted.add(key)
        if self.backend.size == 1:
            self._local[key] = factor  # nothing to average: keep the reference
            return
        group = None if alone else self._group_of.get(key)
        if group is None:  # no plan yet, or a factor the plan does not hold (a layer that did not run while it was made)
            group = _Group(members=[key], gid=self._next_gid)
            self._next_gid += 1
            self._groups.append(group)
        group.arrived[key] = factor
        if len(group.arrived) == len(group.members):
            self._launch(group)

    def submit_together(self, items: Sequence[tuple[FactorKey, torch.Tensor]]) -> None:
        """Hand over factors outside the plan to be all-reduced at once, fused: one all-reduce per dtype and device
        (in their first member's order; every rank hands over the same keys)."""
        parts: dict[tuple[torch.dtype, torch.device], list[tuple[FactorKey, torch.Tensor]]] = {}
        for key, factor in items:
            parts.setdefault((factor.dtype, factor.device), []).append((key, factor))
        for part in parts.values():
            for key, factor in part:
                if key in self._submitted:
                    raise RuntimeError(f"factor {key[0]} of layer {key[1]!r} was sent twice in one step")
                self._submitted.add(key)
                if self.backend.size == 1:
                    self._local[key] = factor
            if self.backend.size == 1:
                continue
            group = _Group(members=[key for key, _ in part], gid=self._next_gid)
            self._next_gid += 1
            self._groups.append(group)
            group.arrived.update(part)
            self._launch(group)

    def incomplete(self) -> list[FactorKey]:
        """The factors missing from fused groups that others have joined, in launch order (the same on every rank)."""
        return [k for g in self._groups if g.arrived for k in g.members if k not in g.arrived]

    def submitted(self, key: FactorKey) -> bool:
        """Whether ``key`` was handed over in this iteration."""
        return key in self._submitted

    def _launch(self, group: _Group) -> None:
        first = group.arrived[group.members[0]]
        total = sum(_flat_size(group.arrived[k]) for k in group.members)
        buffer = torch.empty(total, dtype=first.dtype, device=first.device)
        layout = []
        offset = 0
        for key in group.members:
            factor = group.arrived[key]
            n = _flat_size(factor)
            if factor.dim() == 2:  # a full symmetric matrix: its upper triangle travels
                pack_upper(factor, out=buffer[offset : offset + n])
            else:  # already in flat form (packed triangles, a diagonal)
                buffer[offset : offset + n].copy_(factor)
            layout.append((key, n, offset))
            offset += n
        group.arrived.clear()
        kind = group.members[0][0]
        name = group_name(group.members)
        rec = self.record
        if rec is not None:
            t = rec.rel(Timeline.now())
            for key in group.members:
                ev = rec.event(key)
                if ev is not None:
                    ev.comm_start = t
                    ev.group = group.gid
        handle: Handle = self.backend.allreduce_async(buffer, name) if self.order is None else self.order.allreduce(buffer, name)
        self._in_flight.append(_InFlight(handle, buffer, layout, group.gid, kind))

    def poll(self) -> None:
        """Record completion times of finished all-reduces (timeline only)."""
        rec = self.record
        if rec is None:
            return
        t = rec.rel(Timeline.now())
        for job in self._in_flight:
            first = rec.event(job.layout[0][0])
            if first is not None and first.comm_end is None and job.handle.done():
                for key, _, _ in job.layout:
                    ev = rec.event(key)
                    if ev is not None:
                        ev.comm_end = t

    def discard(self) -> None:
        """Drop this iteration's factors: wait for the launched all-reduces (so every
        worker's collectives stay matched: with an order, every rank's are settled first), release the buffers,
        forget the rest."""
        if self.order is not None:
            self.order.settle()
        for job in self._in_flight:
            if not isinstance(job.handle, DeferredHandle) or job.handle.handle is not None:
                job.handle.wait()
        self._forget()
        self._submitted = set()

    def _forget(self) -> None:
        """Release this iteration's buffers and partly filled groups (the plan stays)."""
        self._in_flight = []
        self._local = {}
        for g in self._groups:
            g.arrived.clear()

    def wait_all(self) -> dict[FactorKey, torch.Tensor]:
        """Block until every launched all-reduce is done; return the averaged factors.

        Communicated factors come back in flat form (views into their fused
        buffer), factors that needed no averaging (one worker) as the hooks
        submitted them.
        """
        if self.order is not None:
            self.order.settle()
        missing = [k for g in self._groups for k in g.members if g.arrived and k not in g.arrived]
        if missing:
            self._forget()
            raise RuntimeError(
                "these factors were never computed in this factor-update step, so their fused all-reduce "
                f"could not start: {missing}. Every preconditioned layer must run in every step."
            )
        results: dict[FactorKey, torch.Tensor] = dict(self._local)
        rec = self.record
        for job in self._in_flight:
            if rec is not None:
                t_wait = Timeline.now()
                job.handle.wait()
                t = Timeline.now()
                rec.factor_wait += t - t_wait
                rec.span("wait: factors", t_wait, t)
                for key, _, _ in job.layout:
                    ev = rec.event(key)
                    if ev is not None and ev.comm_end is None:
                        ev.comm_end = rec.rel(t)
            else:
                job.handle.wait()
            for key, numel, offset in job.layout:
                results[key] = job.buffer[offset : offset + numel]
        self._forget()
        return results


def _flat_size(factor: torch.Tensor) -> int:
    """Elements a factor occupies in a fused buffer: a full matrix's upper triangle, a flat factor whole."""
    return triangle_size(factor.shape[0]) if factor.dim() == 2 else factor.numel()
