"""The optimizer swapped into a user's DDP script: iteration time per step kind, amortised and every step, K-FAC memory.

    torchrun --nproc_per_node 2 -m benchmarks.drop_in --model resnet50 --resolution 32 --batch-size 32 \\
        --systems sgd-ddp spdkfac-ddp spdkfac-bare spdkfac-pre-ddp kaisa-ddp

Systems, all on the same model (same initialisation), data, learning rate
(0.1, momentum 0.9), damping, factor decay, KL-clip and compute method:

* ``sgd-ddp``: ``torch.optim.SGD`` on ``DistributedDataParallel(model)``, the
  script the user starts from, and every ratio's denominator;
* ``spdkfac-ddp``: ``SPDKFACOptimizer(DistributedDataParallel(model))``, the
  one-line swap (DDP averages the gradients, docs/ddp.md);
* ``spdkfac-bare``: ``SPDKFACOptimizer(model)``, the optimizer averaging the
  gradients itself from its hooks;
* ``spdkfac-pre-ddp``: this project's ``KFACPreconditioner`` on the DDP model,
  then ``torch.optim.SGD`` (KAISA's usage);
* ``kaisa-ddp``: KAISA's ``kfac.preconditioner.KFACPreconditioner`` on the DDP
  model, then ``torch.optim.SGD``, its other options at their defaults;
* ``sgd-fsdp``: ``torch.optim.SGD`` on the model sharded by FSDP2
  (``fully_shard`` on each block of the model's sequential stages, then on
  the model), the FSDP script;
* ``spdkfac-fsdp``: ``SPDKFACOptimizer`` on that sharded model, the one-line
  swap there (docs/fsdp.md); its ratios are to ``sgd-fsdp``.

Step kinds. A K-FAC step is one of three kinds: a *decomposition* step
(factors and decompositions updated: every step of the every-step setting),
a *factor* step (factors only) and a *plain* step (neither). The run uses a
compressed schedule (``--schedule F I``: factors every F, decompositions
every I steps, default 2 and 4), so each cycle of I steps holds all three
kinds, and computes from the per-kind means the two settings users run:
*every step* = the decomposition step's mean, and *amortised* (``--target
F I``, default factors every 10, decompositions every 100) =
``D/I + Fo·(1/F − 1/I) + P·(1 − 1/F)``. The work of a step depends on its
kind, not on the schedule, so this is what a 100-step window would average,
at a tenth of the cost.

Interleaving: every system is built at once; step ``s`` of every system runs
before step ``s + 1`` of any, the order rotating every step, each step
behind an untimed barrier and lasting until its slowest rank is done. The
first ``--warmup`` cycles are left out (profiling, the first decompositions).
Each measured cycle gives one amortised and one every-step ratio to
``sgd-ddp``'s mean in the same cycle: the JSON records their median, min and
max (the spread over repeats on a shared machine).

Memory: the parameters each worker holds (its rows of them under FSDP), and
K-FAC's factors and decompositions per worker (``memory_usage()`` of either
library), the fullest and emptiest worker.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.models import get_model

from .common import log, machine, rank_batch, save_json, start, stats, workload_parser
from .vs_kaisa import kaisa_source, require_kaisa

#: system name -> what it runs (the JSON's ``specs``)
SYSTEMS: dict[str, str] = {
    "sgd-ddp": "torch.optim.SGD on DistributedDataParallel(model)",
    "spdkfac-ddp": "SPDKFACOptimizer(DistributedDataParallel(model))",
    "spdkfac-bare": "SPDKFACOptimizer(model) (its own gradient all-reduce)",
    "spdkfac-pre-ddp": "spdkfac.KFACPreconditioner(DistributedDataParallel(model)) + torch.optim.SGD",
    "kaisa-ddp": "kfac.preconditioner.KFACPreconditioner(DistributedDataParallel(model)) + torch.optim.SGD",
    "sgd-fsdp": "torch.optim.SGD on the model sharded by FSDP2 (fully_shard on each block, then the model)",
    "spdkfac-fsdp": "SPDKFACOptimizer(model sharded by FSDP2) (FSDP averages; each K-FAC layer's gradient all-gathered)",
}
BASELINE = "sgd-ddp"
#: The SGD script a system is the one-line swap of: its ratios' denominator (the DDP script's where absent).
SCRIPT_BASELINE = {"spdkfac-fsdp": "sgd-fsdp"}
KINDS = ("decomposition", "factor", "plain")


def step_kind(step: int, factor_every: int, decomposition_every: int) -> str:
    """Which K-FAC work step ``step`` does under a schedule (both libraries: ``step % N == 0``)."""
    if step % decomposition_every == 0:
        return "decomposition"
    return "factor" if step % factor_every == 0 else "plain"


def amortised(means: dict[str, float], factor_every: int, decomposition_every: int) -> float:
    """The mean step of a schedule (factors every F, decompositions every I, I a multiple of F) from per-kind means."""
    d = 1.0 / decomposition_every
    f = 1.0 / factor_every - d
    return d * means["decomposition"] + f * means["factor"] + (1.0 - d - f) * means["plain"]


def memory_split(usage: dict[str, int]) -> tuple[int, int]:
    """``(factor bytes, decomposition bytes)`` of a ``memory_usage()`` dict of either library.

    This project names the running factors by their kind (``A``, ``G``) and the rest after the method
    (``A_inv``, ``G_eig``, ...); KAISA names them ``a_factors``, ``g_factors`` and the decompositions otherwise.
    """
    factors = sum(v for k, v in usage.items() if k in ("A", "G") or k.endswith("factors"))
    decompositions = sum(v for k, v in usage.items() if k != "total") - factors
    return factors, decompositions


class System:
    """One system's model, optimizer and step function (see the module docstring)."""

    def __init__(self, name: str, args: Any) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model: nn.Module = get_model(args.model)
        if name.endswith("-fsdp"):
            shard_blocks(self.model)
        plain = name == "spdkfac-bare" or name.endswith("-fsdp")
        self.forward: nn.Module = self.model if plain else nn.parallel.DistributedDataParallel(self.model)
        self.usage: Callable[[], dict[str, int]] | None = None
        #: The bytes of the parameters this worker holds (its rows of each under FSDP).
        self.parameter_bytes = sum(local_numel(p) * p.element_size() for p in self.model.parameters())
        self.cleanup: Callable[[], None] = lambda: None
        kfac_options = dict(damping=args.damping, factor_decay=args.factor_decay, kl_clip=args.kl_clip)
        every = {"factor_update_freq": args.schedule[0], "inv_update_freq": args.schedule[1]}
        kaisa_every = {"factor_update_steps": args.schedule[0], "inv_update_steps": args.schedule[1]}
        own = dict(perf_model=args.perf_model, profile_steps=1, compute_method=args.compute_method)
        if name.startswith("spdkfac-") and not name.startswith("spdkfac-pre"):
            opt = SPDKFACOptimizer(self.forward, lr=args.lr, momentum=0.9, **own, **every, **kfac_options)
            self.zero_grad, self.step, self.usage, self.cleanup = opt.zero_grad, opt.step, opt.memory_usage, opt.remove_hooks
            return
        sgd = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        pre: Any = None
        if name == "spdkfac-pre-ddp":
            pre = KFACPreconditioner(self.forward, lr=args.lr, **own, **kaisa_every, **kfac_options)
            self.cleanup = pre.remove_hooks
        elif name == "kaisa-ddp":
            kfac = require_kaisa()
            pre = kfac.preconditioner.KFACPreconditioner(
                self.forward, lr=args.lr, compute_method=args.compute_method, **kaisa_every, **kfac_options
            )
        elif not name.startswith("sgd-"):
            raise ValueError(f"unknown system {name!r}; choose from {list(SYSTEMS)}")
        if pre is not None:
            self.usage = pre.memory_usage

        def step() -> None:
            if pre is not None:
                pre.step()
            sgd.step()

        self.zero_grad, self.step = sgd.zero_grad, step

    def iteration(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training iteration (behind an untimed barrier); its seconds."""
        dist.barrier()
        t0 = time.perf_counter()
        self.zero_grad()
        nn.functional.cross_entropy(self.forward(x), y).backward()
        self.step()
        return time.perf_counter() - t0


def shard_blocks(model: nn.Module) -> None:
    """FSDP2 as its examples apply it: ``fully_shard`` on each block (each module with parameters in the model's
    ``Sequential``/``ModuleList`` stages, and each other child with parameters), then on the model."""
    from torch.distributed.fsdp import fully_shard  # (torch 2.6+; the FSDP systems only)

    for child in model.children():
        blocks = list(child.children()) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        for block in blocks:
            if any(True for _ in block.parameters()):
                fully_shard(block)
    fully_shard(model)


def local_numel(param: torch.Tensor) -> int:
    """The elements of ``param`` this worker holds (a sharded ``DTensor``'s local rows)."""
    to_local = getattr(param, "to_local", None)
    return int(to_local().numel()) if callable(to_local) else param.numel()


def slowest(seconds: list[float]) -> list[float]:
    """Each step's seconds on its slowest rank (every rank passes its own, in the same order)."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_extremes(value: float) -> tuple[float, float]:
    """``(max, min)`` of ``value`` over the ranks."""
    hi = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return hi[0].item(), -hi[1].item()


def summarise(samples: dict[str, list[float]], kinds: list[str], cycle: int, args: Any) -> list[dict[str, Any]]:
    """Per system: per-kind means, every-step and amortised seconds, and their ratios to SGD's (pooled, and per cycle)."""
    f_t, i_t = args.target
    rows = []
    for name, xs in samples.items():
        base = samples.get(SCRIPT_BASELINE.get(name, BASELINE))
        row: dict[str, Any] = {"system": name, **stats(xs)}
        if name.startswith("sgd-") and name != BASELINE and BASELINE in samples:
            row["vs_sgd_ddp"] = statistics.fmean(xs) / statistics.fmean(samples[BASELINE])
        if not name.startswith("sgd-"):
            by_kind = {k: [x for x, kk in zip(xs, kinds) if kk == k] for k in KINDS}
            row["kinds"] = {k: stats(v) for k, v in by_kind.items() if v}
            if len(row["kinds"]) == len(KINDS):
                means = {k: row["kinds"][k]["mean"] for k in KINDS}
                row["every_step_s"], row["amortised_s"] = means["decomposition"], amortised(means, f_t, i_t)
        if base is not None and "amortised_s" in row:
            sgd = statistics.fmean(base)
            row["vs_sgd_every_step"], row["vs_sgd_amortised"] = row["every_step_s"] / sgd, row["amortised_s"] / sgd
            per_cycle: dict[str, list[float]] = {"every_step": [], "amortised": []}
            for c in range(0, len(xs), cycle):
                sgd_c = statistics.fmean(base[c : c + cycle])
                means_c = {k: statistics.fmean([x for x, kk in zip(xs[c : c + cycle], kinds[c : c + cycle]) if kk == k]) for k in KINDS}
                per_cycle["every_step"].append(means_c["decomposition"] / sgd_c)
                per_cycle["amortised"].append(amortised(means_c, f_t, i_t) / sgd_c)
            for key, rs in per_cycle.items():
                row[f"vs_sgd_{key}_cycles"] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "n": len(rs)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__, iters=3, out_name="drop_in.json", model="resnet50")  # --iters: measured cycles
    ap.set_defaults(batch_size=32)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--warmup", type=int, default=1, help="cycles left out before the measured ones")
    ap.add_argument(
        "--schedule", type=int, nargs=2, default=[2, 4], metavar=("F", "I"), help="factors every F, decompositions every I steps"
    )
    ap.add_argument("--target", type=int, nargs=2, default=[10, 100], metavar=("F", "I"), help="the amortised setting reported")
    ap.add_argument("--compute-method", default="inverse", choices=("inverse", "eigen"))
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--factor-decay", type=float, default=0.95)
    ap.add_argument("--kl-clip", type=float, default=0.001)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    f_s, i_s = args.schedule
    if f_s < 2 or i_s % f_s or i_s < 2 * f_s:
        ap.error("--schedule F I needs F >= 2 and I a multiple of F, at least 2F (every kind of step in each cycle)")
    if args.target[0] < 1 or args.target[1] % args.target[0]:
        ap.error("--target F I needs F >= 1 and I a multiple of F")
    if args.iters < 1 or args.warmup < 1:
        ap.error("--iters and --warmup must be >= 1")
    if BASELINE not in args.systems:
        ap.error(f"--systems must include {BASELINE} (the ratios' denominator)")
    if "kaisa-ddp" in args.systems:
        require_kaisa()
    backend = start(args)
    if backend.name != "torch":
        raise SystemExit("error: run under torchrun (DistributedDataParallel needs torch.distributed)")
    rank = backend.rank
    log(
        rank,
        f"drop-in: {args.model} @ {args.resolution}px, batch {args.batch_size}/worker, {backend.size} workers, "
        f"{args.compute_method} method, factors every {f_s} and decompositions every {i_s} steps; "
        f"{args.warmup} warm-up + {args.iters} measured cycles, systems interleaved step by step",
    )
    x, y = rank_batch(rank, args.batch_size, args.resolution)
    systems = [System(name, args) for name in args.systems]
    own: dict[str, list[float]] = {s.name: [] for s in systems}
    kinds: list[str] = []
    for s in range((args.warmup + args.iters) * i_s):
        k = s % len(systems)
        secs = {system.name: system.iteration(x, y) for system in systems[k:] + systems[:k]}
        warm = s < args.warmup * i_s
        if not warm:
            kinds.append(step_kind(s, f_s, i_s))
            for name, t in secs.items():
                own[name].append(t)
        log(
            rank,
            f"  step {s} ({step_kind(s, f_s, i_s)}{', warm-up' if warm else ''}): " + ", ".join(f"{n} {t:.2f}s" for n, t in secs.items()),
        )
    memory = {}
    for system in systems:
        memory[system.name] = {"parameters_mb": rank_extremes(system.parameter_bytes / 2**20)}
        if system.usage is not None:
            factors, decompositions = memory_split(dict(system.usage()))
            memory[system.name] |= {
                "factors_mb": rank_extremes(factors / 2**20),
                "decompositions_mb": rank_extremes(decompositions / 2**20),
            }
        system.cleanup()
    del systems
    gc.collect()
    samples = {name: slowest(xs) for name, xs in own.items()}
    table = summarise(samples, kinds, i_s, args)
    for row in table:
        if row["system"] in memory:
            row["memory"] = {k: {"max": v[0], "min": v[1]} for k, v in memory[row["system"]].items()}
    if rank == 0:
        save_json(
            {
                "args": vars(args),
                "machine": machine(),
                "world_size": backend.size,
                "engine": backend.name,
                "kaisa": kaisa_source() if "kaisa-ddp" in args.systems else None,
                "specs": {name: SYSTEMS[name] for name in args.systems},
                "kinds": kinds,
                "table": table,
                "samples": samples,
            },
            Path(args.out).name,
            Path(args.out).parent,
        )
        print(f"\n{'system':<16} {'decomp (s)':>10} {'factor (s)':>10} {'plain (s)':>9} {'every/SGD':>10} {'amortised/SGD':>14}")
        for row in table:
            kd = row.get("kinds", {})
            cells = [f"{kd[k]['mean']:.2f}" if k in kd else "-" for k in KINDS]
            print(
                f"{row['system']:<16} {cells[0]:>10} {cells[1]:>10} {cells[2]:>9} "
                f"{row.get('vs_sgd_every_step', float('nan')):9.2f}x {row.get('vs_sgd_amortised', float('nan')):13.2f}x"
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
