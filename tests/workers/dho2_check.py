"""Multi-process worker: DHO2's distributed Lanczos and a few DHO2 steps on one shard of a fixed global batch.

Each rank saves what it computed (eigenpairs, tridiagonal, parameters) to
``<out>/rank<r>.pt``; the test compares the ranks with each other (bitwise)
and with one process on the whole batch.

    torchrun --nproc_per_node 2 tests/workers/dho2_check.py --backend torch --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import dho2_batch, dho2_net

from spdkfac.comm import CommBackend, get_backend
from spdkfac.dho2 import DHO2Optimizer, HessianVectorProduct, RowSplit, distributed_lanczos, extreme_eigenpairs
from spdkfac.dho2.lanczos import start_vector

GLOBAL_BATCH = 24
OPTIONS = dict(k=2, l=1, refresh_every=3, alpha=0.3, sigma=0.05, admm_period=4, lr=1e-2)


def run(backend: CommBackend, steps: int = 7, admm_rule: str = "code") -> dict[str, Any]:
    """The Lanczos results and the parameters after ``steps`` DHO2 steps (ADMM in form ``admm_rule``; outer steps
    after steps 4), on this rank's shard."""
    torch.set_default_dtype(torch.float64)
    x, y = dho2_batch(GLOBAL_BATCH)
    b = GLOBAL_BATCH // backend.size
    x, y = x[backend.rank * b : (backend.rank + 1) * b], y[backend.rank * b : (backend.rank + 1) * b]
    model = dho2_net()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    split = RowSplit(n, backend.size)
    hvp = HessianVectorProduct(nn.functional.cross_entropy(model(x), y), params, backend)
    result = distributed_lanczos(hvp, split, backend, 20, start_vector(n, 0, torch.float64, torch.device("cpu")))
    values, vectors = extreme_eigenpairs(result, split, backend, 3, 1)
    opt = DHO2Optimizer(model, backend=backend, admm_rule=admm_rule, **OPTIONS)
    for s in range(steps):
        xs = x + 0.1 * s
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), y).backward()
        opt.step(lambda xs=xs: nn.functional.cross_entropy(model(xs), y))
    return {
        "values": values,
        "vectors": vectors,
        "tridiagonal": result.tridiagonal,
        "basis_rows": result.rows.shape[0],
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
        "state": opt.state_dict()["dho2"],
        "memory": opt.memory_usage(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", required=True)
    ap.add_argument("--admm-rule", default="code")
    args = ap.parse_args()
    backend = get_backend(args.backend)
    torch.save(run(backend, admm_rule=args.admm_rule), Path(args.out) / f"rank{backend.rank}.pt")


if __name__ == "__main__":
    main()
