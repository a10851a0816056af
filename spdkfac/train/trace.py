"""``--trace N``: the optimizer's timeline of N steps, every rank's, in one trace file of the run.

Recording starts once the fusion plan is made (the profiled factor steps
before it synchronise around every factor, which is not how the run goes
on), and stops after N steps, or at the end of the run if it comes first;
then the ranks' traces are gathered and rank 0 writes ``trace.json`` into
the run directory, which Perfetto (ui.perfetto.dev) or ``chrome://tracing``
opens: per rank the iterations, the factors computed in the hooks, the
fused factor all-reduces and the parts of ``step()``
(:meth:`spdkfac.step.timeline.Timeline.trace`). Ranks on other hosts have
other clocks: each rank's row is right, their offsets are not. While
recording, every clock reading waits for the GPU, so those steps run slower
than the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..comm import CommBackend
from ..step.timeline import Timeline, merge_traces
from .run_dir import replace_text

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Turns the optimizer's timeline on for ``steps`` steps, then writes every rank's trace to ``path`` (rank 0)."""

    def __init__(self, optimizer: Any, steps: int, path: Path, backend: CommBackend) -> None:
        self.optimizer, self.steps, self.path, self.backend = optimizer, steps, path, backend
        self.done = False

    def stepped(self) -> None:
        """After each step: start once the fusion plan is made, write when ``steps`` steps are recorded."""
        if self.done:
            return
        timeline: Timeline | None = self.optimizer.timeline
        if timeline is None:
            if not self.optimizer.kfac_step.profiler.active:
                self.optimizer.timeline = Timeline()  # (records from the next iteration that begins)
        elif len(timeline.iterations) >= self.steps:
            self.finish()

    def finish(self) -> None:
        """Gather what is recorded (on every rank alike) and write it; nothing more is recorded."""
        if self.done:
            return
        self.done = True
        timeline: Timeline | None = self.optimizer.timeline
        self.optimizer.timeline = None
        mine = json.dumps((timeline or Timeline()).trace(self.backend.rank)).encode()
        traces = [json.loads(data) for data in _gathered(self.backend, mine)]
        if self.backend.rank == 0:
            recorded = len(timeline.iterations) if timeline is not None else 0
            replace_text(self.path, json.dumps(merge_traces(traces)))
            print(f"trace of {recorded} step(s), {len(traces)} rank(s): {self.path} (open it in ui.perfetto.dev)", flush=True)


def _gathered(backend: CommBackend, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order: the lengths, then the bytes (host tensors, which every engine moves: the
    torch engine on NCCL through its gloo group)."""
    if backend.size == 1:
        return [data]
    lengths = [int(n) for (n,) in backend.gather_values([float(len(data))], "spdkfac.trace.lengths")]
    buffer = torch.zeros(sum(lengths), dtype=torch.uint8)
    start = sum(lengths[: backend.rank])
    buffer[start : start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    backend.allgather_async(buffer, lengths, "spdkfac.trace.bytes").wait()
    values = buffer.numpy().tobytes()
    offsets = [sum(lengths[:r]) for r in range(backend.size)]
    return [values[o : o + n] for o, n in zip(offsets, lengths)]
