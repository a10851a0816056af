"""The command line ``python -m spdkfac.simulate``: predict iteration time and its breakdown at any worker count.

Two steps::

    python -m spdkfac.simulate profile --model resnet50 --resolution 32 --batch-size 4 --out profile.json
    python -m spdkfac.simulate predict --profile profile.json --perf-model perfmodels/x.json --workers 2 4 8 64

``profile`` measures one worker (launch it with the job's launcher so that all
workers profile at once and share the machine as in training): forward and backward time, when each
factor becomes ready and how long it took, gradient sizes, and the time of the
rest of ``step()``. ``predict`` replays the decisions the optimizer makes, with
the optimizer's own functions (:mod:`spdkfac.plan.work_plan`): factor groups from
:func:`~spdkfac.plan.work_plan.fusion_groups` (launched when their last member is
ready, or after backward without pipelining), gradient all-reduces launched as
each layer's backward finishes, one communication engine serving launches in
order with ``t(m) = alpha + beta*m`` (:func:`spdkfac.plan.factor_fusion.serve_in_order`),
then the inversion stage's makespan from :class:`~spdkfac.plan.work_plan.WorkPlan`
(planned with the fitted inversion model, as the optimizer plans; charged at
the ratio of the profile's measured inversions to that model), with each rank's
packing work (the profile's per-factor unpack and pack times). On steps that
keep the inverses, variants with ``overlap_preconditioning`` hide up to their
preconditioning time of the gradient wait, and on such steps that update the
factors what remains of it hides the factor wait too. Variants may carry changes
(``'spdkfac:overlap_preconditioning=false'``, see :func:`spdkfac.variants.variant_config`).

Under a launcher every rank profiles at once; the profile holds the mean
rank's times, each rank's totals and how far each iteration's slowest rank
lagged the mean, and every synchronized step waits for the slowest rank:
that measured excess, scaled to P workers by the expected maximum of P
normal draws (:func:`~.prediction.iteration_lag_share`), is charged as
GradComm (and as InverseComm for the stage's broadcasts). The
breakdown is the mean rank's, as the optimizer's timeline and the
``iteration_time`` benchmark record it.

Scaling to P workers: the fitted file holds costs at its own world size W.
All-reduce costs are scaled by the ring factor ``(P-1)/P`` relative to W's
(alpha by ``(P-1)/(W-1)``), broadcasts by ``ceil(log2 P)/ceil(log2 W)`` (a
tree). ``--contention`` models machines where communication needs the same
cores as computation (CPU workers with no spare core): every second the
engine works is a second of the worker's core, paid once. What the engine
serves while the passes run slows forward+backward (the hooks and the
factor work in them alike), what is left after them is waited for, and
receiving a broadcast costs the receiver as much as sending costs the sender;
each all-reduce costs what the profile's plain-SGD passes measured their real
all-reduces to cost over the fitted model
(:func:`~.prediction.communication_scale`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from ..comm import detect_launcher, get_backend
from ..perfmodels import PerfModel, PerfModelError
from ..runtime.affinity import add_bind_cores_option, bind_cores_if_asked
from ..runtime.host_memory import retain_freed_memory
from ..runtime.output_path import output_file
from ..variants import variant_argv, variant_config
from .prediction import PARTS, PHASES, parts_of_phases, predict_phases
from .profile_file import load_profiles
from .profiling import measure_profile

__all__ = ["DEFAULT_VARIANTS", "main"]

DEFAULT_VARIANTS = ("sgd", "dkfac", "mpdkfac", "spdkfac")  # what `predict` predicts without --variants


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m spdkfac.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile", help="measure a per-layer compute profile (under the job's launcher: every worker at once)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU the job trains on (one process)")
    p.add_argument("--threads", type=int, default=1)
    add_bind_cores_option(p)
    p.add_argument("--out", required=True, type=output_file())
    q = sub.add_parser("predict", help="predict iteration times from a profile and a performance model")
    q.add_argument("--profile", required=True, nargs="+", help="one profile, or several to average (e.g. taken before and after)")
    q.add_argument("--perf-model", required=True)
    q.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    q.add_argument("--variants", nargs="*", action="extend", default=None, help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    q.add_argument("--contention", action="store_true", help="communication cannot overlap computation (CPU workers, no spare core)")
    q.add_argument("--update-freq", type=int, nargs=2, default=[1, 1])
    q.add_argument("--json", default=None, type=output_file(), help="also write the predictions here")
    q.add_argument(
        "--phases", action="store_true", help="the finer breakdown: the hooks, preconditioning and update apart (predict_phases)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(variant_argv(sys.argv[1:] if argv is None else argv))
    warnings.filterwarnings("ignore")
    return _profile(args) if args.cmd == "profile" else _predict(args)


def _profile(args: argparse.Namespace) -> int:
    """Under a launcher, every worker profiles at once, so the profile sees the same sharing of cores and
    memory bandwidth as a real run (and the SGD passes the real gradient all-reduces); rank 0 writes it."""
    for flag, value in (
        ("--resolution", args.resolution),
        ("--batch-size", args.batch_size),
        ("--iters", args.iters),
        ("--threads", args.threads),
    ):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    cores = bind_cores_if_asked(args)
    comm = get_backend("auto") if detect_launcher() != "single" else None  # the launcher detection of spdkfac.comm
    rank, workers = (comm.rank, comm.size) if comm is not None else (0, 1)
    if workers == 1:
        comm = None
    retained = retain_freed_memory()  # profile under the training job's allocator settings
    prof = measure_profile(args.model, args.resolution, args.batch_size, args.iters, args.threads, comm, args.device)
    prof = dataclasses.replace(
        prof, concurrent_workers=workers, retained_freed_memory=retained, bound_cores=None if cores is None else tuple(cores)
    )
    if rank != 0:
        return 0
    prof.save(args.out)
    print(
        f"profile of {args.model}: forward {prof.forward * 1e3:.1f} ms, backward {prof.backward * 1e3:.1f} ms, "
        f"{len(prof.factors)} factors; wrote {args.out}"
    )
    return 0


def _predict(args: argparse.Namespace) -> int:
    impossible = [f"--workers {w}" for w in args.workers if w < 1]
    factor_freq, inv_freq = args.update_freq
    if factor_freq < 1 or inv_freq < 1 or inv_freq % factor_freq:
        impossible.append(f"--update-freq {factor_freq} {inv_freq} (both >= 1, the second a multiple of the first)")
    if impossible:
        print(f"error: impossible arguments: {', '.join(impossible)}", file=sys.stderr)
        return 2
    try:
        prof = load_profiles(args.profile)
        perf = PerfModel.load(args.perf_model)
    except (ValueError, OSError, PerfModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    variants = args.variants or list(DEFAULT_VARIANTS)
    for v in variants:
        try:
            variant_config(v)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    out: dict[str, dict[str, float]] = {}
    columns = PHASES if args.phases else PARTS
    print(f"{'workers':>7} {'variant':<10} {'iter (ms)':>10} " + " ".join(f"{k:>12}" for k in columns))
    for w in args.workers:
        for v in variants:
            phases = predict_phases(prof, perf, w, v, args.contention, (factor_freq, inv_freq))
            r = phases if args.phases else parts_of_phases(phases)
            out[f"{w}:{v}"] = r
            print(f"{w:>7} {v:<10} {r['iteration'] * 1e3:10.1f} " + " ".join(f"{r[k] * 1e3:12.1f}" for k in columns))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"profile": args.profile, "perf_model": args.perf_model, "contention": args.contention, "predictions": out}, fh, indent=1
            )
    return 0
