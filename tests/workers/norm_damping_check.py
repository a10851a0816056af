"""Multi-process worker: ``norm_layers='kfac'`` and ``damping='adaptive'`` on one shard of a fixed global batch.

A LayerNorm/GroupNorm net (each sample normalised alone, so one process on the
whole batch is the reference) trained with the adaptive damping adjusted every
2 steps; each rank saves its parameters and its damping after every step to
``<out>/rank<r>.pt``.

    torchrun --nproc_per_node 2 tests/workers/norm_damping_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rank_results import rank_shard, save_rank_results

from spdkfac import AdaptiveDamping, SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

GLOBAL_BATCH = 8
STEPS = 6


def norm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(144, 6),
        nn.LayerNorm(6),
        nn.Tanh(),
        nn.Linear(6, 5),
    )


def run(backend: CommBackend) -> dict[str, Any]:
    """The net trained for ``STEPS`` steps on this rank's shard: parameters and the damping after each step."""
    x, y = rank_shard(backend, GLOBAL_BATCH)
    model = norm_net()
    opt = SPDKFACOptimizer(model, lr=0.2, backend=backend, norm_layers="kfac", damping=AdaptiveDamping(initial=0.05, interval=2))
    dampings = []
    for s in range(STEPS):
        opt.zero_grad()
        xs = x + 0.1 * s
        nn.functional.cross_entropy(model(xs), y).backward()
        opt.step(lambda xs=xs: nn.functional.cross_entropy(model(xs), y))
        dampings.append(opt.param_groups[0]["damping"])
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "dampings": dampings}


if __name__ == "__main__":
    save_rank_results(run)
