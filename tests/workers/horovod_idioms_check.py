"""Multi-process worker (horovodrun): Horovod's start-of-training idioms on SPDKFACOptimizer.

Every Horovod script broadcasts the parameters and the optimizer state from
rank 0 before training (``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``). The second steps a new optimizer once
with zero gradients set by hand so that a ``torch.optim`` optimizer creates
its state; here that step used to fail ("no Kronecker factor was computed").
Each rank records the parameters after every step of:

- ``plain``: three steps, no broadcast;
- ``broadcast``: the two broadcasts, then the same three steps;
- ``resumed``: a new model and optimizer loading ``plain``'s state after
  its first step, the optimizer state broadcast, then two steps (against
  ``plain``'s last two).

Saved to ``<out>/rank<r>.pt``.

    horovodrun -np 2 python tests/workers/horovod_idioms_check.py --backend horovod --out DIR
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
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

OPTIONS: dict[str, Any] = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "damping": 0.01}


def _step(model: torch.nn.Module, opt: SPDKFACOptimizer, x: torch.Tensor, y: torch.Tensor, s: int) -> list[torch.Tensor]:
    opt.zero_grad()
    F.cross_entropy(model(x + 0.1 * s), y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run(backend: CommBackend) -> dict[str, list[list[torch.Tensor]]]:
    import horovod.torch as hvd  # (initialised by the backend)

    x, y = rank_shard(backend, 8)
    model = small_net()
    opt = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
    plain = [_step(model, opt, x, y, 0)]
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))  # (state_dict() holds live tensors, as torch.optim's)
    plain += [_step(model, opt, x, y, s) for s in (1, 2)]

    model = small_net()
    opt = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # (before: "no Kronecker factor was computed")
    broadcast = [_step(model, opt, x, y, s) for s in range(3)]

    model = small_net(seed=3)
    opt = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    resumed = [_step(model, opt, x, y, s) for s in (1, 2)]
    return {"plain": plain, "broadcast": broadcast, "resumed": resumed}


if __name__ == "__main__":
    save_rank_results(run)
