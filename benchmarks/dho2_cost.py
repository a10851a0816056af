"""DHO2's cost per iteration, split into gradient / eigenpair refresh / update, and its curvature memory per worker.

    python -m benchmarks.dho2_cost --model mnist_cnn                         # 1 worker
    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.dho2_cost --model mnist_cnn

Each worker trains the model on random inputs of its data set's shape
(``--batch-size`` per worker) with ``dho2`` for ``--iters`` measured steps
after one warm-up refresh, the eigenpairs refreshed every
``--refresh-every`` steps. Per step it times the gradient (forward, backward
and the gradient all-reduce), the refresh (Hessian-vector products, the
distributed Lanczos and the eigenpairs; refresh steps only) and the update
(the hybrid step). Seconds are means over the workers; memory is rank 0's
(``DHO2Optimizer.memory_usage()``; the Lanczos basis is the largest
worker's block, n·m/P values). Writes ``<out>/w<P>.json``, one file per
worker count, so runs at 1 and 2 workers sit side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac.dho2 import DHO2Optimizer
from spdkfac.dho2.lanczos import lanczos_memory
from spdkfac.models import get_model
from spdkfac.train.job import average_over_workers

from .common import RESULTS, machine, save_json, start, workload_parser

INPUT_SHAPES = {"digits_cnn": (1, 8, 8), "mnist_cnn": (1, 28, 28), "cifar_resnet20": (3, 32, 32)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = workload_parser(__doc__, iters=20, model="mnist_cnn")
    ap.set_defaults(batch_size=32)
    ap.add_argument("--refresh-every", type=int, default=5, help="T: steps between refreshes")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--l", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "dho2_cost"), help="output folder (w<P>.json)")
    args = ap.parse_args(argv)
    if args.model not in INPUT_SHAPES:
        ap.error(f"--model must be one of {sorted(INPUT_SHAPES)}")
    if args.iters < 1 or args.refresh_every < 1:
        ap.error("--iters and --refresh-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    backend = start(args)
    rank, size = backend.rank, backend.size
    torch.manual_seed(0)
    model = get_model(args.model, num_classes=10)
    opt = DHO2Optimizer(model, lr=1e-3, k=args.k, l=args.l, refresh_every=args.refresh_every, backend=backend)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch_size, *INPUT_SHAPES[args.model], generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    grad_s: list[float] = []
    refresh_s: list[float] = []
    update_s: list[float] = []
    for it in range(args.iters + 1):  # the first step (a refresh) warms up
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        t1 = time.perf_counter()
        refresh = opt.refresh_due
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
        if it == 0:
            continue
        grad_s.append(t1 - t0)
        update_s.append(opt.last_step_times["update"])
        if refresh:
            refresh_s.append(opt.last_step_times["refresh"])
    local = [statistics.fmean(grad_s), statistics.fmean(refresh_s) if refresh_s else 0.0, statistics.fmean(update_s)]
    grad, refresh, update = average_over_workers(backend, local, "dho2_cost.times", torch.device("cpu"))
    memory = opt.memory_usage()
    result: dict[str, object] = {
        "args": vars(args),
        "machine": machine(),
        "engine": backend.name,
        "world_size": size,
        "model": args.model,
        "params": opt.n,
        "lanczos_steps": opt.lanczos_steps,
        "refreshes_timed": len(refresh_s),
        "grad_s": grad,
        "refresh_s": refresh,
        "update_s": update,
        "per_iteration_s": grad + update + refresh / args.refresh_every,
        "memory": memory,
        "predicted_memory": predicted_memory(opt.n, opt.lanczos_steps, memory, PREDICTED_WORKERS),
    }
    measured_basis = memory["lanczos_basis"]
    own = lanczos_memory(opt.n, opt.lanczos_steps, size, 4)
    if rank == 0 and own != measured_basis:
        print(f"warning: the analytic Lanczos basis at {size} worker(s), {own} bytes, differs from the measured {measured_basis}")
    if rank == 0:
        print(
            f"{args.model} (n={opt.n}, m={opt.lanczos_steps}), {size} worker(s) via {backend.name}, batch {args.batch_size}/worker: "
            f"gradient {grad * 1e3:.1f} ms, refresh {refresh * 1e3:.1f} ms every {args.refresh_every} steps, "
            f"update {update * 1e3:.1f} ms; Lanczos basis {memory['lanczos_basis'] / 2**20:.2f} MiB per worker"
        )
        print(f"wrote {save_json(result, f'w{size}.json', Path(args.out))}")
    return result


#: Worker counts of the analytic memory prediction.
PREDICTED_WORKERS = (1, 2, 8, 16, 32, 64)


def predicted_memory(n: int, steps: int, measured: dict[str, int], workers: Sequence[int]) -> list[dict[str, int]]:
    """Curvature memory per worker at other worker counts, from the same formula the optimizer allocates by.

    Only the Lanczos basis ``D`` is split across workers (``ceil(n/P)·m``
    float32 values, :func:`spdkfac.dho2.lanczos.lanczos_memory`); the
    eigenvectors, the ADMM variables and the base optimizer's state are
    replicated, so they are taken as measured.
    """
    replicated = sum(v for k, v in measured.items() if k != "lanczos_basis")
    rows = []
    for p in workers:
        basis = lanczos_memory(n, steps, p, 4)
        rows.append({"workers": p, "lanczos_basis": basis, "replicated": replicated, "total": basis + replicated})
    return rows


if __name__ == "__main__":
    main()
