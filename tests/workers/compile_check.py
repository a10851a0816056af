"""Multi-process worker: SPDKFACOptimizer and KFACPreconditioner on ``torch.compile``'d models, beside eager ones.

Launched by the tests with ``torchrun`` (gloo), or with ``--backend single``
for the one-process reference on the global batch (DDP configurations then run
the bare model, compiled or not as named). Float64, the small test network,
factors and inverses every 2 steps. Each rank trains on its contiguous shard
of a fixed global batch and saves, per configuration, its parameters (the bare
model's ``state_dict``), its optimizer state, the K-FAC layer names and
Dynamo's counts (graph breaks; graphs compiled in the first step and after it)
to ``OUT.rank<r>``.

A configuration is ``api`` (``'optimizer'``: ``SPDKFACOptimizer``, momentum
SGD; ``'preconditioner'``: ``KFACPreconditioner`` with ``torch.optim.SGD``),
``ddp`` (None, ``'outside'``: ``torch.compile(DDP(net))``, ``'inside'``:
``DDP(torch.compile(net))``) and ``compile`` (None, ``'wrap'``: the optimizer
is given the compiled model, ``'after'``: the model is compiled after the
optimizer was built on it).

    torchrun --nproc_per_node 2 tests/workers/compile_check.py --configs '<json>' --out result.pt
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import small_net
from rank_results import save_config_results

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")
warnings.filterwarnings("ignore", message="performance model")

OPTIONS = dict(lr=0.05, damping=0.01, factor_decay=0.9)
SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


def build(cfg: dict[str, Any], net: nn.Module, backend: Any) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """The model to run, the K-FAC object (optimizer or preconditioner) and the optimizer that steps."""
    compiled, ddp = cfg.get("compile"), cfg.get("ddp") if backend.size > 1 else None
    model: nn.Module = net
    if ddp == "inside" and compiled == "wrap":
        model = DistributedDataParallel(torch.compile(net))
    elif ddp is not None:
        model = DistributedDataParallel(net)
    if compiled == "wrap" and ddp != "inside":
        model = torch.compile(model)
    if cfg["api"] == "optimizer":
        opt = SPDKFACOptimizer(model, momentum=0.9, weight_decay=1e-3, factor_update_freq=2, inv_update_freq=2, **OPTIONS, backend=backend)
        kfac: Any = opt
    else:
        opt = torch.optim.SGD(model.parameters(), **SGD)
        kfac = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2, **OPTIONS, backend=backend)
    if compiled == "after":
        model = torch.compile(model)
    return model, kfac, opt


def train(model: nn.Module, kfac: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[int]:
    """``steps`` steps; the graphs Dynamo compiled by the end of each."""
    graphs = []
    for s in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        if kfac is not opt:
            kfac.step()
        opt.step()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return graphs


def run(backend: CommBackend, configs: dict[str, Any], x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """Every configuration trained for ``steps`` steps on this rank's shard: parameters, states, layers, Dynamo's counts."""
    results = {}
    for name, cfg in configs.items():
        torch._dynamo.reset()
        counters.clear()
        net = small_net()
        model, kfac, opt = build(cfg, net, backend)
        graphs = train(model, kfac, opt, x, y, steps)
        results[name] = {
            "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "optimizer_state": opt.state_dict(),
            "kfac_state": kfac.state_dict()["kfac"],
            "layers": [layer.name for layer in (kfac.layers if kfac is opt else kfac.kfac.layers)],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": graphs,
        }
        kfac.remove_hooks()
        print(f"rank {backend.rank}/{backend.size}: {name} done, graphs {graphs}", flush=True)
    return results


if __name__ == "__main__":
    save_config_results(run, "JSON object: name -> {'api', 'ddp', 'compile'}", steps=6)
