"""Multi-process worker: reports whether the process group was torn down at exit, and its gloo threads with it.

An ``atexit`` handler registered *before* the group is created runs *after*
the engine's own exit handler (atexit is last-in, first-out), so it sees what
the engine left behind. Rank 1 finishes its work early (it skips a sleep) to
show that the engine's exit barrier keeps it until rank 0 is done.

``--caller-group``: the script creates the group itself, as the DDP example
does, and destroys it at its end; the engine is the preconditioner's.

Either way the model is a ``DistributedDataParallel`` (it holds the group, and
the preconditioner holds it), and a torch optimizer is made after the group
exists, as in any training script: that is when torch first imports
``torch.distributed.nn``, whose default arguments would otherwise keep the
group. Whatever keeps it alive into interpreter shutdown keeps its gloo
threads running there, where they can abort the finished worker.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spdkfac import KFACPreconditioner
from spdkfac.comm import get_backend

finished_at: dict = {}


def gloo_threads() -> int:
    """This process's native threads that belong to gloo (its run loops and its socket loop), by their names."""
    return sum("gloo" in task.joinpath("comm").read_text() for task in Path("/proc/self/task").iterdir())


def report() -> None:
    print(
        f"rank {finished_at['rank']}: group alive at exit={dist.is_initialized()} gloo threads={gloo_threads()} "
        f"exit delay={time.monotonic() - finished_at['t']:.2f}s",
        flush=True,
    )


def train(caller_group: bool) -> None:
    """A few preconditioned steps of a DDP model, in a function as a training script's ``main``: its objects are
    unreachable at exit (the optimizer's parts refer to each other, so they wait for the garbage collector)."""
    if caller_group:
        dist.init_process_group("gloo")
    backend = get_backend("torch")
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = KFACPreconditioner(model, lr=0.1, backend=backend)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        preconditioner.step()
        optimizer.step()
    t = torch.full((4,), float(backend.rank + 1))
    backend.allreduce_async(t, "exit-check").wait()
    assert torch.allclose(t, torch.full((4,), (backend.size + 1) / 2)), t
    if backend.rank == 0:
        time.sleep(1.5)
    finished_at.update(rank=backend.rank, t=time.monotonic())
    if caller_group:  # as the DDP example ends, with the model still in scope
        dist.barrier()
        dist.destroy_process_group()


atexit.register(report)
train(caller_group="--caller-group" in sys.argv)
