"""Multi-process worker: the optimizer on a ``DistributedDataParallel``-wrapped model and on the bare model.

Launched by the tests with ``torchrun`` (gloo), or with ``--backend single``
for the one-process reference on the global batch (every configuration then
runs on the bare model). Each rank trains on its contiguous shard of a fixed
global batch and saves, per configuration, its parameters (the bare model's
``state_dict``), its optimizer state and the K-FAC layer names to ``OUT.rank<r>``.

A configuration is optimizer options plus ``ddp``: None (bare model) or the
``DistributedDataParallel`` keyword arguments, ``no_sync``: run every
micro-batch but the last inside ``model.no_sync()``, ``amp``: the GradScaler
loop (scale 1024), ``ddp_after``: build the optimizer on the bare model and
wrap it in DDP afterwards (as accelerate's ``prepare()`` does), and ``count``: count the
bytes DDP all-reduces (through a communication hook that adds the count to
DDP's own divide-then-all-reduce). The bytes of the optimizer's own gradient
all-reduces are counted always.

    torchrun --nproc_per_node 2 tests/workers/ddp_check.py --configs '<json>' --out result.pt
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import small_net
from rank_results import save_config_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")
warnings.filterwarnings("ignore", message="performance model")


def train(
    model: nn.Module, opt: SPDKFACOptimizer, x: torch.Tensor, y: torch.Tensor, steps: int, accumulate: int, no_sync: bool, scaler=None
) -> None:
    """``steps`` steps of ``accumulate`` micro-batches each (loss divided by their number), as torch's idiom; with a
    GradScaler, the mixed-precision loop's calls."""
    for s in range(steps):
        xs = x + 0.1 * s  # different data each step, the same on every split of the batch
        opt.zero_grad()
        chunks = list(zip(xs.chunk(accumulate), y.chunk(accumulate)))
        for i, (xm, ym) in enumerate(chunks):
            quiet = no_sync and i < len(chunks) - 1 and isinstance(model, DistributedDataParallel)
            with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                loss = nn.functional.cross_entropy(model(xm), ym) / accumulate
                (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()


def run(backend: CommBackend, configs: dict[str, Any], x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """Every configuration trained for ``steps`` steps on this rank's shard: parameters, state, layers, bytes sent."""
    sent = {"optimizer": 0, "ddp": 0}  # gradient bytes all-reduced by the optimizer, by DDP
    allreduce = backend.allreduce_async

    def counted(tensor: torch.Tensor, name: str):
        if name.startswith("spdkfac.grad."):
            sent["optimizer"] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, name)

    def ddp_hook(state, bucket):  # (DDP rejects the string annotations of ``from __future__ import annotations``)
        sent["ddp"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)

    backend.allreduce_async = counted  # type: ignore[method-assign]
    results = {}
    for name, cfg in configs.items():
        cfg = dict(cfg)
        ddp_options, no_sync, count = cfg.pop("ddp", None), cfg.pop("no_sync", False), cfg.pop("count", False)
        after = cfg.pop("ddp_after", False)
        net = small_net()
        model: nn.Module = DistributedDataParallel(net, **ddp_options) if ddp_options is not None and backend.size > 1 else net
        scaler = cfg["grad_scaler"] = torch.amp.GradScaler("cpu", init_scale=1024.0) if cfg.pop("amp", False) else None
        if count and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, ddp_hook)
        opt = SPDKFACOptimizer(net if after else model, backend=backend, **cfg)
        sent.update(optimizer=0, ddp=0)
        train(model, opt, x, y, steps, cfg.get("accumulation_steps", 1), no_sync, scaler)
        state = opt.state_dict()
        results[name] = {
            "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "optimizer_state": state,
            "layers": sorted(state["kfac"]["layers"]),
            "steps": opt.steps,
            "gradient_bytes": dict(sent),
        }
        opt.remove_hooks()
        print(f"rank {backend.rank}/{backend.size}: {name} done", flush=True)
    return results


if __name__ == "__main__":
    save_config_results(run, "JSON object: name -> optimizer kwargs + 'ddp' (kwargs or null) + 'no_sync'", steps=8)
