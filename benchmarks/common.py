"""Shared helpers of the benchmark programs: engine, output folder, synthetic batch, summary statistics."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spdkfac.runtime.affinity import add_bind_cores_option, bind_cores_if_asked
from spdkfac.runtime.host_memory import retain_freed_memory
from spdkfac.runtime.output_path import output_file

RESULTS = Path(__file__).resolve().parent / "results"


class _StartState:
    """What start() set up in this process, reported with every result."""

    retained_memory = False  # whether start() switched off glibc's return of freed memory
    bound_cores: list[int] | None = None  # this rank's cores when start() bound it (--bind-cores)


_started = _StartState()


def workload_parser(doc: str, iters: int, out_name: str | None = None, model: str = "resnet50") -> argparse.ArgumentParser:
    """The options every benchmark shares: model, input size, per-worker batch, iterations, cost model, threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model)
    ap.add_argument("--resolution", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4, help="per worker")
    ap.add_argument("--iters", type=int, default=iters, help="measured iterations (per configuration and round)")
    ap.add_argument("--perf-model", default="perfmodels/reference-cpu-gloo-2.json")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    add_bind_cores_option(ap)
    if out_name is not None:
        ap.add_argument("--out", default=str(RESULTS / out_name), type=output_file(make_parents=True))
    return ap


def one_process_parser(doc: str, out_name: str, rounds: tuple[str, int, str], quick: str) -> argparse.ArgumentParser:
    """The options of the one-process benchmarks that time two arms in alternation: their rounds (``(flag, default,
    help)``), torch's threads (2: this machine's cores), ``--quick`` (small inputs, to test the benchmark) and
    ``--out``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    flag, default, help_text = rounds
    ap.add_argument(flag, type=int, default=default, help=help_text)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", default=str(RESULTS / out_name), type=output_file(make_parents=True))
    return ap


def save_result(args: argparse.Namespace, key: str, rows: Any) -> None:
    """``{"args", "machine", key: rows}`` written to ``--out``, and where it went said."""
    out = Path(args.out)
    print(f"wrote {save_json({'args': vars(args), 'machine': machine(), key: rows}, out.name, out.parent)}")


def start(args: argparse.Namespace, distributed: bool = True):
    """Apply ``--threads``, silence warnings, and return the communication engine (or None)."""
    warnings.filterwarnings("ignore")
    _started.bound_cores = bind_cores_if_asked(args)
    _started.retained_memory = retain_freed_memory()  # as the training job does: no per-iteration page faults in timings
    torch.set_num_threads(args.threads)
    if not distributed:
        return None
    from spdkfac.comm import get_backend

    return get_backend("auto")


def rank_batch(
    rank: int, batch_size: int, resolution: int, channels: int = 3, classes: int | Callable[[torch.Tensor], int] = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's synthetic batch: ``batch_size`` images ``channels x resolution x resolution`` and class labels.

    Drawn from a generator seeded with the rank (inputs first, then labels),
    so each rank's batch is the same in every run and differs between ranks,
    without touching the global random state the models are made with.
    ``classes``: the number of classes, or a function of the inputs that
    gives it (the width of a model's output, read before the labels are drawn).
    """
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch_size, channels, resolution, resolution, generator=g)
    n = classes(x) if callable(classes) else classes
    y = torch.randint(0, n, (batch_size,), generator=g)
    return x, y


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import os

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "retained_freed_memory": _started.retained_memory,
        # Horovod's background-thread cycle (ms; unset = Horovod's default of 1): costs CPU on small nodes.
        "horovod_cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME"),
        "bound_cores": _started.bound_cores,  # this rank's cores with --bind-cores, else None
        # How busy the machine was (1, 5 and 15 minutes) as the result is written, i.e. over the measurement.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max and standard deviation of a list of seconds."""
    xs = list(samples)
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


def ratio_interval(
    numerator: Sequence[float],
    denominator: Sequence[float],
    paired: bool,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
    statistic: str = "mean",
) -> tuple[float, float]:
    """Bootstrap interval of ``statistic(numerator) / statistic(denominator)`` from per-iteration seconds.

    On a noisy machine one iteration of the same work can take 15% more or
    less than the next, so a ratio of two means carries an error that the
    tables should show. ``paired``: the i-th samples of both lists come from
    the same round (interleaved runs), so iterations are resampled together
    and drift common to both cancels. Resampling iterations also varies how
    many factor or inversion steps a resample holds, which is the real
    uncertainty of an amortised mean measured over few update periods.
    ``statistic``: ``'mean'`` or ``'median'`` (as the benchmark reports).
    """
    if statistic not in ("mean", "median"):
        raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
    num = torch.tensor(list(numerator), dtype=torch.float64)
    den = torch.tensor(list(denominator), dtype=torch.float64)
    if num.numel() < 2 or den.numel() < 2:
        raise ValueError("a ratio interval needs at least two samples on each side")
    if paired and num.numel() != den.numel():
        raise ValueError(f"paired samples differ in number ({num.numel()} and {den.numel()})")
    g = torch.Generator().manual_seed(seed)
    i = torch.randint(num.numel(), (resamples, num.numel()), generator=g)
    j = i if paired else torch.randint(den.numel(), (resamples, den.numel()), generator=g)

    def centre(x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1) if statistic == "mean" else torch.quantile(x, 0.5, dim=1)  # the midpoint median

    ratios = centre(num[i]) / centre(den[j])
    tail = (1.0 - confidence) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return lo, hi


def split_by_factor_step(samples: Sequence[float], warmup: int, iters: int, factor_freq: int) -> dict[str, dict[str, float]]:
    """Mean seconds of the measured iterations that update the factors and of the others.

    ``samples`` are ``iters`` measured iterations per round (steps ``warmup``
    to ``warmup + iters - 1``, rounds one after another); step ``s`` updates
    the factors when ``s % factor_freq == 0``. In the amortised setting the
    two kinds cost very differently, and their means say where the overhead
    over SGD comes from. Kinds with no iteration in the window are left out.
    """
    xs = list(samples)
    if iters < 1 or factor_freq < 1 or len(xs) % iters:
        raise ValueError(f"{len(xs)} samples are not whole rounds of {iters} iterations (factor_freq {factor_freq})")
    kinds: dict[str, list[float]] = {"factor_steps": [], "other_steps": []}
    for i, x in enumerate(xs):
        step = warmup + i % iters
        kinds["factor_steps" if step % factor_freq == 0 else "other_steps"].append(x)
    return {k: {"mean": statistics.fmean(v), "n": len(v)} for k, v in kinds.items() if v}


def save_json(obj: Any, name: str, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(obj, indent=1))
    return path


def log(rank: int, *msg: Any) -> None:
    if rank == 0:
        print(*msg, flush=True)
        sys.stdout.flush()


def bar_chart(path: Path, labels: list[str], stacks: dict[str, list[float]], title: str, ylabel: str) -> Path:
    """A stacked bar chart (one bar per label, one colour per stack component)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels) + 2), 4.2))
    bottom = [0.0] * len(labels)
    for name, values in stacks.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
