"""Multi-process worker: an auxiliary head that runs on some ranks only in some steps (a layer skipped on one rank).

Each rank saves, per configuration and per step, its parameters, its K-FAC
state, the aux layer's running factors and the aux layer's own batch factors
(from its inputs and output gradients, where it ran) to ``<out>/rank<r>.pt``;
the test compares the ranks with each other (bitwise, after every step), with
the in-process engine, and the aux factors with the rule (the mean over the
ranks that ran it).

    torchrun --nproc_per_node 2 tests/workers/partial_skip_check.py --backend torch --out DIR
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

from nets import batch, shared_net
from rank_results import save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

GLOBAL_BATCH = 12
#: step -> the ranks on which the aux head runs: everywhere, rank 0 only (after running everywhere), nowhere,
#: rank 0 only (after running nowhere), everywhere, rank 1 only, rank 0 only.
RUNS: list[tuple[int, ...]] = [(0, 1), (0,), (), (0,), (0, 1), (1,), (0,)]
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)
CONFIGS: dict[str, dict[str, Any]] = {
    "optimal": dict(BASE, fusion="optimal"),
    "threshold-no-pipelining": dict(BASE, fusion="threshold", fusion_threshold_bytes=300, pipelining=False),
    "naive-eigen-lbp": dict(BASE, fusion="naive", compute_method="eigen", placement="lbp"),
    "update-fusion-backward": dict(BASE, kl_clip=None, update_fusion="backward", inv_update_freq=3),
    "accumulate-2": dict(BASE, accumulation_steps=2),
    "dp-lbp": dict(BASE, placement="lbp", distribute_preconditioning=True),
    # Where the aux head does not run, it is called with no sample (an empty shard): the same as not called.
    "empty-input": dict(BASE),
    # The model in DistributedDataParallel(find_unused_parameters=True) on torchrun workers, given to the optimizer
    # or wrapped after it was built (adopted): DDP averages the gradients; the bare model elsewhere (the reference).
    "ddp-optimal": dict(BASE, fusion="optimal"),
    "ddp-after-threshold": dict(BASE, fusion="threshold", fusion_threshold_bytes=300),
}
EMPTY_INPUT = {"empty-input"}


def _aux_factors(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hooks that record the aux head's (input, output gradient) of every call."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = inputs[0].detach().clone()
        output.register_hook(lambda g: calls.append((x, g.detach().clone())))

    model.aux.register_forward_hook(hook)
    return calls


def local_factors(calls: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The aux head's batch factors on this rank, from the definition: A = mean of [x,1][x,1]^T over the rows of
    each micro-batch, averaged over them; G = n g^T g per micro-batch (g the output gradient of the micro-batch
    loss, without its 1/accumulate), averaged over them."""
    calls = [(x, g) for x, g in calls if x.shape[0] > 0]  # (a call with no sample computes no factor)
    if not calls:
        return None
    a_terms, g_terms = [], []
    for x, g in calls:
        rows = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
        a_terms.append(rows.T @ rows / x.shape[0])
        g = g * accumulate
        g_terms.append(x.shape[0] * g.T @ g)
    return torch.stack(a_terms).mean(0), torch.stack(g_terms).mean(0)


def run(backend: CommBackend, models: dict[str, nn.Module] | None = None, names: list[str] | None = None) -> dict[str, Any]:
    """Every configuration (or those ``names``) trained for ``len(RUNS)`` steps on this rank's shard; what each step left.

    ``models`` (one per configuration) are built by the caller for in-process ranks (seeding is process-wide)."""
    torch.set_default_dtype(torch.float64)
    x, y = batch(GLOBAL_BATCH)
    local = GLOBAL_BATCH // backend.size
    x, y = x[backend.rank * local : (backend.rank + 1) * local], y[backend.rank * local : (backend.rank + 1) * local]
    results: dict[str, Any] = {}
    for name in CONFIGS if names is None else names:
        options = CONFIGS[name]
        model = shared_net() if models is None else models[name]
        calls = _aux_factors(model)
        wrap = name.startswith("ddp") and backend.name == "torch" and backend.size > 1
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if wrap else model
        opt = SPDKFACOptimizer(model if "after" in name else ddp, backend=backend, **options)
        aux = next(layer for layer in opt.layers if layer.name == "aux")
        accumulate = opt.config.accumulation_steps
        steps = []
        for s, ranks in enumerate(RUNS):
            calls.clear()
            opt.zero_grad()
            for xm, ym in zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate)):
                out = ddp(xm, aux=backend.rank in ranks)
                if name in EMPTY_INPUT and backend.rank not in ranks:
                    out = out + model.aux(xm.new_zeros(0, 6)).sum(0)  # (a zero gradient for the aux head)
                (nn.functional.cross_entropy(out, ym) / accumulate).backward()
            opt.step()
            steps.append(
                {
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "kfac": opt.state_dict()["kfac"],
                    "aux": (aux.factor("A"), aux.factor("G")),
                    "local": local_factors(calls, accumulate),
                    "skipped": list(opt.kfac_step.factors.skipped),
                }
            )
        results[name] = steps
        opt.remove_hooks()
    return results


if __name__ == "__main__":
    save_rank_results(run)
