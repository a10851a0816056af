"""Fig. 12: time until every worker holds every inverse, per placement (Non-Dist, Seq-Dist, LBP).

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.inverse_placement --model resnet50

Uses the model's real factor dimensions (ResNet-50: 54 A + 54 G, largest 4608)
with synthetic SPD matrices and runs the optimizer's own inversion stage
(:func:`spdkfac.step.decomposition_stage.compute_inverses`) for each placement, interleaved
over rounds. It also reports the lower bound
``max(largest single inversion, total inversion time / P)`` from measured
single inversions, and how well the fitted models predict the measured
inversion and broadcast times.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from spdkfac.comm import CommBackend
from spdkfac.kfac.layers import factor_list, kfac_layers
from spdkfac.kfac.linalg import invert_spd, triangle_size
from spdkfac.models import get_model
from spdkfac.perfmodels import PerfModel
from spdkfac.plan.placement import Placement, place
from spdkfac.step.decomposition_stage import compute_inverses

from .common import bar_chart, log, machine, ratio_interval, save_json, start, stats, workload_parser

LABELS = {"local": "Non-Dist (D-KFAC)", "seq": "Seq-Dist (MPD-KFAC)", "lbp": "LBP (SPD-KFAC)"}


def spd(dim: int, seed: int) -> torch.Tensor:
    """A cheap, well-conditioned SPD matrix (low-rank plus diagonal), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(dim, 32, generator=g) / 32**0.5
    return r @ r.T + 0.1 * torch.eye(dim)


def gather(backend: CommBackend, value: float) -> list[float]:
    """Every rank's value, on every rank (all-reduce of one-hot slots)."""
    t = torch.zeros(backend.size, dtype=torch.float64)
    t[backend.rank] = value
    backend.allreduce_async(t, "bench.gather").wait()
    return (t * backend.size).tolist()  # the engine averages


def main() -> None:
    ap = workload_parser(__doc__, iters=1, out_name="inverse_placement.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--damping", type=float, default=0.003)
    args = ap.parse_args()
    backend = start(args)
    rank, size = backend.rank, backend.size
    model = PerfModel.load(args.perf_model)
    dims = factor_list(kfac_layers(get_model(args.model)))
    factors = {key: spd(d, i) for i, (key, d) in enumerate(dims)}
    log(rank, f"inversion stage of {args.model}: {len(dims)} factors (largest {max(d for _, d in dims)}), {size} workers ({backend.name})")

    # Single inversions, measured on every rank (for the lower bound and the model check).
    single: dict[int, float] = {}
    for key, d in sorted(dims, key=lambda kd: -kd[1]):
        if d in single:
            continue
        t0 = time.perf_counter()
        invert_spd(factors[key], args.damping)
        single[d] = max(gather(backend, time.perf_counter() - t0))
    t_inv = [single[d] for _, d in dims]
    lower = max(*t_inv, sum(t_inv) / size)

    # Broadcast times for a few dimensions (model check).
    bcast: dict[int, float] = {}
    if size > 1:
        for d in sorted({d for _, d in dims})[:: max(1, len({d for _, d in dims}) // 8)]:
            buf = torch.zeros(triangle_size(d))
            reps = []
            for r in range(21):
                backend.barrier()
                t0 = time.perf_counter()
                backend.broadcast_async(buf, 0, f"bench.bc.{d}.{r}").wait()
                reps.append(time.perf_counter() - t0)
            bcast[d] = max(gather(backend, float(np.median(reps[1:]))))

    plans = {s: place(s, dims, size, model.inverse, model.broadcast) for s in Placement.choices()}
    stage: dict[str, list[float]] = {s: [] for s in Placement.choices()}
    for rnd in range(args.rounds):
        for s in Placement.choices():
            backend.barrier()
            t0 = time.perf_counter()
            compute_inverses(plans[s], factors, args.damping, backend)
            stage[s].append(max(gather(backend, time.perf_counter() - t0)))
            log(rank, f"  round {rnd + 1}/{args.rounds} {LABELS[s]:<22} {stage[s][-1]:.3f} s (predicted {plans[s].makespan:.3f} s)")

    res = {
        s: {
            "median_s": stats(stage[s])["median"],
            "samples": stage[s],
            "predicted_s": plans[s].makespan,
            "local_factors": sum(a.is_local for a in plans[s].assignments),
        }
        for s in Placement.choices()
    }
    inv_err = [abs(model.inverse(d) - t) / t for d, t in single.items()]
    bc_err = [abs(model.broadcast(d) - t) / t for d, t in bcast.items()]
    summary = {
        "lower_bound_s": lower,
        "lbp_over_lower_bound": res["lbp"]["median_s"] / lower,
        "lbp_speedup_vs_seq": res["seq"]["median_s"] / res["lbp"]["median_s"],
        "lbp_speedup_vs_local": res["local"]["median_s"] / res["lbp"]["median_s"],
        # 95% intervals of the median ratios over the interleaved rounds (None with a single round)
        **{
            f"lbp_speedup_vs_{s}_interval": list(ratio_interval(stage[s], stage["lbp"], paired=True, statistic="median"))
            if args.rounds > 1
            else None
            for s in ("seq", "local")
        },
        "inverse_model_mean_rel_error": float(np.mean(inv_err)),
        "inverse_model_max_rel_error_d>=512": float(max([e for (d, e) in zip(single, inv_err) if d >= 512], default=0.0)),
        "broadcast_model_mean_rel_error": float(np.mean(bc_err)) if bc_err else None,
        "broadcast_errors": {d: abs(model.broadcast(d) - t) / t for d, t in bcast.items()},
        "inverse_errors": {d: abs(model.inverse(d) - t) / t for d, t in single.items()},
    }
    if rank == 0:
        print(f"\n{'placement':<22} {'measured':>9} {'predicted':>10} {'local':>6}")
        for s in Placement.choices():
            print(f"{LABELS[s]:<22} {res[s]['median_s']:8.3f}s {res[s]['predicted_s']:9.3f}s {res[s]['local_factors']:>6}")
        print(f"lower bound max(largest, total/P) = {lower:.3f} s; LBP is {summary['lbp_over_lower_bound']:.2f}x of it")
        print(f"LBP speed-up: {summary['lbp_speedup_vs_seq']:.2f}x vs Seq-Dist, {summary['lbp_speedup_vs_local']:.2f}x vs Non-Dist")
        if args.rounds > 1:
            (a, b), (c, d) = summary["lbp_speedup_vs_seq_interval"], summary["lbp_speedup_vs_local_interval"]
            print(f"  95% intervals over the {args.rounds} rounds: {a:.2f}-{b:.2f}x vs Seq-Dist, {c:.2f}-{d:.2f}x vs Non-Dist")
        print(
            f"model error: inversion mean {summary['inverse_model_mean_rel_error']:.0%} (max {summary['inverse_model_max_rel_error_d>=512']:.0%} for d>=512), "
            f"broadcast mean {summary['broadcast_model_mean_rel_error'] or 0:.0%}"
        )
        print(plans["lbp"].table(lambda k: f"{k[0]}:{k[1]}"))
        out = {
            "args": vars(args),
            "machine": machine(),
            "world_size": size,
            "engine": backend.name,
            "results": res,
            "summary": summary,
            "single_inversions": single,
            "broadcasts": bcast,
        }
        path = save_json(out, Path(args.out).name, Path(args.out).parent)
        png = bar_chart(
            Path(args.out).with_suffix(".png"),
            [LABELS[s] for s in Placement.choices()],
            {"measured": [res[s]["median_s"] for s in Placement.choices()]},
            f"Fig. 12: time to hold every inverse ({args.model}, {size} workers)",
            "seconds",
        )
        print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
