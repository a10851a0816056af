"""Multi-process worker: workers started with different torch thread counts (as Lightning's FSDP2 strategy leaves
them on CPUs) still hold bit-identical replicas, the optimizer having set every worker to the fewest.

Rank r runs ``r + 1`` threads before the optimizer is built (rank 0 one, rank
1 two); a wide Linear layer's factors are decomposed by every worker (every
layer's, with one per worker's worth of layers) and its gradient
preconditioned by every worker: products whose last bits depend on the
thread count. Records the thread count afterwards, the notices said,
and the parameters after each step.

    torchrun --nproc_per_node 2 tests/workers/thread_count_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rank_results import save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

STEPS, BATCH, WIDTH = 4, 64, 300


def run(backend: CommBackend) -> dict[str, Any]:
    torch.set_num_threads(backend.rank + 1)  # (save_rank_results set one)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    local = BATCH // backend.size
    x, y = x[backend.rank * local : (backend.rank + 1) * local], y[backend.rank * local : (backend.rank + 1) * local]
    opt = SPDKFACOptimizer(model, lr=0.1, momentum=0.9, damping=0.003, kl_clip=None, backend=backend, compute_method="eigen")
    after = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for s in range(STEPS):
            opt.zero_grad()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
            after.append([p.detach().clone() for p in model.parameters()])
    said_here = [str(w.message) for w in said if "torch threads" in str(w.message)]
    return {"threads": torch.get_num_threads(), "said": said_here, "after": after}


if __name__ == "__main__":
    save_rank_results(run)
