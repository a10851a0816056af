"""Table III / Figs. 2, 9, 13: iteration time and its breakdown for SGD, D-KFAC, MPD-KFAC, SPD-KFAC and the ablations.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.iteration_time --model resnet50
    ... --update-freq 10 100     # amortised setting: factors every 10, inverses every 100 iterations
    ... --update-fusions none forward backward   # each variant with the update in step(), the next forward, backward

All variants run in one launch on the same model, data and workers, in
interleaved rounds; warm-up iterations (profiling included) are excluded.
Breakdown per iteration, from the optimizer's timeline:

* FF&BP: forward + backward wall time minus the factor computation in hooks
* GradComm / FactorComm / InverseComm: time ``step()`` was blocked on that
  communication (non-overlapped part)
* FactorComp: factor computation in the hooks; InverseComp: the inversion
  stage minus its blocked broadcast time
* Other: the rest of ``step()`` (unpacking, running averages, preconditioning, SGD);
  interleaved, also the wait for the slowest rank at the end of an iteration
  (each variant's iteration starts with every rank, behind an untimed
  barrier, and lasts until the slowest rank is done)

and, within those, Hooks (the factor hooks' work beyond computing the
factors, inside FF&BP), Precondition and Update (inside Other).

When the measured window holds no inversion (``--update-freq F I`` with
``I`` larger than the window), one inversion stage is timed separately and
``1/I`` of it is added to every iteration (reported under InverseComp).
"""

from __future__ import annotations

import csv
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac import make_optimizer
from spdkfac.comm import DEVICE_CHOICES, worker_device
from spdkfac.models import get_model
from spdkfac.runtime.host_memory import release_freed_memory
from spdkfac.runtime.output_path import output_file
from spdkfac.step.kfac_step import StepHyper
from spdkfac.variants import variant_argv, variant_config

from .common import (
    RESULTS,
    bar_chart,
    log,
    machine,
    rank_batch,
    ratio_interval,
    save_json,
    split_by_factor_step,
    start,
    stats,
    workload_parser,
)

VARIANTS = ["sgd", "dkfac", "mpdkfac", "spdkfac", "-pipe-lbp", "+pipe-lbp", "-pipe+lbp", "+pipe+lbp", "spdkfac-dp"]
PARTS = ["FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other"]
#: Parts of the above recorded apart for the simulator's per-phase check: the hooks' own work (inside FF&BP),
#: the preconditioning and the base update (inside Other).
DETAIL = ["Hooks", "Precondition", "Update"]


def with_update_fusion(variant: str, fusion: str) -> str:
    """The variant spec with ``update_fusion`` set (unchanged for ``'none'``)."""
    if fusion == "none":
        return variant
    return f"{variant}{',' if ':' in variant else ':'}update_fusion={fusion}"


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        return float("nan")


def optimizer_kwargs(variant: str, args) -> dict[str, object]:
    """What this benchmark passes to make_optimizer beyond lr, momentum and backend (a variant spec may not set these)."""
    if not variant_config(variant).get("precondition", True):
        return {"timeline": True}  # SGD too, so its gradient wait is measured the same way
    return dict(
        perf_model=args.perf_model,
        factor_update_freq=args.update_freq[0],
        inv_update_freq=args.update_freq[1],
        kl_clip=None,
        profile_steps=3,
        timeline=True,
    )


class VariantRun:
    """One variant's model and optimizer, stepped one iteration at a time so that variants can be interleaved.

    Interleaving (``--interleave``) runs iteration ``i`` of every variant
    before iteration ``i + 1`` of any, so slow drifts of a shared machine fall
    on all variants alike instead of on whichever ran during them.
    """

    def __init__(self, variant: str, args, backend, device: torch.device) -> None:
        self.variant, self.args, self.backend = variant, args, backend
        torch.manual_seed(0)
        self.device = device
        self.model = get_model(args.model).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.kfac = variant_config(variant).get("precondition", True)
        lr = getattr(args, "lr", 0.1)
        self.opt = make_optimizer(variant, self.model, lr=lr, momentum=0.9, backend=backend, **optimizer_kwargs(variant, args))
        self.it = 0
        self.total: list[float] = []
        self.fwdbwd: list[float] = []

    def iteration(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training iteration; returns its seconds (kept when past the warm-up)."""
        t0 = time.perf_counter()
        self.opt.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        t1 = time.perf_counter()
        self.opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if self.it >= self.args.warmup:
            self.total.append(t2 - t0)
            self.fwdbwd.append(t1 - t0)
        self.it += 1
        return t2 - t0

    def finish(self, per_variant_memory: bool = True) -> dict[str, object]:
        """The breakdown of the measured iterations (plus the amortised inversion), then free the variant."""
        args, opt, backend = self.args, self.opt, self.backend
        total, kfac = self.total, self.kfac
        parts = dict.fromkeys(PARTS, 0.0)
        it_mean = stats(total)["mean"]
        inv_freq = args.update_freq[1]
        window = range(args.warmup, args.warmup + len(total))
        amortised_inverse = 0.0
        if kfac and not any(s % inv_freq == 0 for s in window):
            # No inversion inside the measured window: time one inversion stage on the current
            # factors and charge 1/inv_freq of it to every iteration.
            backend.barrier()
            t0 = time.perf_counter()
            opt.kfac_step.update_decompositions(StepHyper.from_group(opt.param_groups[0]), opt.steps)
            amortised_inverse = (time.perf_counter() - t0) / inv_freq
        recs = [r for r in (opt.timeline.iterations if opt.timeline else []) if r.step >= args.warmup]
        n = len(total)
        fc = sum(r.factor_compute for r in recs) / n
        parts["FF&BP"] = stats(self.fwdbwd)["mean"] - fc
        parts["FactorComp"] = fc
        parts["FactorComm"] = sum(r.factor_wait for r in recs) / n
        parts["InverseComm"] = sum(r.inverse_wait for r in recs) / n
        parts["InverseComp"] = sum(r.inverse_stage - r.inverse_wait for r in recs) / n + amortised_inverse
        parts["GradComm"] = sum(r.grad_wait for r in recs) / n if recs else 0.0
        it_mean += amortised_inverse
        total = [t + amortised_inverse for t in total]
        parts["Other"] = max(0.0, it_mean - sum(v for k, v in parts.items() if k != "Other"))
        parts["Hooks"] = sum(r.hooks for r in recs) / n
        parts["Precondition"] = sum(r.precondition for r in recs) / n
        parts["Update"] = sum(r.update for r in recs) / n
        # The process's resident memory is one variant's only when variants run one after another.
        mem = {
            "rss_mb": _rss_mb() if per_variant_memory else float("nan"),
            "kfac_state_mb": sum(opt.memory_usage().values()) / 2**20 if kfac else 0.0,
        }
        if self.device.type == "cuda" and per_variant_memory:
            mem["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
        del self.opt, self.model
        gc.collect()
        return {"iteration": total, "parts": parts, "memory": mem}


def slowest_rank(backend, seconds: list[float], name: str) -> list[float]:
    """Each iteration's seconds on its slowest rank (every rank passes its own, in the same order)."""
    return [max(column) for column in zip(*backend.gather_values(seconds, name))]


def run_round(variants: list[str], args, backend, x, y, interleave: bool, label: str) -> dict[str, dict[str, object]]:
    """Every variant's warm-up and measured iterations: one variant after another, or interleaved.

    Each variant's mean is logged (prefixed by ``label``) as soon as it is known: after the variant
    when they run one after another, so a long run shows its progress.
    """
    steps = args.warmup + args.iters

    def done(v: str, result: dict[str, object]) -> None:
        log(backend.rank, f"  {label} {v:<10} {stats(result['iteration'])['mean'] * 1e3:9.1f} ms/iter")

    out: dict[str, dict[str, object]] = {}
    if not interleave:
        for v in variants:
            # The previous variant's freed (retained) memory goes back, so this one's RSS is its own.
            release_freed_memory()
            run = VariantRun(v, args, backend, x.device)
            for _ in range(steps):
                run.iteration(x, y)
            out[v] = run.finish()
            done(v, out[v])
        return out
    runs = [VariantRun(v, args, backend, x.device) for v in variants]
    for it in range(steps):
        secs = []
        for run in runs:
            # Each variant's iteration starts with every rank (untimed): a rank's lead from the previous
            # variant's step would otherwise be waited for, and charged, in this one.
            backend.barrier()
            secs.append(run.iteration(x, y))
        log(
            backend.rank,
            f"    iteration {it + 1}/{steps}"
            + ("" if it >= args.warmup else " (warm-up)")
            + ": "
            + ", ".join(f"{v} {s:.2f}s" for v, s in zip(variants, secs)),
        )
    for v, run in zip(variants, runs):
        out[v] = run.finish(per_variant_memory=False)
        done(v, out[v])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__, iters=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--device",
        default="auto",
        choices=DEVICE_CHOICES,
        help="auto: the worker's own GPU (local rank) when CUDA is available, else the CPU",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="hold every variant at once and alternate their iterations (robust to a drifting machine; "
        "needs the memory of all variants together, and reports no per-variant RSS)",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        action="extend",
        default=None,
        help="variant names (default: all), or name:key=value,... for a variant with a switch changed "
        "(e.g. spdkfac:overlap_preconditioning=false)",
    )
    ap.add_argument("--update-freq", type=int, nargs=2, default=[1, 1], metavar=("FACTOR", "INVERSE"))
    ap.add_argument(
        "--lr",
        type=float,
        default=0.1,
        help="SGD's rate for ResNet-50; the warm eigenbasis refresh's work depends on how far the weights move "
        "(runs before this option: 1e-4)",
    )
    ap.add_argument(
        "--update-fusions",
        nargs="+",
        default=None,
        choices=("none", "forward", "backward"),
        help="run every variant with each of these update fusions, side by side (none: the variant as given)",
    )
    ap.add_argument(
        "--out",
        default=None,
        type=output_file(make_parents=True),
        help="JSON path (default benchmarks/results/iteration_time[_amortised].json)",
    )
    args = ap.parse_args(variant_argv(sys.argv[1:] if argv is None else argv))
    args.variants = args.variants or list(VARIANTS)
    variants = [with_update_fusion(v, f) for v in args.variants for f in args.update_fusions or ["none"]]
    for v in variants:
        try:
            fixed = sorted(set(variant_config(v)) & {"lr", "momentum", "backend", *optimizer_kwargs(v, args)})
        except ValueError as exc:
            ap.error(str(exc))
        if fixed:
            ap.error(f"variant {v!r} sets {fixed}, which this benchmark sets itself (--update-freq, --perf-model, ...)")
    backend = start(args)
    rank = backend.rank
    suffix = "" if args.update_freq == [1, 1] else "_amortised"
    out = Path(args.out or RESULTS / f"iteration_time{suffix}.json")
    log(
        rank,
        f"iteration time: {args.model} @ {args.resolution}px, batch {args.batch_size}/worker, {backend.size} workers ({backend.name}), "
        f"factors every {args.update_freq[0]}, inverses every {args.update_freq[1]} iterations",
    )
    x, y = rank_batch(rank, args.batch_size, args.resolution)
    device = worker_device(args.device)
    x, y = x.to(device), y.to(device)
    results: dict[str, dict[str, object]] = {}
    for rnd in range(args.rounds):
        for v, r in run_round(variants, args, backend, x, y, args.interleave, f"round {rnd + 1}/{args.rounds}").items():
            if v in results:
                results[v]["iteration"] += r["iteration"]
                for k in PARTS + DETAIL:
                    results[v]["parts"][k] = (results[v]["parts"][k] * rnd + r["parts"][k]) / (rnd + 1)
                results[v]["memory"] = r["memory"]
            else:
                results[v] = r

    if args.interleave and backend.size > 1:
        # Interleaved iterations start together: each one lasts until its slowest rank is done. What that adds
        # to this rank's own mean is the end-of-step wait for the slowest rank, counted under Other.
        for v, r in results.items():
            own = stats(r["iteration"])["mean"]
            r["iteration"] = slowest_rank(backend, r["iteration"], f"bench.slowest.{v}")
            r["parts"]["Other"] += stats(r["iteration"])["mean"] - own
    # The slowest rank sets the pace: average the per-rank means (ranks are symmetric here).
    table: list[dict[str, object]] = []
    for v, r in results.items():
        vec = torch.tensor(
            [stats(r["iteration"])["mean"], stats(r["iteration"])["stdev"]] + [r["parts"][k] for k in PARTS + DETAIL],
            dtype=torch.float64,
        )
        backend.allreduce_async(vec, f"bench.iter.{v}").wait()
        mem = torch.tensor([r["memory"]["rss_mb"]], dtype=torch.float64)
        backend.allreduce_async(mem, f"bench.mem.{v}").wait()
        vals = vec.tolist()
        table.append(
            {
                "variant": v,
                "mean_s": vals[0],
                "stdev_s": vals[1],
                **{k: vals[2 + i] for i, k in enumerate(PARTS + DETAIL)},
                "rss_mb": mem.item(),
                "kfac_state_mb": r["memory"]["kfac_state_mb"],
            }
        )
    by = {row["variant"]: row for row in table}
    ref = by.get("spdkfac") or by.get("+pipe+lbp")
    samples = {v: r["iteration"] for v, r in results.items()}
    paired = args.interleave and len({len(s) for s in samples.values()}) == 1
    for row in table:
        row["SP1"] = by["dkfac"]["mean_s"] / row["mean_s"] if "dkfac" in by else None
        row["SP2"] = by["mpdkfac"]["mean_s"] / row["mean_s"] if "mpdkfac" in by else None
        # 95% intervals (_lo, _hi) from rank 0's iterations (interleaved: each iteration's slowest rank's)
        for key, base, over in (("SP1", "dkfac", True), ("SP2", "mpdkfac", True), ("vs_sgd", "sgd", False)):
            if base in samples and row["variant"] != base:
                num, den = (samples[base], samples[row["variant"]]) if over else (samples[row["variant"]], samples[base])
                row[f"{key}_lo"], row[f"{key}_hi"] = ratio_interval(num, den, paired)
        if "sgd" in by:
            row["vs_sgd"] = row["mean_s"] / by["sgd"]["mean_s"]
        if args.update_freq[0] > 1:  # amortised: iterations with and without a factor update, apart (rank 0's)
            for kind, part in split_by_factor_step(samples[row["variant"]], args.warmup, args.iters, args.update_freq[0]).items():
                row[f"{kind}_s"], row[f"{kind}_n"] = part["mean"], part["n"]
    if rank == 0:
        head = f"{'variant':<10} {'iter (ms)':>15} " + " ".join(f"{p:>11}" for p in PARTS) + f" {'SP1':>6} {'SP2':>6} {'RSS MB':>7}"
        print("\n" + head)
        for row in table:
            print(
                f"{row['variant']:<10} {row['mean_s'] * 1e3:8.1f} ±{row['stdev_s'] * 1e3:5.1f} "
                + " ".join(f"{row[p] * 1e3:11.1f}" for p in PARTS)
                + f" {row['SP1'] or 0:6.2f} {row['SP2'] or 0:6.2f} {row['rss_mb']:7.0f}"
            )
        for row in table:
            for key, what in (("SP1", "faster than D-KFAC"), ("SP2", "faster than MPD-KFAC"), ("vs_sgd", "SGD's time")):
                if f"{key}_lo" in row:
                    lo, hi = row[f"{key}_lo"], row[f"{key}_hi"]
                    print(f"  {row['variant']:<10} {key:<6} {row[key]:.2f}x {what} (95% interval {lo:.2f}-{hi:.2f})")
        for row in table:
            if "factor_steps_s" in row and "other_steps_s" in row:
                sgd = by.get("sgd", {})
                vs = {k: f" ({row[k] / sgd[k]:.2f}x SGD's)" if k in sgd else "" for k in ("factor_steps_s", "other_steps_s")}
                print(
                    f"  {row['variant']:<10} factor-update iterations {row['factor_steps_s']:.2f} s"
                    f"{vs['factor_steps_s']} (n={row['factor_steps_n']}), the others "
                    f"{row['other_steps_s']:.2f} s{vs['other_steps_s']} (n={row['other_steps_n']})"
                )
        if ref and "sgd" in by:
            print(f"SPD-KFAC / SGD iteration time: {ref['mean_s'] / by['sgd']['mean_s']:.2f}x")
        path = save_json(
            {
                "args": vars(args),
                "machine": machine(),
                "world_size": backend.size,
                "engine": backend.name,
                "table": table,
                "samples": samples,
            },
            out.name,
            out.parent,
        )
        with open(out.with_suffix(".csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for row in table for k in row)), restval="")
            w.writeheader()
            w.writerows(table)
        png = bar_chart(
            out.with_suffix(".png"),
            [r["variant"] for r in table],
            {p: [r[p] * 1e3 for r in table] for p in PARTS},
            f"iteration breakdown ({args.model}, {backend.size} workers, updates every {args.update_freq})",
            "ms per iteration",
        )
        print(f"wrote {path}, {out.with_suffix('.csv')} and {png}")


if __name__ == "__main__":
    main()
