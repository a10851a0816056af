"""Command line: ``python -m spdkfac.perfmodels {benchmark,plot,show} ...``.

horovodrun -np 2 -H localhost:2 --gloo python -m spdkfac.perfmodels benchmark --quick --out perfmodels/x.json
python -m spdkfac.perfmodels plot perfmodels/x.json --out perfmodels/x.png
python -m spdkfac.perfmodels show perfmodels/x.json
python -m spdkfac.perfmodels add-batched perfmodels/x.json   # a file fitted before batched measurements
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..comm import get_backend
from ..kfac.layers import factor_list, kfac_layers
from ..models import get_model
from ..runtime.affinity import add_bind_cores_option, bind_cores_if_asked
from ..runtime.host_memory import retain_freed_memory
from ..runtime.output_path import output_file, unwritable_reason
from .bench import BenchmarkConfig, Mpi4pyEngine, add_batched, run_benchmark
from .models import PerfModel, PerfModelError
from .plot import plot_perf_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m spdkfac.perfmodels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("benchmark", help="measure this launch's workers and write a model file")
    b.add_argument("--out", required=True, type=output_file(), help="JSON file to write (rank 0)")
    b.add_argument("--quick", action="store_true", help="fewer, smaller points (CPU)")
    b.add_argument("--engine", default="auto", choices=("auto", "horovod", "torch", "single", "mpi4py"))
    b.add_argument("--repeats", type=int, default=100)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--device", default="auto")
    b.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    b.add_argument("--dims", type=int, nargs="*", help="inversion/eigendecomposition/broadcast dimensions to measure")
    b.add_argument("--no-eigen", action="store_true", help="skip the eigendecompositions (only compute_method='inverse' is planned)")
    b.add_argument(
        "--no-batched", action="store_true", help="skip the batched decompositions (grouped convolutions are then costed by a rule)"
    )
    b.add_argument("--model", default=None, help="also measure every factor dimension of this spdkfac.models network")
    b.add_argument("--sizes", type=int, nargs="*", help="all-reduce message sizes (elements)")
    b.add_argument("--threads", type=int, default=None, help="torch intra-op threads per worker")
    add_bind_cores_option(b)
    b.add_argument("--plot", default=None, type=output_file(), help="also write this PNG")
    p = sub.add_parser("plot", help="draw measurements against the fitted curves")
    p.add_argument("file")
    p.add_argument("--out", default=None, type=output_file(), help="PNG path (default: next to the JSON)")
    s = sub.add_parser("show", help="validate a model file and print its parameters")
    s.add_argument("file")
    ab = sub.add_parser(
        "add-batched",
        help="measure only the batched decompositions (grouped convolutions) here and add them to a model file",
    )
    ab.add_argument("file")
    ab.add_argument("--out", default=None, type=output_file(), help="JSON file to write (default: overwrite FILE)")
    ab.add_argument("--quick", action="store_true", help="fewer points")
    ab.add_argument("--repeats", type=int, default=30)
    ab.add_argument("--warmup", type=int, default=5)
    ab.add_argument("--threads", type=int, default=None, help="torch intra-op threads (use the training job's)")
    args = ap.parse_args(argv)

    if args.cmd == "benchmark":
        cores = bind_cores_if_asked(args)
        retain_freed_memory()  # as the training job does
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.repeats < 1 or args.warmup < 0:
            ap.error("--repeats must be >= 1 and --warmup >= 0")
        for flag, values in (("--dims", args.dims), ("--sizes", args.sizes)):
            # Checked before minutes of measuring: each model is a fit through at least two points.
            if values is not None and (len(set(values)) < 2 or min(values) < 1):
                ap.error(f"{flag} needs at least two distinct positive values to fit a model, got {values}")
        engine = Mpi4pyEngine() if args.engine == "mpi4py" else get_backend(args.engine)
        model_dims = None
        if args.model:
            model_dims = sorted({dim for _, dim in factor_list(kfac_layers(get_model(args.model)))})
        cfg = BenchmarkConfig(
            quick=args.quick,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            dtype=args.dtype,
            inverse_dims=args.dims,
            message_sizes=args.sizes,
            model_dims=model_dims,
            model_name=args.model,
            eigen=not args.no_eigen,
            batched=not args.no_batched,
        )
        if engine.rank == 0:
            print(
                f"benchmarking {engine.name} x{engine.size}: {len(cfg.sizes())} all-reduce sizes, "
                f"{len(cfg.dims())} dimensions, {cfg.repeats} repeats after {cfg.warmup} warm-up runs",
                file=sys.stderr,
            )
        model = run_benchmark(cfg, engine)
        model.meta["bound_cores"] = cores
        if engine.rank == 0:
            model.save(args.out)
            print(_summary(model))
            print(f"wrote {args.out}")
            if args.plot:
                print(f"wrote {plot_perf_model(model, args.plot)}")
        return 0
    try:
        model = PerfModel.load(args.file)
    except PerfModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "add-batched":
        return _add_batched(ap, args, model)
    if args.cmd == "plot" and args.out is None:  # the default, next to the JSON (a given --out is checked by argparse)
        args.out = str(args.file).rsplit(".", 1)[0] + ".png"
        problem = unwritable_reason(args.out)
        if problem:
            ap.error(f"cannot write {args.out} (the default --out of plot): {problem}")
    if args.cmd == "plot":
        print(f"wrote {plot_perf_model(model, args.out)}")
        return 0
    print(_summary(model))
    return 0


def _add_batched(ap: argparse.ArgumentParser, args: argparse.Namespace, model: PerfModel) -> int:
    """The ``add-batched`` command: one process, the file's other curves kept as they are."""
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    out = args.out or args.file
    problem = unwritable_reason(out)
    if problem:
        ap.error(f"cannot write {out}: {problem}")
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()
    device = str(model.meta.get("device", "cpu"))
    cfg = BenchmarkConfig(quick=args.quick, repeats=args.repeats, warmup=args.warmup, device="cpu" if device.startswith("cpu") else "auto")
    updated = add_batched(model, cfg, get_backend("single"))
    updated.save(out)
    print(_summary(updated))
    print(f"wrote {out}")
    return 0


def _summary(model: PerfModel) -> str:
    lines = [
        f"performance model {model.source}: measured {json.dumps({k: model.meta.get(k) for k in ('engine', 'world_size', 'device', 'dtype', 'date')})}"
    ]
    lines.append(
        f"  all-reduce  t(m) = {model.allreduce.alpha:.3e} + {model.allreduce.beta:.3e} * m   {model.fit_quality.get('allreduce', '')}"
    )
    lines.append(
        f"  broadcast   t(d) = {model.broadcast.alpha:.3e} + {model.broadcast.beta:.3e} * d(d+1)/2   {model.fit_quality.get('broadcast', '')}"
    )
    for name, curve in (("inverse", model.inverse), ("eigen", model.eigen)):
        if curve is None:
            lines.append(f"  {name:<11} not measured (compute_method='eigen' estimates it from the inverse model)")
            continue
        if curve.kind == "exp":
            lines.append(f"  {name:<11} t(d) = {curve.params['alpha']:.3e} * exp({curve.params['beta']:.3e} * d)")
        else:
            c = curve.params["coeffs"]
            lines.append(
                f"  {name:<11} t(d) = {c[0]:.3e} + {c[1]:.3e} d + {c[2]:.3e} d^2 + {c[3]:.3e} d^3 (cubic fitted better than Eq. 26)"
            )
        q = model.fit_quality.get(name, {})
        if q:
            lines.append(
                f"  {name} fit: chosen {q.get('chosen')}, exp mean rel err {q.get('exp', {}).get('mean_rel_error', float('nan')):.1%}"
                + (f", cubic {q['cubic']['mean_rel_error']:.1%}" if "cubic" in q else "")
            )
    for name, batched in model.batched.items():
        q = model.fit_quality.get(f"batched_{name}", {})
        lines.append(
            f"  {name} batched: {batched.call:.3e} + b ({batched.c0:.3e} + {batched.c1:.3e} d + {batched.c2:.3e} d^2 + {batched.c3:.3e} d^3), "
            f"{len(batched.measured)} points"
            + (f", max rel err {q['max_rel_error']:.1%} (rule without the fit: {q['rule_max_rel_error']:.1%})" if q else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
