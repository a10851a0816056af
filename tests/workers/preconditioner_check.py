"""Multi-process worker: KFACPreconditioner with torch's own optimizers on one shard of a fixed global batch.

Each rank saves its parameters, its optimizer's state and the preconditioner's
state per configuration to ``<out>/rank<r>.pt``; the test compares the ranks
with each other (bitwise) and with one process on the whole batch.

    torchrun --nproc_per_node 2 tests/workers/preconditioner_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import small_net
from rank_results import rank_shard, save_rank_results

from spdkfac import KFACPreconditioner, LambdaParamScheduler
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

GLOBAL_BATCH = 8
STEPS = 6
#: name -> (torch optimizer, its options, the preconditioner's options in KAISA's names)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "sgd-eigen-2-4": (
        "sgd",
        dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
        dict(compute_method="eigen", factor_update_steps=2, inv_update_steps=4, damping=0.01, kl_clip=0.01),
    ),
    "adamw-inverse-memopt": (
        "adamw",
        dict(lr=0.01, weight_decay=1e-2),
        dict(compute_method="inverse", grad_worker_fraction="MEM_OPT", damping=0.01, kl_clip=0.01),
    ),
    # The model wrapped in DistributedDataParallel on several workers (DDP averages the gradients; the bare model in
    # the one-process reference): KAISA's usage.
    "ddp-sgd-eigen": (
        "sgd",
        dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
        dict(compute_method="eigen", factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=0.01, skip_layers=["Linear$"]),
    ),
    "sgd-accumulated": (
        "sgd",
        dict(lr=0.05, momentum=0.9),
        dict(compute_method="inverse", accumulation_steps=2, factor_update_steps=3, inv_update_steps=3, damping=0.01),
    ),
    # Attached to the optimizer (optimizer=: its step() preconditions, the KL clip's lr is its), and the model wrapped
    # in DDP after both were built, as Hugging Face's Trainer and accelerate do: the DDP is adopted.
    "attached-ddp-after-adamw": (
        "adamw",
        dict(lr=0.01, weight_decay=1e-2),
        dict(compute_method="eigen", factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=0.01),
    ),
    # The same with torch's ZeroRedundancyOptimizer around AdamW on several workers (each rank updates its shard of
    # the parameters and broadcasts it; plain AdamW in the one-process reference): its state, consolidated, is saved.
    "attached-ddp-after-zero-adamw": (
        "zero-adamw",
        dict(lr=0.01, weight_decay=1e-2),
        dict(compute_method="inverse", factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=0.01),
    ),
    # KAISA's vision example's options as it passes them (the model in DDP), and its LambdaParamScheduler stepped after
    # each step ("lambdas": its arguments): the damping halved at step 2, the intervals doubled at 3.
    "kaisa-vision-example": (
        "sgd",
        dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
        dict(
            factor_update_steps=1,
            inv_update_steps=1,
            damping=0.01,
            factor_decay=0.95,
            kl_clip=0.01,
            accumulation_steps=1,
            allreduce_bucket_cap_mb=25,
            colocate_factors=True,
            compute_method="INVERSE",
            grad_worker_fraction="HYBRID_OPT",
            grad_scaler=None,
            skip_layers=[],
            lambdas=dict(
                damping_lambda=lambda s: 0.5 if s == 2 else 1.0,
                factor_update_steps_lambda=lambda s: 2.0 if s == 3 else 1.0,
                inv_update_steps_lambda=lambda s: 2.0 if s == 3 else 1.0,
            ),
        ),
    ),
}


def _optimizer(kind: str, model: nn.Module, options: dict[str, Any], workers: int) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), **options)
    if kind == "zero-adamw" and workers > 1:
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, foreach=False, **options)
    return torch.optim.AdamW(model.parameters(), foreach=False, **options)


def _state_dict(optimizer: torch.optim.Optimizer, backend: CommBackend) -> dict[str, Any]:
    """The optimizer's whole state on every rank (ZeroRedundancyOptimizer gathers its shards to one rank at a time)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    state: dict[str, Any] = {}
    for rank in range(backend.size):
        optimizer.consolidate_state_dict(to=rank)
        if rank == backend.rank:
            state = optimizer.state_dict()
    return state


def run(backend: CommBackend) -> dict[str, Any]:
    """Every configuration trained for ``STEPS`` steps on this rank's shard: parameters and states."""
    x, y = rank_shard(backend, GLOBAL_BATCH)
    results: dict[str, Any] = {}
    for name, (kind, options, given) in CONFIGS.items():
        kfac_options = dict(given)
        lambdas = kfac_options.pop("lambdas", None)
        net = small_net()
        wrap = ("ddp" in name or "kaisa" in name) and backend.size > 1
        attached = name.startswith("attached")
        model: nn.Module = nn.parallel.DistributedDataParallel(net) if wrap and not attached else net
        optimizer = _optimizer(kind, model, options, backend.size)
        if attached:
            preconditioner = KFACPreconditioner(model, optimizer=optimizer, backend=backend, **kfac_options)
            model = nn.parallel.DistributedDataParallel(net) if wrap else net
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="allreduce_bucket_cap_mb")
                preconditioner = KFACPreconditioner(
                    model, lr=lambda _s, o=optimizer: o.param_groups[0]["lr"], backend=backend, **kfac_options
                )
        scheduler = None if lambdas is None else LambdaParamScheduler(preconditioner, **lambdas)
        accumulate = preconditioner.kfac.config.accumulation_steps
        for s in range(STEPS):
            optimizer.zero_grad()
            for xm, ym in zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate)):
                (nn.functional.cross_entropy(model(xm), ym) / accumulate).backward()
            if not attached:
                preconditioner.step()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        results[name] = {
            "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "optimizer": _state_dict(optimizer, backend),
            "kfac": preconditioner.state_dict()["kfac"],
        }
        preconditioner.remove_hooks()
    return results


if __name__ == "__main__":
    save_rank_results(run)
