"""Optional per-iteration record of factor computation and communication.

Disabled by default (the optimizer then holds ``None`` and never reads a
clock). When enabled, each factor-update iteration records, per factor, when
its computation started and ended, when its fused all-reduce was launched and
when it was seen complete, plus the time the optimizer spent blocked waiting
for factor and inverse communication (the *non-overlapped* communication),
and the seconds of the parts of a step that a cost model charges apart: the
preconditioning, the hooks' own work beyond the factors, the update.

On CUDA every clock reading first waits for the device's queued work
(:meth:`Timeline.now`): kernels run asynchronously, so a host clock alone
would charge a part's GPU time to whichever later part waits for it. The
waits cost the overlap of host and device: time whole iterations with the
timeline off, and read the breakdown from a recorded run.

:meth:`Timeline.trace` draws the record as a trace that Perfetto
(ui.perfetto.dev) or ``chrome://tracing`` shows: each iteration, each
factor's computation in its hook, each fused all-reduce from its launch to
when it was seen complete, and the parts of ``step()`` (the waits, each
decomposition, the preconditioning, the update). One file per rank; the
ranks of one host share a clock, so their traces merge into one
(:func:`merge_traces`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["FactorEvent", "IterationRecord", "Span", "Timeline", "merge_traces"]


@dataclass
class FactorEvent:
    """Life of one factor in one iteration (seconds since the iteration's first event)."""

    kind: str
    layer: str
    compute_start: float
    compute_end: float
    group: int = -1
    comm_start: float | None = None
    comm_end: float | None = None


@dataclass
class Span:
    """A part of ``step()`` (seconds since the iteration's first event): a wait, a decomposition, the update."""

    name: str
    start: float
    end: float


@dataclass
class IterationRecord:
    """Everything recorded for one optimizer step."""

    step: int
    t0: float
    factors: dict[str, FactorEvent] = field(default_factory=dict)  # by 'kind:layer' (JSON keys)
    grad_wait: float = 0.0  # non-overlapped gradient all-reduce (blocked in step())
    factor_wait: float = 0.0  # non-overlapped factor communication (blocked in wait)
    inverse_stage: float = 0.0  # wall time from first inversion until every inverse is held
    inverse_wait: float = 0.0  # non-overlapped inverse broadcast time
    precondition: float = 0.0
    precondition_wait: float = 0.0  # blocked on broadcasts of preconditioned gradients (distribute_preconditioning)
    hooks: float = 0.0  # in the factor hooks beyond computing the factors (Python, packing, launching all-reduces)
    update: float = 0.0  # the base optimizer's update of the parameters (in step())
    #: Seconds of each decomposition this rank computed (by factor, ``'A.layer1'``), inside ``inverse_stage``:
    #: which rank's share sets the stage's length, and which factors make it.
    decompositions: dict[str, float] = field(default_factory=dict)
    #: The parts of ``step()`` in the order they ended (what :meth:`Timeline.trace` draws besides the factors).
    spans: list[Span] = field(default_factory=list)
    duration: float = 0.0  # from the first event to the end of step() (set when the step completes)

    def rel(self, t: float) -> float:
        return t - self.t0

    def span(self, name: str, start: float, end: float) -> None:
        """Record the part ``name`` of ``step()`` from ``start`` to ``end`` (clock times)."""
        self.spans.append(Span(name, self.rel(start), self.rel(end)))

    def factor_computed(self, key: tuple[str, str], start: float, end: float) -> None:
        """Record that factor ``key`` = (kind, layer) was computed from ``start`` to ``end`` (clock times)."""
        kind, layer = key
        self.factors[f"{kind}:{layer}"] = FactorEvent(kind, layer, self.rel(start), self.rel(end))

    def event(self, key: tuple[str, str]) -> FactorEvent | None:
        """The event of factor ``key`` (None if it was not recorded)."""
        return self.factors.get(f"{key[0]}:{key[1]}")

    @property
    def factor_compute(self) -> float:
        """Total time spent computing factors in hooks."""
        return sum(e.compute_end - e.compute_start for e in self.factors.values())


#: The rows of a rank in :meth:`Timeline.trace`, by thread id.
_ROWS = ("iterations", "factors (hooks)", "factor all-reduces", "step()")


def merge_traces(traces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One trace of several ranks' :meth:`Timeline.trace` (of one host: their clocks agree)."""
    return {"traceEvents": [event for trace in traces for event in trace["traceEvents"]], "displayTimeUnit": "ms"}


class Timeline:
    """A list of :class:`IterationRecord`, one per recorded step."""

    def __init__(self) -> None:
        self.iterations: list[IterationRecord] = []
        self.current: IterationRecord | None = None

    @staticmethod
    def now() -> float:
        """Seconds on the host clock, read once the current CUDA device (if CUDA is in use) has finished its work."""
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (torch leaves it unannotated)
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self, step: int) -> IterationRecord:
        """Open the record of the coming iteration (kept only once :meth:`end` is called)."""
        self.current = IterationRecord(step=step, t0=self.now())
        return self.current

    def end(self) -> None:
        """Keep the open record (the step completed)."""
        if self.current is not None:
            self.current.duration = self.current.rel(self.now())
            self.iterations.append(self.current)
            self.current = None

    def trace(self, rank: int = 0) -> dict[str, Any]:
        """The recorded iterations as a Chrome trace-event object (``json.dump`` it; Perfetto or ``chrome://tracing``
        opens it): in the rank's rows, the iterations, the factors computed in the hooks, the fused factor all-reduces
        (launch to seen complete; they may overlap each other) and the parts of ``step()``. Microseconds of the host's
        monotonic clock, shared by the processes of one host."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            *({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}} for tid, name in enumerate(_ROWS)),
        ]

        def slice_(name: str, row: int, start: float, end: float, t0: float) -> dict[str, Any]:
            return {"ph": "X", "name": name, "pid": rank, "tid": row, "ts": (t0 + start) * 1e6, "dur": max(end - start, 0.0) * 1e6}

        for it in self.iterations:
            events.append(slice_(f"iteration {it.step}", 0, 0.0, it.duration, it.t0))
            groups: dict[tuple[str, int], tuple[float, float, list[str]]] = {}  # (kind, group) -> launch, end, layers
            for ev in it.factors.values():
                events.append(slice_(f"{ev.kind} {ev.layer}", 1, ev.compute_start, ev.compute_end, it.t0))
                if ev.comm_start is not None and ev.comm_end is not None:
                    groups.setdefault((ev.kind, ev.group), (ev.comm_start, ev.comm_end, []))[2].append(ev.layer)
            # Async slices (begin, end): a fused all-reduce may start before the one before it has ended.
            for (kind, gid), (start, end, layers) in groups.items():
                name = f"all-reduce {kind} group {gid}"
                common = {"name": name, "cat": "factor all-reduce", "pid": rank, "tid": 2, "id": f"{it.step}.{kind}.{gid}"}
                events.append({**common, "ph": "b", "ts": (it.t0 + start) * 1e6, "args": {"factors": layers}})
                events.append({**common, "ph": "e", "ts": (it.t0 + end) * 1e6})
            events += [slice_(span.name, 3, span.start, span.end, it.t0) for span in it.spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_trace(self, path: str, rank: int = 0) -> None:
        """Write :meth:`trace` to ``path`` (JSON)."""
        with open(path, "w") as f:
            json.dump(self.trace(rank), f)

    def to_json(self) -> str:
        return json.dumps([asdict(it) for it in self.iterations], indent=1)

    def summary(self, skip: int = 0) -> dict[str, float]:
        """Mean per-iteration factor compute, the non-overlapped communication of each kind, and the stages."""
        its = self.iterations[skip:]
        if not its:
            return {}
        n = len(its)
        return {
            "iterations": float(n),
            "grad_comm_nonoverlap": sum(i.grad_wait for i in its) / n,
            "factor_compute": sum(i.factor_compute for i in its) / n,
            "factor_comm_nonoverlap": sum(i.factor_wait for i in its) / n,
            "inverse_stage": sum(i.inverse_stage for i in its) / n,
            "inverse_comm_nonoverlap": sum(i.inverse_wait for i in its) / n,
            "precondition": sum(i.precondition for i in its) / n,
            "precondition_comm_nonoverlap": sum(i.precondition_wait for i in its) / n,
            "hooks": sum(i.hooks for i in its) / n,
            "update": sum(i.update for i in its) / n,
        }
