"""Multi-process worker: layers used several times per step, checkpointed, and a head that runs on odd steps only;
a language model whose output layer is tied to its embedding.

Each rank saves its parameters and K-FAC state per configuration to
``<out>/rank<r>.pt``; the test compares the ranks with each other (bitwise)
and with one process on the whole batch.

    torchrun --nproc_per_node 2 tests/workers/shared_layers_check.py --backend torch --out DIR
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

from nets import shared_net
from rank_results import rank_shard, save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

GLOBAL_BATCH = 12
STEPS = 5  # the last step (4) runs without the aux head
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)
#: name -> (the trunk's checkpointing, optimizer options)
CONFIGS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "plain-optimal": (None, dict(BASE, fusion="optimal")),
    "non-reentrant-threshold": ("non-reentrant", dict(BASE, fusion="threshold", fusion_threshold_bytes=300)),
    "reentrant-no-pipelining": ("reentrant", dict(BASE, fusion="optimal", pipelining=False)),
    "sequential-eigen-lbp": ("sequential", dict(BASE, compute_method="eigen", placement="lbp")),
    "plain-accumulate-2": (None, dict(BASE, accumulation_steps=2, factor_update_freq=2, inv_update_freq=2)),
}
#: name -> optimizer options, for the tied language model (:class:`TiedLM`)
TIED_CONFIGS: dict[str, dict[str, Any]] = {
    "tied-inverse": dict(BASE),
    "tied-eigen-half-workers": dict(BASE, compute_method="eigen", grad_worker_fraction=0.5),
    "tied-ekfac-adam-diagonal": dict(
        {k: v for k, v in BASE.items() if k != "momentum"},
        compute_method="ekfac",
        base="adamw",
        ekfac_update="adam",
        kl_clip=None,
        max_factor_dim=16,
        inv_update_freq=2,
    ),
}
VOCAB, WIDTH = 24, 6


class TiedLM(nn.Module):
    """Token embedding, a Linear layer, an output layer holding the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.wte(ids)))).transpose(1, 2)


def run_tied(backend: CommBackend) -> dict[str, Any]:
    """Every tied configuration trained for ``STEPS`` steps on this rank's shard of a fixed batch of token ids."""
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, 5), generator=torch.Generator().manual_seed(6))
    local = GLOBAL_BATCH // backend.size
    mine = ids[backend.rank * local : (backend.rank + 1) * local]
    results: dict[str, Any] = {}
    for name, options in TIED_CONFIGS.items():
        model = TiedLM()
        opt = SPDKFACOptimizer(model, backend=backend, **options)
        assert opt.layers[0].tied_output is opt.layers[-1]
        for _ in range(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(mine[:, :-1]), mine[:, 1:]).backward()
            opt.step()
        results[name] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "kfac": opt.state_dict()["kfac"]}
        opt.remove_hooks()
    return results


def run(backend: CommBackend) -> dict[str, Any]:
    """Every configuration trained for ``STEPS`` steps on this rank's shard: parameters and K-FAC state."""
    x, y = rank_shard(backend, GLOBAL_BATCH)
    results: dict[str, Any] = {}
    for name, (mode, options) in CONFIGS.items():
        model = shared_net(checkpoint_mode=mode)
        opt = SPDKFACOptimizer(model, backend=backend, **options)
        accumulate = opt.config.accumulation_steps
        for s in range(STEPS):
            opt.zero_grad()
            for xm, ym in zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate)):
                (nn.functional.cross_entropy(model(xm, aux=s % 2 == 1), ym) / accumulate).backward()
            opt.step()
        results[name] = {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "kfac": opt.state_dict()["kfac"],
            "skipped": list(opt.kfac_step.factors.skipped),
        }
        opt.remove_hooks()
    return {**results, **run_tied(backend)}


if __name__ == "__main__":
    save_rank_results(run)
