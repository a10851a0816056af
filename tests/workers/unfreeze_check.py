"""Multi-process worker: a layer frozen when the optimizer is built and unfrozen at step ``UNFREEZE``.

Each rank trains every configuration of ``CONFIGS`` on its shard of a fixed
batch per step and saves the parameters after every step to
``<out>/rank<r>.pt``; the test compares the ranks with each other (bitwise)
and with one process on the whole batch. ``train`` is also the unit tests'
loop (``tests/unit/step/test_unfreezing.py``).

    torchrun --nproc_per_node 2 tests/workers/unfreeze_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rank_results import save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend

warnings.filterwarnings("ignore", message="no perf_model given")

STEPS, UNFREEZE, BATCH = 8, 4, 8
CONFIGS: dict[str, dict[str, Any]] = {
    "every-step": {},
    "grad-workers-half": {"grad_worker_fraction": 0.5},
    "amortised": {"factor_update_freq": 2, "inv_update_freq": 2},
    "accumulate-2": {"accumulation_steps": 2},
}


class Net(nn.Module):
    """A convolution (frozen at first), then two Linear layers; ``no_grad_first`` runs the first under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Conv2d(2, 3, 3)
        self.mid = nn.Linear(48, 5)
        self.head = nn.Linear(5, 3)
        self.no_grad_first = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.no_grad_first):
            h = torch.tanh(self.first(x)).flatten(1)
        out: torch.Tensor = self.head(torch.tanh(self.mid(h)))
        return out


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 2, 6, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]


def train(
    reference: bool, options: dict[str, Any], backend: Any = "single", when: str = "before-zero-grad", net: Net | None = None
) -> list[list[torch.Tensor]]:
    """The parameters after every step, unfreezing ``first`` at step ``UNFREEZE`` (``when``: before ``zero_grad()``
    or between it and the forward pass). ``reference``: ``first`` is trainable from the start and runs under
    no_grad until then. ``net``: built by the caller for in-process ranks (seeding is process-wide)."""
    net = (net or Net()).double()
    if reference:
        net.no_grad_first = True
    else:
        net.first.requires_grad_(False)
    opt = SPDKFACOptimizer(net, lr=0.1, damping=0.01, backend=backend, **options)
    rank, size = (0, 1) if isinstance(backend, str) else (backend.rank, backend.size)
    share = BATCH // size
    after = []
    for s, (x, y) in enumerate(batches()):
        if s == UNFREEZE:
            net.no_grad_first = False
            if when == "before-zero-grad":
                net.first.requires_grad_(True)
        opt.zero_grad()
        if s == UNFREEZE and when == "before-forward":
            net.first.requires_grad_(True)
        k = options.get("accumulation_steps", 1)
        for m in range(k):  # (the worker's share in k micro-batches)
            part = slice(rank * share + m * share // k, rank * share + (m + 1) * share // k)
            (F.cross_entropy(net(x[part].double()), y[part]) / k).backward()
        opt.step()
        after.append([p.detach().clone() for p in net.parameters()])
    if not reference:
        assert [layer.name for layer in opt.layers] == ["first", "mid", "head"]
    opt.remove_hooks()
    return after


def run(backend: CommBackend) -> dict[str, list[list[torch.Tensor]]]:
    torch.set_default_dtype(torch.float64)
    return {name: train(False, options, backend) for name, options in CONFIGS.items()}


if __name__ == "__main__":
    save_rank_results(run)
