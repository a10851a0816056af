"""Multi-process worker: the script ends with a gloo collective still in flight, and its DDP model in a reference cycle.

Rank 1 starts an all-reduce on the model's process group and lets go of it
(its tensor's last reference is then the collective's), destroys the groups
and returns; rank 0 joins the all-reduce 2 s later. At exit the engine's
handler collects the cycle: the model's reducer drops its reference to the
group, and the group's destructor waits for gloo's threads, one of which must
take the GIL to let go of the tensor when the all-reduce completes. The
handler must not be holding the GIL then, or rank 1 never exits.

Each rank reports, after the engine's exit handlers (an ``atexit`` handler
registered before the engine's runs after them), how long its exit took and
how many gloo threads were left.
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

from spdkfac.comm import get_backend

finished_at: dict = {}


def report() -> None:
    gloo = sum("gloo" in task.joinpath("comm").read_text() for task in Path("/proc/self/task").iterdir())
    print(f"rank {finished_at['rank']}: gloo threads={gloo} exit took={time.monotonic() - finished_at['t']:.2f}s", flush=True)


class Trainer:
    """Refers to itself, as an optimizer's parts do: unreachable at exit, it waits for the garbage collector."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.me = self
        self.model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), process_group=group)


def train() -> None:
    group = dist.new_group([0, 1])  # (held by the model alone once this function returns)
    trainer = Trainer(group)
    trainer.model(torch.ones(3, 2)).sum().backward()
    if dist.get_rank() == 1:
        tensor = torch.ones(1000)
        work = dist.all_reduce(tensor, group=group, async_op=True)
        del tensor, work  # the collective holds the tensor's last reference until it completes
    else:
        time.sleep(2.0)
        dist.all_reduce(torch.ones(1000), group=group)
    finished_at.update(rank=dist.get_rank(), t=time.monotonic())
    dist.destroy_process_group()


atexit.register(report)
dist.init_process_group("gloo")
get_backend("torch")  # the caller's group: the engine registers its exit handlers, and creates nothing
train()
