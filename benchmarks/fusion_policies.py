"""Fig. 10: factor computation + non-overlapped factor communication per fusion policy.

Run under the launcher (2 workers here)::

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.fusion_policies --model resnet50

For each policy (``optimal``, ``threshold``, ``layerwise``, ``naive``) it trains
the same model on the same synthetic data with factors updated every
iteration and the timeline on; policies run in interleaved rounds so that
machine drift hits all of them alike. Per policy it reports, per iteration:

* ``factor_compute``: time spent computing A and G in the hooks;
* ``blocked``: time ``step()`` blocked on communication (gradients + factors);
* ``factor_comm_nonoverlap``: ``blocked`` minus what plain SGD blocks on its
  gradients in the same run (factor and gradient all-reduces share one engine
  queue, so unhidden factor time can surface while waiting for gradients);
* ``factor_comm_total``: the same fused all-reduces timed alone, back to back;
* ``hidden``: ``1 - nonoverlap / total``, the fraction of factor communication
  hidden behind computation;
* ``factor_stage`` = compute + non-overlapped communication (Fig. 10's bar).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.linalg import triangle_size
from spdkfac.models import get_model
from spdkfac.plan.factor_fusion import FusionPolicy

from .common import bar_chart, log, machine, rank_batch, save_json, start, stats, workload_parser


def _comm_alone(opt: SPDKFACOptimizer, repeats: int) -> float:
    """Seconds to all-reduce this optimizer's fused factor groups back to back, nothing else running."""
    plan = opt.fusion_plan()
    groups: list[int] = []
    for kind in ("A", "G"):
        kind_groups = plan[kind] or [[(kind, layer.name)] for layer in opt.layers]  # None: layer-wise
        for g in kind_groups:
            groups.append(sum(triangle_size({la.name: la for la in opt.layers}[name].dim(k)) for k, name in g))
    buffers = [torch.zeros(n) for n in groups]
    backend = opt.backend
    times = []
    for r in range(repeats + 1):
        backend.barrier()
        t0 = time.perf_counter()
        handles = [backend.allreduce_async(b, f"bench.alone.{i}.{r}") for i, b in enumerate(buffers)]
        for h in handles:
            h.wait()
        if r:
            times.append(time.perf_counter() - t0)
    return stats(times)["median"]


def main() -> None:
    ap = workload_parser(__doc__, iters=6, out_name="fusion_policies.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", nargs="*", default=list(FusionPolicy.choices()))
    args = ap.parse_args()
    backend = start(args)
    rank = backend.rank
    log(
        rank,
        f"fusion policies on {args.model} @ {args.resolution}px, batch {args.batch_size}/worker, {backend.size} workers ({backend.name})",
    )

    x, y = rank_batch(rank, args.batch_size, args.resolution, classes=1000)
    warm = 5  # 1 warm-up + 3 profiled factor steps + 1 on the new plan
    samples: dict[str, dict[str, list[float]]] = {p: {"compute": [], "wait": [], "iter": [], "alone": []} for p in ["sgd", *args.policies]}
    plans: dict[str, dict[str, int]] = {}
    for rnd in range(args.rounds):
        for policy in ["sgd", *args.policies]:
            torch.manual_seed(0)
            model = get_model(args.model)
            opt = SPDKFACOptimizer(
                model,
                lr=1e-4,
                backend=backend,
                fusion=policy if policy != "sgd" else "optimal",
                placement="local",
                perf_model=args.perf_model,
                inv_update_freq=10**6,
                kl_clip=None,
                timeline=True,
                profile_steps=3,
                precondition=policy != "sgd",
            )
            for it in range(warm + args.iters):
                t0 = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if it >= warm:
                    samples[policy]["iter"].append(time.perf_counter() - t0)
            for rec in opt.timeline.iterations[warm:]:
                samples[policy]["compute"].append(rec.factor_compute)
                samples[policy]["wait"].append(rec.factor_wait + rec.grad_wait)
            samples[policy]["alone"].append(_comm_alone(opt, repeats=2) if policy != "sgd" else 0.0)
            plan = opt.fusion_plan()
            plans[policy] = {k: (len(v) if v is not None else len(opt.layers)) for k, v in plan.items()}
            log(
                rank,
                f"  round {rnd + 1}/{args.rounds} {policy:<10} groups A/G {plans[policy]['A']}/{plans[policy]['G']}  "
                f"compute {stats(samples[policy]['compute'])['median'] * 1e3:7.1f} ms  "
                f"blocked {stats(samples[policy]['wait'])['median'] * 1e3:7.1f} ms  "
                f"comm alone {samples[policy]['alone'][-1] * 1e3:7.1f} ms",
            )
            opt.remove_hooks()
            del opt, model
            gc.collect()

    # Every rank measured; report the slowest rank's medians (the iteration waits for it).
    summary = {}
    baseline = None
    for policy in ["sgd", *args.policies]:
        s = samples[policy]
        vals = torch.tensor([stats(s[k])["median"] for k in ("compute", "wait", "alone", "iter")], dtype=torch.float64)
        gathered = vals.clone()
        backend.allreduce_async(gathered, f"bench.fusion.{policy}").wait()  # mean over ranks
        compute, wait, alone, it = gathered.tolist()
        if policy == "sgd":
            baseline = {"blocked": wait, "iteration": it}
            continue
        summary[policy] = {
            "factor_compute": compute,
            "blocked": wait,
            "factor_comm_nonoverlap": max(0.0, wait - baseline["blocked"]),
            "factor_comm_total": alone,
            "hidden": max(0.0, 1 - max(0.0, wait - baseline["blocked"]) / alone) if alone > 0 else None,
            "factor_stage": compute + max(0.0, wait - baseline["blocked"]),
            "iteration": it,
            "groups": plans[policy],
        }
    if rank == 0:
        print(f"\nplain SGD: blocked on gradients {baseline['blocked'] * 1e3:.1f} ms, iteration {baseline['iteration'] * 1e3:.1f} ms")
        print(
            f"{'policy':<10} {'groups A/G':>10} {'compute':>9} {'unhidden':>9} {'comm alone':>11} {'hidden':>7} {'stage':>9} {'vs naive':>9} {'iteration':>10}"
        )
        base = summary.get("naive", {}).get("factor_stage")
        for p, r in summary.items():
            speed = f"{base / r['factor_stage']:.2f}x" if base else "-"
            print(
                f"{p:<10} {r['groups']['A']:>4}/{r['groups']['G']:<5} {r['factor_compute'] * 1e3:8.1f}m {r['factor_comm_nonoverlap'] * 1e3:8.1f}m "
                f"{r['factor_comm_total'] * 1e3:10.1f}m {r['hidden']:7.0%} {r['factor_stage'] * 1e3:8.1f}m {speed:>9} {r['iteration'] * 1e3:9.1f}m"
            )
        out = {
            "args": vars(args),
            "machine": machine(),
            "world_size": backend.size,
            "engine": backend.name,
            "sgd": baseline,
            "results": summary,
            "samples": samples,
        }
        from pathlib import Path

        path = save_json(out, Path(args.out).name, Path(args.out).parent)
        png = bar_chart(
            Path(args.out).with_suffix(".png"),
            list(summary),
            {
                "FactorComp": [r["factor_compute"] * 1e3 for r in summary.values()],
                "FactorComm (non-overlapped)": [r["factor_comm_nonoverlap"] * 1e3 for r in summary.values()],
            },
            f"Fig. 10: factor stage per fusion policy ({args.model}, {backend.size} workers)",
            "ms per iteration",
        )
        print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
