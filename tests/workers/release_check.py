"""Multi-process worker: optimizers let go of are freed, and a second optimizer on the same model takes it over.

With N workers every parameter carries a gradient hook (the all-reduce starts
from it); those hooks live in C++, and while they held the optimizer, no
optimizer of a multi-worker job was ever freed. Each rank:

- trains each of ``LET_GO`` for two steps, lets it go, and records whether the
  optimizer and its model were freed;
- trains a model two steps with one optimizer, then two with a new one on the
  same model (the first still referred to, as an LR scheduler would), records
  the parameters after every step and whether the first then refuses to step.

Saved to ``<out>/rank<r>.pt``; ``two_stages`` is also the test's one-process reference.

    torchrun --nproc_per_node 2 tests/workers/release_check.py --backend torch --out DIR
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nets import small_net
from rank_results import rank_shard, save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

BATCH = 8
LET_GO: dict[str, dict[str, Any]] = {
    "every-step": {},
    "accumulate-2": {"accumulation_steps": 2},
    "backward-update-fusion": {"update_fusion": "backward", "kl_clip": None},
}


def _steps(model: torch.nn.Module, opt: SPDKFACOptimizer, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> list[list[torch.Tensor]]:
    k = opt.kfac_step.grads.accumulation_steps
    after = []
    for s in range(steps):
        opt.zero_grad()
        for xm, ym in zip((x + 0.1 * s).chunk(k), y.chunk(k), strict=True):
            (F.cross_entropy(model(xm), ym) / k).backward()
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def _freed(backend: Any, x: torch.Tensor, y: torch.Tensor, options: dict[str, Any]) -> bool:
    def build() -> list[weakref.ref[Any]]:
        model = small_net()
        opt = SPDKFACOptimizer(model, lr=0.05, backend=backend, **options)
        _steps(model, opt, x, y)
        return [weakref.ref(model), weakref.ref(opt)]

    refs = build()
    gc.collect()
    return all(r() is None for r in refs)


def two_stages(backend: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list[list[torch.Tensor]], bool]:
    """The parameters after each of 2 + 2 steps, and whether the first optimizer refused to step after the takeover."""
    model = small_net()
    first = SPDKFACOptimizer(model, lr=0.05, momentum=0.9, backend=backend)
    after = _steps(model, first, x, y)
    second = SPDKFACOptimizer(model, lr=0.02, momentum=0.9, backend=backend)  # ``first`` still referred to
    after += _steps(model, second, x, y)
    try:
        first.step()
        refused = False
    except RuntimeError:
        refused = True
    return after, refused


def run(backend: CommBackend) -> dict[str, Any]:
    x, y = rank_shard(backend, BATCH)
    after, refused = two_stages(backend, x, y)
    return {
        "freed": {name: _freed(backend, x, y, options) for name, options in LET_GO.items()},
        "two_stages": after,
        "first_refused": refused,
    }


if __name__ == "__main__":
    save_rank_results(run)
