"""Multi-process worker: a routed 'expert' that takes a different number of samples on each rank.

Each rank trains the unit test's ``Routed`` model on its half of the batch, per configuration, and saves its
parameters to ``<out>/rank<r>.pt``; the test compares the ranks with each other (bitwise) and with one
process on the whole batch.

    torchrun --nproc_per_node 2 tests/workers/uneven_samples_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rank_results import save_rank_results
from unit.step.test_uneven_samples import ONE_WORKER, SKIPS_A_MICRO_BATCH, UNEVEN, Routed, routed_data, train_routed

from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

#: name -> (the routing column, the optimizer's options); "ddp" in a name: the model in DistributedDataParallel
#: (find_unused_parameters=True: the expert may run on one rank only) under torch.distributed.
CONFIGS: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {
    "uneven": (UNEVEN, {}),
    "one-worker": (ONE_WORKER, {}),
    "uneven-eigen-no-pipelining": (UNEVEN, {"compute_method": "eigen", "pipelining": False}),
    "uneven-ddp": (UNEVEN, {}),
    "one-worker-ddp": (ONE_WORKER, {}),
    # with a loss's own weight beside the model, which the optimizer averages at step() under DDP
    "one-worker-ddp-beside": (ONE_WORKER, {"beside": True}),
    # 2 micro-batches per step: the expert takes no sample of one of rank 0's, so it runs once there and twice on rank 1
    # (6 steps: the fusion plan is made at the fourth, its factors sent at step() on rank 0)
    "skips-a-micro-batch-accumulated": (SKIPS_A_MICRO_BATCH, {"accumulation_steps": 2, "steps": 6, "profile_steps": 2}),
    "uneven-accumulated-ddp": (UNEVEN, {"accumulation_steps": 2}),
    # the first micro-batch inside DDP's no_sync() (accelerate's and Trainer's accumulation): the expert's gradient of
    # rank 0's first micro-batch, kept locally, is averaged with the last though the expert did not run in it there
    "skips-a-micro-batch-accumulated-ddp-no-sync": (SKIPS_A_MICRO_BATCH, {"accumulation_steps": 2, "no_sync": True}),
}


def run(backend: CommBackend) -> dict[str, list[torch.Tensor]]:
    torch.set_default_dtype(torch.float64)
    results = {}
    rows = slice(4 * backend.rank, 4 * backend.rank + 4) if backend.size == 2 else slice(None)
    for name, (route, options) in CONFIGS.items():
        if "ddp" in name and backend.name not in ("torch", "single"):  # (one process: the bare model, the reference)
            continue
        model = Routed()
        trained: Any = model
        if "ddp" in name and backend.size > 1:
            trained = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        results[name] = train_routed(model, backend, routed_data(route), rows, optimized=trained, **options)
    return results


if __name__ == "__main__":
    save_rank_results(run)
