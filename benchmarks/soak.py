"""Soak run: thousands of steps with random delays on one worker; replicas, memory and pending work must not drift.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.soak --steps 3000
    torchrun --nproc_per_node 2 -m benchmarks.soak --steps 3000

Trains a small CNN with SPD-KFAC (factors every step, inverses every 10,
owners broadcasting their inverses: ``placement='seq'``) on random data in
float32. The last rank sleeps a random 0-``--max-delay-ms`` before a random
third of its steps, so the other worker waits in different collectives each
time. Every ``--every`` steps each rank records its resident memory and the
work still pending in the optimizer after ``step()`` (gradient handles,
factor all-reduces in flight). At the end all ranks compare a bitwise digest
of their parameters, momentum buffers, factors and inverses. Writes
``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn as nn

from benchmarks.common import RESULTS, log, machine, save_json, start
from spdkfac import SPDKFACOptimizer
from spdkfac.runtime.affinity import add_bind_cores_option
from spdkfac.runtime.output_path import output_file


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def _digest(model: nn.Module, opt: SPDKFACOptimizer) -> str:
    """SHA-256 of every parameter, momentum buffer, factor and inverse, byte for byte."""
    h = hashlib.sha256()
    for tensor in (
        list(model.state_dict().values())
        + [t for layer in opt.layers for t in (layer.A, layer.G, layer.decomposition("A"), layer.decomposition("G")) if t is not None]
        + [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    ):
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=100, help="sample memory and pending work every this many steps")
    ap.add_argument("--max-delay-ms", type=float, default=20.0)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--threads", type=int, default=1)
    add_bind_cores_option(ap)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"), type=output_file(make_parents=True))
    args = ap.parse_args(argv)
    if args.steps < 2 * args.every or args.every < 1:
        ap.error("--steps must be at least twice --every (a warm-up sample and a later one)")
    backend = start(args)
    rank, size = backend.rank, backend.size
    model = _net()
    opt = SPDKFACOptimizer(
        model, lr=0.01, momentum=0.9, weight_decay=5e-4, damping=0.03, kl_clip=1e-3, inv_update_freq=10, placement="seq", backend=backend
    )
    rng = random.Random(1234 + rank)
    data = torch.Generator().manual_seed(rank)
    proc = psutil.Process()
    samples: list[dict[str, float]] = []
    delayed = 0
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        if rank == size - 1 and rng.random() < 1 / 3:
            time.sleep(rng.uniform(0, args.max_delay_ms) / 1e3)
            delayed += 1
        x = torch.randn(args.batch_size, 3, 16, 16, generator=data)
        y = torch.randint(0, 10, (args.batch_size,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step % args.every == 0:
            samples.append(
                {
                    "step": step,
                    "rss_mb": proc.memory_info().rss / 2**20,
                    "pending_grad_handles": opt.kfac_step.grads.pending,
                    "pending_factor_allreduces": opt.kfac_step.controller.pending,
                }
            )
            log(rank, f"step {step}/{args.steps}: rss {samples[-1]['rss_mb']:.1f} MB, {time.perf_counter() - t0:.0f} s")
    digest = _digest(model, opt)
    if size > 1:  # every rank's digest, through the engine: compare them on rank 0
        code = torch.tensor([int(digest[i : i + 8], 16) for i in range(0, 64, 8)], dtype=torch.float64)
        gathered = []
        for root in range(size):
            t = code.clone()
            backend.broadcast_async(t, root, f"soak.digest.{root}").wait()
            gathered.append(t)
        identical = all(torch.equal(g, gathered[0]) for g in gathered)
    else:
        identical = True
    if size > 1:  # the delays happen on the last rank; rank 0 writes the result
        count = torch.tensor([float(delayed)], dtype=torch.float64)
        backend.broadcast_async(count, size - 1, "soak.delayed").wait()
        delayed = int(count.item())
    warm = [s for s in samples if s["step"] > args.steps // 10]
    result = {
        "steps": args.steps,
        "workers": size,
        "engine": backend.name,
        "delayed_steps_on_last_rank": delayed,
        "max_delay_ms": args.max_delay_ms,
        "replicas_bitwise_identical": identical,
        "digest_rank0": digest,
        "rss_mb_after_warmup": [warm[0]["rss_mb"], warm[-1]["rss_mb"]],
        "rss_growth_mb_after_warmup": warm[-1]["rss_mb"] - warm[0]["rss_mb"],
        "max_pending_grad_handles": max(s["pending_grad_handles"] for s in samples),
        "max_pending_factor_allreduces": max(s["pending_factor_allreduces"] for s in samples),
        "seconds": time.perf_counter() - t0,
        "samples": samples,
        "machine": machine(),
        "command": f"{backend.name} x{size}: python -m benchmarks.soak --steps {args.steps}",
    }
    if rank == 0:
        path = save_json(result, Path(args.out).name, Path(args.out).parent)
        log(
            rank,
            f"replicas bitwise identical: {identical}; rss growth after warm-up {result['rss_growth_mb_after_warmup']:+.1f} MB; "
            f"pending after step(): {result['max_pending_grad_handles']} gradient handles, "
            f"{result['max_pending_factor_allreduces']} factor all-reduces; wrote {path}",
        )
    if not identical:
        raise SystemExit("replicas differ")
    return result


if __name__ == "__main__":
    main()
