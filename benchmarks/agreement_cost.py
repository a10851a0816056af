"""What the per-step agreement of the collective order costs (docs/shared-layers.md), as a share of a step.

    torchrun --nproc_per_node 2 -m benchmarks.agreement_cost --model mnist_cnn --resolution 28 --batch-size 32

Every step of SPD-KFAC with several workers ends its hook all-reduces with
one small all-reduce, the agreement, so that a layer that ran on some
workers only cannot pair collectives wrongly. This times SPD-KFAC's steps
(forward, backward, step; factors every step, decompositions every
``--inv-update-freq``) and, after each, ``--repeats`` all-reduces of the
agreement's size on the same engine; the ratio of one such all-reduce to the
step, per measured step, is the agreement's share of the step (median and
range). It is an upper bound on what the agreement adds: inside the step it
waits only for the slower rank's arrival, which a lone all-reduce also does.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.models import get_model

from .common import log, machine, rank_batch, save_json, start, stats, workload_parser


def main() -> None:
    ap = workload_parser(__doc__, iters=30, out_name="agreement_cost.json", model="mnist_cnn")
    ap.set_defaults(resolution=28, batch_size=32)
    ap.add_argument("--warmup", type=int, default=5, help="steps before the measured ones")
    ap.add_argument("--repeats", type=int, default=20, help="agreement-size all-reduces timed after each step")
    ap.add_argument("--inv-update-freq", type=int, default=10)
    args = ap.parse_args()
    if args.iters < 2 or args.warmup < 1 or args.repeats < 1:
        ap.error("--iters must be >= 2, --warmup and --repeats >= 1")
    backend = start(args)
    if backend.size < 2:
        raise SystemExit("error: run with 2 or more workers (torchrun or horovodrun): one worker has no agreement")
    rank = backend.rank
    torch.manual_seed(0)
    model = get_model(args.model)
    channels = 1 if args.model.startswith("mnist") else 3

    def classes(inputs: torch.Tensor) -> int:
        with torch.no_grad():
            return int(model(inputs).shape[1])

    x, y = rank_batch(rank, args.batch_size, args.resolution, channels, classes)
    opt = SPDKFACOptimizer(
        model, lr=0.01, backend=backend, factor_update_freq=1, inv_update_freq=args.inv_update_freq, perf_model=args.perf_model
    )
    order = opt.kfac_step.order
    steps: list[float] = []
    agreement: list[float] = []
    for it in range(args.warmup + args.iters):
        backend.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        t1 = time.perf_counter()
        mask = torch.zeros(order.agreement_entries, dtype=torch.float64)
        backend.barrier()
        t2 = time.perf_counter()
        for _ in range(args.repeats):
            backend.allreduce_async(mask, "agreement_cost").wait()
        t3 = time.perf_counter()
        if it >= args.warmup:
            steps.append(t1 - t0)
            agreement.append((t3 - t2) / args.repeats)
    ratios = [a / s for a, s in zip(agreement, steps)]
    result = {
        "args": vars(args),
        "machine": machine(),
        "workers": backend.size,
        "engine": backend.name,
        "agreement_entries": order.agreement_entries,
        "agreements_per_step": order.agreements / (args.warmup + args.iters),
        "step": stats(steps),
        "agreement": stats(agreement),
        "share": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    log(
        rank,
        f"agreement ({order.agreement_entries} float64 values): {1e3 * result['agreement']['median']:.3f} ms, "
        f"step {1e3 * result['step']['median']:.1f} ms: {100 * result['share']['median']:.2f}% of a step (median)",
    )
    if rank == 0:
        print(f"wrote {save_json(result, Path(args.out).name, Path(args.out).parent)}")


if __name__ == "__main__":
    main()
