"""Add the eigendecomposition curve (or, with ``--curve eigen_warm``, the warm-started refresh's) to a
performance-model file measured before it existed.

Times ``eigen_payload`` (``torch.linalg.eigh`` and the ``[Q, d]`` buffer, as
the decomposition stage runs it) at exactly the dimensions of the file's
inversion curve, with the file's dtype and thread count, in this one process.
Each point is the median *CPU time of this thread* (``time.thread_time``), so
that other jobs sharing the cores do not inflate it; the inversion is
re-timed the same way beside it, and its ratio to the file's inversion times
is recorded, as a check that the two curves are comparable. Fits the curve
as :func:`~spdkfac.perfmodels.fit_inverse_model` fits the inversions; writes
``eigen``, ``measurements.eigen``, ``fit_quality.eigen`` and
``meta.eigen_curve`` (how it was measured) and leaves every other field as
it was::

    python scripts/add_eigen_curve.py perfmodels/reference-cpu-gloo-2.json
    python scripts/add_eigen_curve.py --curve eigen_warm perfmodels/reference-cpu-gloo-2.json

``eigen_warm`` times one warm refresh as shipped (``eigen_refresh='warm'``
from a nearby basis, :func:`~spdkfac.perfmodels.bench.warm_refresh_call`):
rerun it on a file whose warm curve an earlier warm step measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from spdkfac.kfac.eigenbasis import eigen_payload
from spdkfac.kfac.linalg import invert_spd
from spdkfac.perfmodels import PerfModel, fit_inverse_model
from spdkfac.perfmodels.bench import warm_refresh_call

#: The timed call of each curve, from the factor (what it needs beforehand is made outside the timing).
CURVES: dict[str, Callable[[torch.Tensor], Callable[[], object]]] = {
    "eigen": lambda spd: lambda: eigen_payload(spd),
    "eigen_warm": warm_refresh_call,
}


def _cpu_times(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--curve", choices=sorted(CURVES), default="eigen", help="which curve to measure and add (default: eigen)")
    args = ap.parse_args()
    name = args.curve
    path = Path(args.file)
    data = json.loads(path.read_text())
    PerfModel.from_dict(data, str(path))  # refuse a broken file before minutes of measuring
    meta = data.get("meta", {})
    dims = [int(d) for d in data["measurements"]["inverse"]["dims"]]
    file_inverse = data["measurements"]["inverse"]["seconds"]
    torch.set_num_threads(int(meta.get("torch_threads", 1)))
    dtype = getattr(torch, meta.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(0)
    medians, means, inverse_ratio = [], [], []
    for d, t_file in zip(dims, file_inverse):
        x = torch.randn(d, d, generator=gen, dtype=torch.float64).to(dtype)
        spd = x @ x.T / d
        reps = 3 if d >= 1024 else 9  # a short run: the large points cost seconds each
        times = _cpu_times(CURVES[name](spd), reps)
        inverse = statistics.median(_cpu_times(lambda: invert_spd(spd, 1e-3), reps))  # noqa: B023 timed within this iteration
        medians.append(statistics.median(times))
        means.append(statistics.fmean(times))
        inverse_ratio.append(inverse / t_file)
        print(
            f"{name} d={d}: {medians[-1] * 1e3:.2f} ms; inversion {inverse * 1e3:.2f} ms here, "
            f"{t_file * 1e3:.2f} ms in the file ({reps} repeats)",
            file=sys.stderr,
            flush=True,
        )
    model, quality = fit_inverse_model(dims, medians)
    quality["max_rel_error"] = max(abs(model.fitted(d) - t) / t for d, t in zip(dims, medians))
    data[name] = {
        "kind": model.kind,
        **model.params,
        "unit": "seconds, dimension d",
        "measured": {str(d): t for d, t in zip(dims, medians)},
    }
    data.setdefault("measurements", {})[name] = {"dims": dims, "seconds": medians, "mean_seconds": means}
    data.setdefault("fit_quality", {})[name] = quality
    meta[f"{name}_curve"] = (
        f"added {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} by "
        f"scripts/add_eigen_curve.py: one process, {torch.get_num_threads()} thread(s), {dtype}, torch "
        f"{torch.__version__}, median thread CPU time of 3 (d >= 1024) or 9 runs after one warm-up, on a shared "
        f"machine; the inversions re-timed the same way took {min(inverse_ratio):.2f}-{max(inverse_ratio):.2f}x "
        f"(median {statistics.median(inverse_ratio):.2f}x) the file's inverse curve"
    )
    meta[f"{name}_curve_inverse_ratio"] = dict(zip(map(str, dims), inverse_ratio))
    data["meta"] = meta
    PerfModel.from_dict(data, str(path))
    path.write_text(json.dumps(data, indent=1, sort_keys=False))
    print(f"wrote the {name} curve ({model.kind}) into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
