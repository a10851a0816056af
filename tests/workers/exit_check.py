"""Multi-process worker: reports whether the torch engine tore its process group down at exit.

An ``atexit`` handler registered *before* the engine creates the group runs
*after* the engine's own exit handler (atexit is last-in, first-out), so it
sees what the engine left behind. Rank 1 finishes its work early (it skips a
sleep) to show that the engine's exit barrier keeps it until rank 0 is done.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spdkfac.comm import get_backend

finished_at: dict = {}


def report() -> None:
    print(
        f"rank {finished_at['rank']}: group alive at exit={dist.is_initialized()} exit delay={time.monotonic() - finished_at['t']:.2f}s",
        flush=True,
    )


atexit.register(report)
backend = get_backend("torch")
t = torch.full((4,), float(backend.rank + 1))
backend.allreduce_async(t, "exit-check").wait()
assert torch.allclose(t, torch.full((4,), (backend.size + 1) / 2)), t
if backend.rank == 0:
    time.sleep(1.5)
finished_at.update(rank=backend.rank, t=time.monotonic())
