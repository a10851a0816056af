"""Iteration time beside KAISA itself: its eigen and inverse methods against this project's, in one run.

    pip install --no-deps kfac-pytorch      # KAISA (module ``kfac``); torch is its only run-time need
    torchrun --nproc_per_node 2 -m benchmarks.vs_kaisa --model resnet50 --resolution 32 --batch-size 4

Systems, all on the same model (same initialisation), data, damping,
factor decay, KL-clip and update frequencies:

* ``kaisa-eigen``, ``kaisa-inverse``: ``kfac.preconditioner.KFACPreconditioner``
  with ``compute_method`` 'eigen' / 'inverse' and ``grad_worker_fraction=1``
  (COMM-OPT: every worker holds every decomposition, as KAISA's docs give
  for a small world), its other options at their defaults (bucketed factor
  all-reduce, decompositions placed greedily by n³, the eigenvalue outer
  product precomputed); the model in ``DistributedDataParallel`` and
  ``preconditioner.step()`` before ``torch.optim.SGD.step()``, as its
  README shows; ``kaisa-eigen-memopt``: the eigen method with
  ``grad_worker_fraction=1/P`` (MEM-OPT: each layer decomposed and
  preconditioned on one worker, which broadcasts the result), KAISA's own
  way of not preconditioning every layer everywhere;
* ``spdkfac-eigen``, ``spdkfac-eigen-warm``, ``spdkfac-inverse``: this
  project's optimizer (``compute_method='eigen'``, the same with
  ``eigen_refresh='warm'`` and ``grad_worker_fraction='auto'`` (which
  splits the preconditioning among the workers where the performance
  model says it pays, every worker still holding every basis), and the
  inverse method); ``spdkfac-eigen-warm-commopt``: the warm refresh with
  every worker preconditioning every layer.

Rounds alternate the systems (the order rotates every round) and each
system is built, warmed up, measured and freed in turn, so only one
system's K-FAC state is in memory at a time. Warm refresh makes a full
``eigh`` every ``--eigen-full-every`` refreshes: ``--iters`` should be a
multiple of it, so every measured window holds its share of full ones (the
mean is then the amortised cost; the median of such a window is a warm
iteration's). For each of this project's warm systems the JSON records, per
measured iteration, how many factors were refreshed warm, in full by
schedule and in full because the residual check failed
(:meth:`~spdkfac.SPDKFACOptimizer.refresh_statistics`), and the share of
warm refreshes over the window.

The learning rate is the one the model trains with (SGD's 0.1, momentum
0.9): the factors, and so the warm refresh's work, depend on how far the
weights move. ``--lr 1e-4`` keeps them almost still (the earlier published
setting; label such a run as such).

``--update-freq 10 100`` (the amortised schedule) adds, per system, the
seconds of each kind of iteration (plain, factors only, decomposition: a warm
system's warm tries and scheduled full ``eigh`` apart) and the schedule's
amortised mean built from them. ``--warmup-update-freq 10 100`` with a long
``--warmup`` (e.g. 101) trains both systems past the first iterations, where
the factors move most, on that cheap schedule before measuring
``--update-freq`` (its last warm-up iteration already runs the measured one).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac import make_optimizer
from spdkfac.kfac.methods.warm import REFRESH_KINDS, WarmRefresh
from spdkfac.models import get_model
from spdkfac.runtime.host_memory import release_freed_memory
from spdkfac.runtime.output_path import output_file

from .common import RESULTS, log, machine, rank_batch, ratio_interval, save_json, start, stats, workload_parser

INSTALL = "pip install --no-deps kfac-pytorch   (KAISA, module kfac; torch is its only run-time need)"

#: system name -> this project's variant spec (KAISA's are built by System._kaisa)
SPDKFAC_SYSTEMS = {
    "spdkfac-eigen": "spdkfac:compute_method=eigen",
    "spdkfac-eigen-warm": "spdkfac:compute_method=eigen,eigen_refresh=warm,eigen_full_every={full_every},grad_worker_fraction=auto",
    "spdkfac-eigen-warm-commopt": "spdkfac:compute_method=eigen,eigen_refresh=warm,eigen_full_every={full_every}",
    "spdkfac-inverse": "spdkfac",
}
#: system name -> KAISA's (compute_method, grad_worker_fraction); None: 1/P (MEM-OPT)
KAISA_SYSTEMS: dict[str, tuple[str, float | None]] = {
    "kaisa-eigen": ("eigen", 1.0),
    "kaisa-eigen-memopt": ("eigen", None),
    "kaisa-inverse": ("inverse", 1.0),
}
SYSTEMS = [  # neighbours in time are compared
    "kaisa-eigen",
    "spdkfac-eigen-warm",
    "kaisa-eigen-memopt",
    "spdkfac-eigen",
    "spdkfac-eigen-warm-commopt",
    "kaisa-inverse",
    "spdkfac-inverse",
]
BASELINE = "kaisa-eigen"  # the ratios' numerator: the issue's target is measured against KAISA's eigen method


def require_kaisa() -> Any:
    """The ``kfac`` module (KAISA); a SystemExit saying how to install it when it is missing."""
    try:
        import kfac.preconditioner
    except ImportError:
        raise SystemExit(
            f"error: the kaisa-* systems need KAISA (kfac-pytorch), an optional benchmark dependency:\n    {INSTALL}"
        ) from None
    return kfac


class System:
    """One system's model and optimizer, stepped one iteration at a time (see the module docstring)."""

    def __init__(self, name: str, args: Any, backend: Any) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model: nn.Module = get_model(args.model)
        self.step: Callable[[], None]
        self.zero_grad: Callable[[], None]
        if name in KAISA_SYSTEMS:
            self._kaisa(KAISA_SYSTEMS[name], args)
        else:
            self._spdkfac(SPDKFAC_SYSTEMS[name].format(full_every=args.eigen_full_every), args, backend)

    def _spdkfac(self, spec: str, args: Any, backend: Any) -> None:
        self.opt = make_optimizer(
            spec,
            self.model,
            lr=args.lr,
            momentum=0.9,
            backend=backend,
            perf_model=args.perf_model,
            damping=args.damping,
            factor_decay=args.factor_decay,
            kl_clip=args.kl_clip,
            factor_update_freq=update_freq(args, 0),
            inv_update_freq=update_freq(args, 1),
            profile_steps=1,
        )
        self.forward = self.model
        self.zero_grad, self.step = self.opt.zero_grad, self.opt.step
        self.cleanup = self.opt.remove_hooks

    def _kaisa(self, system: tuple[str, float | None], args: Any) -> None:
        kfac = require_kaisa()
        method, fraction = system
        # KAISA's recipe: gradients averaged by DistributedDataParallel, then preconditioner.step(), then the SGD step.
        self.forward = nn.parallel.DistributedDataParallel(self.model)
        sgd = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        pre = kfac.preconditioner.KFACPreconditioner(
            self.forward,
            factor_update_steps=update_freq(args, 0),
            inv_update_steps=update_freq(args, 1),
            damping=args.damping,
            factor_decay=args.factor_decay,
            kl_clip=args.kl_clip,
            lr=args.lr,
            compute_method=method,
            grad_worker_fraction=1.0 / torch.distributed.get_world_size() if fraction is None else fraction,
        )

        def step() -> None:
            pre.step()
            sgd.step()

        self.zero_grad, self.step = sgd.zero_grad, step
        self.cleanup = lambda: None

    def iteration(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training iteration; its seconds."""
        t0 = time.perf_counter()
        self.zero_grad()
        nn.functional.cross_entropy(self.forward(x), y).backward()
        self.step()
        return time.perf_counter() - t0

    def refresh_totals(self) -> dict[str, int] | None:
        """This project's refresh counts so far (warm, full by schedule, full on drift); None for KAISA."""
        opt = getattr(self, "opt", None)
        if opt is None:
            return None
        totals = opt.refresh_statistics()["totals"]
        return {kind: int(totals.get(kind, 0)) for kind in REFRESH_KINDS}


class WarmupSchedule:
    """``f(step)``: the warm-up's update frequency before step ``switch``, the measured one from it (both systems
    take the update frequencies as a function of the step)."""

    def __init__(self, warmup: int, measured: int, switch: int) -> None:
        self.warmup, self.measured, self.switch = warmup, measured, switch

    def __call__(self, step: int) -> int:
        return self.warmup if step < self.switch else self.measured


def update_freq(args: Any, which: int) -> int | WarmupSchedule:
    """The factor (``which=0``) or decomposition (1) update frequency both systems are given: ``--update-freq``, or
    with ``--warmup-update-freq`` a schedule that runs the warm-up's frequency until the last warm-up iteration,
    which already runs ``--update-freq`` (so the decomposition after the warm-up's long gap is not measured)."""
    if args.warmup_update_freq is None:
        return int(args.update_freq[which])
    return WarmupSchedule(int(args.warmup_update_freq[which]), int(args.update_freq[which]), args.warmup - 1)


def round_order(systems: list[str], rnd: int) -> list[str]:
    """The systems of round ``rnd`` (0-based): the list rotated by ``rnd``, so none always runs first."""
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


def measure(name: str, args: Any, backend: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[dict[str, Any]] | None]:
    """One system built, warmed up, measured and freed; its measured iterations' seconds, and per measured iteration
    the refreshes of each kind it made (None for a system without warm refresh counts)."""
    system = System(name, args, backend)
    for _ in range(args.warmup):
        system.iteration(x, y)
    secs: list[float] = []
    refreshes: list[dict[str, Any]] | None = [] if system.refresh_totals() is not None else None
    for _ in range(args.iters):
        before = system.refresh_totals()
        secs.append(system.iteration(x, y))
        after = system.refresh_totals()
        if refreshes is not None and before is not None and after is not None:
            refreshes.append({kind: after[kind] - before[kind] for kind in REFRESH_KINDS})
            factors = system.opt.refresh_statistics()["factors"]
            drifts = {name: f["drift"] for name, f in factors.items() if f["drift"] is not None}
            if drifts and refreshes[-1]["warm"] + refreshes[-1]["full_drift"]:  # measured this iteration (each factor refreshed)
                worst = max(drifts, key=lambda name: drifts[name])
                refreshes[-1]["max_drift"], refreshes[-1]["max_drift_factor"] = drifts[worst], worst
    if refreshes is not None and not any(sum(r[kind] for kind in REFRESH_KINDS) for r in refreshes):
        refreshes = None  # an exact method (no warm refresh to count)
    if refreshes:  # which factors fell back, over the whole run (warm-up included): where the check fails
        refreshes[-1]["factors"] = system.opt.refresh_statistics()["factors"]
    system.cleanup()
    del system
    gc.collect()
    release_freed_memory()  # the next system starts from the same footprint
    return secs, refreshes


def iteration_kind(step: int, update_freq: list[int], counts: dict[str, Any] | None) -> str:
    """What iteration ``step`` (0-based, warm-up included) does: ``decomposition`` (``decomposition_full`` /
    ``decomposition_warm`` where a warm system's refresh counts tell which), ``factor`` or ``plain``.

    Both KAISA and this project update factors where ``step % factor_freq == 0`` and decompose where
    ``step % decomposition_freq == 0``.
    """
    if step % update_freq[1] == 0:
        if counts is None:
            return "decomposition"
        return "decomposition_full" if counts["full_scheduled"] else "decomposition_warm"
    return "factor" if step % update_freq[0] == 0 else "plain"


def amortised(kinds: dict[str, dict[str, Any]], update_freq: list[int], full_every: int) -> float | None:
    """Mean seconds per iteration over a whole schedule, from the per-kind means: per ``decomposition_freq``
    iterations one decomposition (a warm system's: a full ``eigh`` once in ``full_every``, warm the other times),
    ``decomposition_freq / factor_freq - 1`` factor iterations, the rest plain. None where a kind was not measured."""
    factor_freq, decomposition_freq = update_freq
    mean = {kind: k["mean"] for kind, k in kinds.items()}
    if "decomposition" in mean:
        decomposition = mean["decomposition"]
    elif "decomposition_full" in mean and "decomposition_warm" in mean:
        decomposition = (mean["decomposition_full"] + (full_every - 1) * mean["decomposition_warm"]) / full_every
    else:
        return None
    factors = decomposition_freq // factor_freq - 1
    plain = decomposition_freq - 1 - factors
    if (factors and "factor" not in mean) or (plain and "plain" not in mean):
        return None
    return (decomposition + factors * mean.get("factor", 0.0) + plain * mean.get("plain", 0.0)) / decomposition_freq


def summarise(samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Median and mean per system, and the speed-up of each over KAISA's eigen (and inverse) method with 95% intervals."""
    rows = []
    for name, xs in samples.items():
        row: dict[str, Any] = {"system": name, **stats(xs)}
        for base in (BASELINE, "kaisa-eigen-memopt", "kaisa-inverse"):
            if base in samples and base != name:
                for statistic in ("median", "mean"):
                    ratio = stats(samples[base])[statistic] / row[statistic]
                    lo, hi = ratio_interval(samples[base], xs, paired=False, statistic=statistic)
                    row[f"vs_{base}_{statistic}"] = ratio
                    row[f"vs_{base}_{statistic}_interval"] = [lo, hi]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__, iters=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--eigen-full-every", type=int, default=5, help="eigen_full_every of spdkfac-eigen-warm")
    ap.add_argument("--update-freq", type=int, nargs=2, default=[1, 1], metavar=("FACTOR", "DECOMPOSITION"))
    ap.add_argument(
        "--warmup-update-freq",
        type=int,
        nargs=2,
        default=None,
        metavar=("FACTOR", "DECOMPOSITION"),
        help="update frequencies of the warm-up (e.g. 10 100: a cheap way to the steady state of training before "
        "measuring --update-freq; the last warm-up iteration already runs --update-freq)",
    )
    ap.add_argument("--lr", type=float, default=0.1, help="SGD's rate for ResNet-50 (a lower one keeps the factors still)")
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--factor-decay", type=float, default=0.95)
    ap.add_argument("--kl-clip", type=float, default=0.001, help="KAISA cannot switch KL-clip off, so both systems use it")
    ap.add_argument("--out", default=str(RESULTS / "vs_kaisa.json"), type=output_file(make_parents=True))
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.warmup < 1 or args.iters < 2:
        ap.error("--warmup must be >= 1 and --iters >= 2 (a ratio interval needs two samples)")
    for freqs, flag in ((args.update_freq, "--update-freq"), (args.warmup_update_freq, "--warmup-update-freq")):
        if freqs is not None and (min(freqs) < 1 or freqs[1] % freqs[0]):
            ap.error(f"{flag}: both positive, the decomposition frequency a multiple of the factor one; got {freqs}")
    if any(s in KAISA_SYSTEMS for s in args.systems):
        require_kaisa()  # before any worker starts measuring
    backend = start(args)
    if backend.name != "torch":
        raise SystemExit("error: run under torchrun: KAISA's systems use torch.distributed (DistributedDataParallel)")
    rank = backend.rank
    log(
        rank,
        f"vs KAISA: {args.model} @ {args.resolution}px, batch {args.batch_size}/worker, {backend.size} workers, "
        f"factors every {args.update_freq[0]}, decompositions every {args.update_freq[1]} iterations; "
        f"{args.rounds} round(s) of {args.warmup} warm-up + {args.iters} measured iterations per system"
        + (
            ""
            if args.warmup_update_freq is None
            else " (warm-up at factors every {}, decompositions every {})".format(*args.warmup_update_freq)
        ),
    )
    x, y = rank_batch(rank, args.batch_size, args.resolution)
    samples: dict[str, list[float]] = {s: [] for s in args.systems}
    refreshes: dict[str, list[dict[str, Any]]] = {}  # warm systems: refresh counts per measured iteration
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        rounds.append({"order": round_order(args.systems, rnd), "seconds": {}})
        for name in rounds[-1]["order"]:
            secs, counts = measure(name, args, backend, x, y)
            warm = (
                ""
                if counts is None
                else "  full refreshes per iteration: " + " ".join(str(c["full_scheduled"] + c["full_drift"]) for c in counts)
            )
            log(rank, f"  round {rnd + 1}/{args.rounds} {name:<20} " + " ".join(f"{s:.2f}" for s in secs) + " s" + warm)
            samples[name] += secs
            rounds[-1]["seconds"][name] = secs
            if counts is not None:
                refreshes.setdefault(name, []).extend(counts)
                rounds[-1].setdefault("refreshes", {})[name] = counts
            if rank == 0:  # what is measured so far, in case the run is stopped before the end
                save(args, backend, samples, rounds, refreshes, partial=True)
    if rank == 0:
        table = save(args, backend, samples, rounds, refreshes, partial=False)
        print(f"\n{'system':<20} {'median (s)':>11} {'mean (s)':>9}  {'KAISA eigen / row (median, mean)':>34}")
        for row in table:
            vs = f"{row[f'vs_{BASELINE}_median']:.2f}x, {row[f'vs_{BASELINE}_mean']:.2f}x" if f"vs_{BASELINE}_median" in row else "-"
            share = row.get("refreshes", {}).get("warm_share")
            warm = "" if share is None else f"  warm refreshes {100 * share:.0f}%"
            print(f"{row['system']:<20} {row['median']:11.2f} {row['mean']:9.2f}  {vs:>34}{warm}")
            if "amortised_s" in row:
                kinds = ", ".join(f"{kind} {k['mean']:.2f} s (n={k['n']})" for kind, k in sorted(row["kinds"].items()))
                vs_amortised = row.get(f"vs_{BASELINE}_amortised")
                vs = "" if vs_amortised is None else f"  KAISA eigen / row {vs_amortised:.2f}x"
                print(f"{'':<20} amortised over the schedule {row['amortised_s']:.2f} s{vs}  ({kinds})")
        print(f"wrote {args.out}")


def refresh_summary(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """A warm system's refreshes over its measured iterations: totals per kind, the warm share, and how many
    iterations made at least one full ``eigh`` (by schedule, or because the residual check failed)."""
    totals = {kind: sum(c[kind] for c in counts) for kind in REFRESH_KINDS}
    total = sum(totals.values())
    return {
        **totals,
        "refreshes": total,
        "warm_share": totals["warm"] / total if total else None,
        "iterations": len(counts),
        "iterations_with_full": sum(1 for c in counts if c["full_scheduled"] + c["full_drift"]),
        "iterations_with_drift_fallback": sum(1 for c in counts if c["full_drift"]),
    }


def save(
    args: Any,
    backend: Any,
    samples: dict[str, list[float]],
    rounds: list[dict[str, Any]],
    refreshes: dict[str, list[dict[str, Any]]],
    partial: bool,
) -> list[dict[str, Any]]:
    """Write the JSON (``partial``: some systems or rounds still to come); the table it holds."""
    done = {name: xs for name, xs in samples.items() if len(xs) >= 2}
    table = summarise(done)
    for row in table:
        if row["system"] in refreshes:
            row["refreshes"] = refresh_summary(refreshes[row["system"]])
        if list(args.update_freq) != [1, 1]:
            row.update(per_kind(row["system"], args, rounds))
    if list(args.update_freq) != [1, 1] and any("amortised_s" in r for r in table):
        base = next((r for r in table if r["system"] == BASELINE and "amortised_s" in r), None)
        for row in table:
            if base is not None and "amortised_s" in row:
                row[f"vs_{BASELINE}_amortised"] = base["amortised_s"] / row["amortised_s"]
    save_json(
        {
            "args": vars(args),
            "machine": machine(),
            "world_size": backend.size,
            "engine": backend.name,
            "partial": partial,
            "kaisa": kaisa_source() if any(s in KAISA_SYSTEMS for s in args.systems) else None,
            "specs": {name: describe(name, args) for name in args.systems},
            "table": table,
            "samples": samples,
            "rounds": rounds,
        },
        Path(args.out).name,
        Path(args.out).parent,
    )
    return table


def per_kind(name: str, args: Any, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's seconds per kind of iteration (:func:`iteration_kind`) over its rounds, and the schedule's
    amortised mean from them (:func:`amortised`; a warm system: a full ``eigh`` every ``WarmRefresh().full_every``
    refreshes, the optimizer's default, whatever ``--eigen-full-every`` the run used to measure one)."""
    by_kind: dict[str, list[float]] = {}
    for rnd in rounds:
        secs = rnd["seconds"].get(name, [])
        counts = rnd.get("refreshes", {}).get(name)
        for i, s in enumerate(secs):
            kind = iteration_kind(args.warmup + i, list(args.update_freq), None if counts is None else counts[i])
            by_kind.setdefault(kind, []).append(s)
    kinds = {kind: stats(xs) if len(xs) >= 2 else {"mean": xs[0], "median": xs[0], "n": 1} for kind, xs in by_kind.items()}
    out: dict[str, Any] = {"kinds": kinds}
    cost = amortised(kinds, list(args.update_freq), WarmRefresh().full_every)
    if cost is not None:
        out["amortised_s"] = cost
    return out


def describe(name: str, args: Any) -> str:
    """What the system runs: this project's variant spec, or KAISA's constructor."""
    if name in KAISA_SYSTEMS:
        method, fraction = KAISA_SYSTEMS[name]
        given = "1/P" if fraction is None else repr(fraction)
        return f"kfac.preconditioner.KFACPreconditioner(compute_method='{method}', grad_worker_fraction={given}) + DDP + SGD"
    return SPDKFAC_SYSTEMS[name].format(full_every=args.eigen_full_every)


def kaisa_source() -> dict[str, Any]:
    """Which KAISA ran: the module's version and where it was imported from."""
    kfac = require_kaisa()
    return {"version": getattr(kfac, "__version__", "unknown"), "file": str(Path(kfac.__file__).parent)}


if __name__ == "__main__":
    main()
