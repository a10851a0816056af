"""Multi-process worker (torchrun): a loss with weights of its own beside the model, wired five ways.

DDP averages the gradients of the module it wraps only, and a
``KFACPreconditioner`` without ``optimizer=`` (KAISA's usage) is not told the
optimizer that holds the loss's weights. The optimizer averages those
parameters itself, so the workers stay bitwise replicas and equal one process
on the global batch. The wirings: the group added to an optimizer built on
the DDP model; the model wrapped in DDP after the optimizer was built
(accelerate's ``prepare()``); a ``KFACPreconditioner`` attached to the user's
SGD under DDP; and unattached, with and without DDP. With ``--backend
single`` every wiring runs on the bare model (the reference).

    torchrun --nproc_per_node 2 tests/workers/beside_model_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import small_net
from rank_results import rank_shard, save_rank_results

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

WIRINGS = ("ddp-then-group", "group-then-ddp", "attached-preconditioner", "unattached-preconditioner", "unattached-preconditioner-ddp")


class CentreLoss(nn.Module):
    """Cross-entropy on scaled similarities to learned class centres (a metric-learning loss's own weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.centres = nn.Parameter(torch.randn(5, 5))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.scale * features @ self.centres.T, y)


def trained(backend: CommBackend, wiring: str) -> dict[str, torch.Tensor]:
    x, y = rank_shard(backend, 8)
    net, loss_fn = small_net(), CentreLoss()
    distributed = backend.size > 1
    model: nn.Module = net
    preconditioner = None
    if "preconditioner" in wiring:
        under_ddp = distributed and (wiring.startswith("attached") or wiring.endswith("-ddp"))
        model = DistributedDataParallel(net) if under_ddp else net
        sgd = torch.optim.SGD([*net.parameters(), *loss_fn.parameters()], lr=0.05, momentum=0.9)
        attached = wiring.startswith("attached")
        preconditioner = KFACPreconditioner(model, lr=0.05, backend=backend, optimizer=sgd if attached else None)
        if attached:
            preconditioner = None  # (the optimizer's step() preconditions)
        opt: torch.optim.Optimizer = sgd
    elif wiring == "ddp-then-group":
        model = DistributedDataParallel(net) if distributed else net
        opt = SPDKFACOptimizer(model, lr=0.05, backend=backend)
        opt.add_param_group({"params": loss_fn.parameters(), "lr": 0.02})
    else:
        opt = SPDKFACOptimizer(net, lr=0.05, backend=backend)
        opt.add_param_group({"params": loss_fn.parameters(), "lr": 0.02})
        model = DistributedDataParallel(net) if distributed else net  # (wrapped afterwards, as accelerate does)
    for step in range(4):
        opt.zero_grad()
        loss_fn(model(x + 0.1 * step), y).backward()
        if preconditioner is not None:  # (KAISA's usage: before the optimizer's step)
            preconditioner.step()
        opt.step()
    return {f"model.{k}": v.detach().clone() for k, v in net.state_dict().items()} | {
        f"loss.{k}": v.detach().clone() for k, v in loss_fn.state_dict().items()
    }


if __name__ == "__main__":
    save_rank_results(lambda backend: {wiring: trained(backend, wiring) for wiring in WIRINGS})
