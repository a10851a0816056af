"""Worker: bind to this worker's cores, start the engine, then report every thread's allowed cores."""

from __future__ import annotations

import glob
import os
import sys

import torch

from spdkfac.comm import get_backend
from spdkfac.runtime.affinity import bind_to_local_cores

available = sorted(os.sched_getaffinity(0))
share = bind_to_local_cores()
backend = get_backend("auto")  # its threads start after the binding
t = torch.ones(4)
backend.allreduce_async(t, "affinity.check").wait()
allowed = set()
for status in glob.glob("/proc/self/task/*/status"):
    with open(status) as fh:
        line = next(ln for ln in fh if ln.startswith("Cpus_allowed_list:"))
    cores = set()
    for part in line.split(":", 1)[1].strip().split(","):  # the kernel's list format, e.g. "0-2,5"
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    allowed.add(tuple(sorted(cores)))
# One write per report: the two workers share the launcher's stdout.
sys.stdout.write(f"AFFINITY rank={backend.rank} available={available} share={share} threads={sorted(list(c) for c in allowed)}\n")
sys.stdout.flush()
