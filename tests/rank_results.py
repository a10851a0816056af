"""The command line of the workers that save their ``run(backend)`` results per rank, for the test to compare."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spdkfac.comm import CommBackend, get_backend


def save_rank_results(run: Callable[[CommBackend], Any]) -> None:
    """``--backend`` (default auto), ``--out DIR``: one thread, ``run(backend)`` saved as ``DIR/rank<r>.pt``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = get_backend(args.backend)
    torch.save(run(backend), Path(args.out) / f"rank{backend.rank}.pt")
