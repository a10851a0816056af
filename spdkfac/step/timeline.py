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
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["FactorEvent", "IterationRecord", "Timeline"]


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

    def rel(self, t: float) -> float:
        return t - self.t0

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
            self.iterations.append(self.current)
            self.current = None

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
