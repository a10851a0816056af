"""What the rank-result workers share: their command line, this rank's shard of the fixed batch, and saving per rank."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from nets import batch

from spdkfac.comm import CommBackend, get_backend

#: ``run(backend, configs, x, y, steps)`` of a worker that takes its configurations on the command line.
ConfigRun = Callable[[CommBackend, dict[str, Any], torch.Tensor, torch.Tensor, int], dict[str, Any]]


def rank_shard(backend: CommBackend, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 as the default dtype, then this rank's contiguous shard of ``batch(global_batch)``.

    Every rank's shards together are the global batch, so one process on the whole batch is the reference.
    """
    torch.set_default_dtype(torch.float64)
    x, y = batch(global_batch)
    local = global_batch // backend.size
    rows = slice(backend.rank * local, (backend.rank + 1) * local)
    return x[rows], y[rows]


def save_rank_results(run: Callable[[CommBackend], Any]) -> None:
    """``--backend`` (default auto), ``--out DIR``: one thread, ``run(backend)`` saved as ``DIR/rank<r>.pt``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = get_backend(args.backend)
    torch.save(run(backend), Path(args.out) / f"rank{backend.rank}.pt")


def save_config_results(run: ConfigRun, configs_help: str, steps: int) -> None:
    """``--backend`` (default auto), ``--configs JSON``, ``--global-batch`` (8), ``--steps`` (default ``steps``),
    ``--out OUT``: one thread, ``run(backend, configs, x, y, steps)`` on this rank's :func:`rank_shard`, saved as
    ``OUT.rank<r>``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--configs", required=True, help=configs_help)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = get_backend(args.backend)
    x, y = rank_shard(backend, args.global_batch)
    torch.save(run(backend, json.loads(args.configs), x, y, args.steps), f"{args.out}.rank{backend.rank}")
