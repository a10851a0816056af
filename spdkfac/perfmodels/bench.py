"""One-time cluster benchmarking: measure collectives, inversions and eigendecompositions, fit, store (Section VI-B).

Run under the launcher you train with, so the measurements use the real
workers and engine::

    horovodrun -np 4 python -m spdkfac.perfmodels benchmark --out perfmodels/mycluster.json

Each point is timed ``repeats`` times after ``warmup`` untimed runs (the
paper uses 100 and 10); the point is the *median* of the individual timings
(robust to the other processes of a shared machine; the mean is stored too),
averaged over the ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..comm import CommBackend, get_backend
from ..comm.mpi4py_backend import Mpi4pyEngine
from ..kfac.eigenbasis import eigen_payload
from ..kfac.factor_shape import FactorShape
from ..kfac.linalg import invert_spd, triangle_size
from ..kfac.methods import get_method
from ..kfac.methods.warm import WarmRefresh, descending_eigh
from .fitting import fit_batched, fit_inverse_model, fit_linear, r_squared
from .models import AllReduceModel, BatchedModel, BroadcastModel, InverseModel, PerfModel

__all__ = ["BenchmarkConfig", "Mpi4pyEngine", "run_benchmark", "warm_refresh_call"]

QUICK_DIMS = [64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
FULL_DIMS = [64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192]
QUICK_SIZES = [2**k for k in range(10, 23, 2)]  # 1K .. 4M elements
FULL_SIZES = [2**k for k in range(18, 28)]  # 256K .. 128M elements (1 MB .. 512 MB of float32)
# (blocks, d) of batched decompositions: depthwise 3x3 and 5x5 (MobileNetV2, EfficientNet-B0) and ResNeXt's 32 groups.
QUICK_BATCHED = [(32, 9), (384, 9), (144, 25), (32, 36), (32, 144)]
FULL_BATCHED = [(32, 9), (96, 9), (384, 9), (960, 9), (144, 25), (672, 25), (32, 36), (32, 72), (32, 144), (32, 288)]


@dataclass
class BenchmarkConfig:
    quick: bool = False
    repeats: int = 100
    warmup: int = 10
    device: str = "auto"
    dtype: str = "float32"
    inverse_dims: list[int] | None = None
    model_dims: list[int] | None = None  # a network's factor dimensions, measured in addition
    model_name: str | None = None
    message_sizes: list[int] | None = None
    damping: float = 1e-3
    eigen: bool = True  # also time torch.linalg.eigh at the same dimensions (compute_method='eigen')
    batched: bool = True  # also time batched decompositions (grouped convolutions' block-diagonal factors)

    def dims(self) -> list[int]:
        base = self.inverse_dims or (QUICK_DIMS if self.quick else FULL_DIMS)
        return sorted(set(base) | set(self.model_dims or []))

    def sizes(self) -> list[int]:
        return self.message_sizes or (QUICK_SIZES if self.quick else FULL_SIZES)

    def batched_points(self) -> list[tuple[int, int]]:
        return (QUICK_BATCHED if self.quick else FULL_BATCHED) if self.batched else []


class _Progress:
    """Progress on rank 0 (stderr): a redrawn bar on a terminal, one line per step otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.1f}s {label}"
        if self.tty:
            sys.stderr.write(f"\r{line:<80}" + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], repeats: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """(median, mean) seconds of ``fn`` over ``repeats`` individually timed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)), float(np.mean(samples))


def _mean_over_ranks(engine: CommBackend, values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    engine.allreduce_async(t, "perfmodels.mean").wait()
    return t.tolist()


def _repeats_for(cfg: BenchmarkConfig, elements: int) -> int:
    # Fewer repeats for big messages/matrices so --quick stays quick.
    if not cfg.quick:
        return cfg.repeats
    return max(3, min(cfg.repeats, int(2e7 // max(elements, 1))))


def run_benchmark(cfg: BenchmarkConfig, engine: CommBackend | None = None) -> PerfModel:
    """Measure, fit and return a :class:`PerfModel` (identical on every rank)."""
    engine = engine or get_backend("auto")
    device = torch.device(
        "cuda" if (cfg.device == "auto" and torch.cuda.is_available()) else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    dtype = getattr(torch, cfg.dtype)
    sizes, dims = cfg.sizes(), cfg.dims()
    root = engine.rank == 0
    comm_points = len(sizes) + len(dims) if engine.size > 1 else 0
    n_methods = 3 if cfg.eigen else 1
    progress = _Progress(comm_points + (len(dims) + len(cfg.batched_points())) * n_methods, root)

    ar_times: list[float] = []
    bc_times: list[float] = []
    means: dict[str, list[float]] = {"allreduce": [], "broadcast": [], "inverse": [], "eigen": [], "eigen_warm": []}
    if engine.size > 1:
        for m in sizes:
            buf = torch.ones(m, dtype=dtype, device=device)
            reps = _repeats_for(cfg, m)
            engine.barrier()
            med, mean = _time(lambda: engine.allreduce_async(buf, f"perfmodels.ar.{m}").wait(), reps, min(cfg.warmup, reps), device)  # noqa: B023 timed within this iteration
            ar_times.append(med)
            means["allreduce"].append(mean)
            progress.step(f"all-reduce {m} elements")
        for d in dims:
            buf = torch.ones(triangle_size(d), dtype=dtype, device=device)
            reps = _repeats_for(cfg, triangle_size(d))
            engine.barrier()
            med, mean = _time(lambda: engine.broadcast_async(buf, 0, f"perfmodels.bc.{d}").wait(), reps, min(cfg.warmup, reps), device)  # noqa: B023 timed within this iteration
            bc_times.append(med)
            means["broadcast"].append(mean)
            progress.step(f"broadcast d={d}")
        ar_times = _mean_over_ranks(engine, ar_times)
        bc_times = _mean_over_ranks(engine, bc_times)
        means["allreduce"] = _mean_over_ranks(engine, means["allreduce"])
        means["broadcast"] = _mean_over_ranks(engine, means["broadcast"])

    # Each curve: (factor) -> the timed call (anything it needs first, e.g. a previous basis, made outside the timing).
    curves: dict[str, Callable[[torch.Tensor], Callable[[], Any]]] = {"inverse": lambda spd: lambda: invert_spd(spd, cfg.damping)}
    if cfg.eigen:
        curves["eigen"] = lambda spd: lambda: eigen_payload(spd)  # eigh and the [Q, d] buffer, as the stage runs it
        curves["eigen_warm"] = warm_refresh_call  # eigen_refresh='warm': the shipped warm step from a nearby basis
    times: dict[str, list[float]] = {name: [] for name in curves}
    for name, prepare in curves.items():
        gen = torch.Generator(device="cpu").manual_seed(0)
        for d in dims:
            x = torch.randn(d, d, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
            spd = x @ x.T / d
            reps = _repeats_for(cfg, d**3 // 64)
            med, mean = _time(prepare(spd), reps, min(cfg.warmup, reps), device)
            times[name].append(med)
            means[name].append(mean)
            progress.step(f"{name} d={d}")
        if engine.size > 1:
            times[name] = _mean_over_ranks(engine, times[name])
            means[name] = _mean_over_ranks(engine, means[name])
    inv_times = times["inverse"]

    quality: dict[str, Any] = {}
    if engine.size > 1:
        a_ar, b_ar = fit_linear(sizes, ar_times)
        tri = [triangle_size(d) for d in dims]
        a_bc, b_bc = fit_linear(tri, bc_times)
        ar_model, bc_model = AllReduceModel(a_ar, b_ar), BroadcastModel(a_bc, b_bc)
        quality["allreduce"] = {
            "r2": r_squared(ar_times, [ar_model(m) for m in sizes]),
            "max_rel_error": _max_rel(ar_times, [ar_model(m) for m in sizes]),
        }
        quality["broadcast"] = {
            "r2": r_squared(bc_times, [bc_model.fitted(d) for d in dims]),
            "max_rel_error": _max_rel(bc_times, [bc_model.fitted(d) for d in dims]),
        }
    else:
        ar_model, bc_model = PerfModel.default().allreduce, PerfModel.default().broadcast
        quality["note"] = "single worker: communication models are the built-in defaults (nothing to measure)"
    inv_model, inv_quality = fit_inverse_model(dims, inv_times)
    inv_model = InverseModel(inv_model.kind, inv_model.params, dict(zip(dims, inv_times)))
    if engine.size > 1:
        bc_model = BroadcastModel(bc_model.alpha, bc_model.beta, dict(zip(dims, bc_times)))
    quality["inverse"] = inv_quality
    quality["inverse"]["max_rel_error"] = _max_rel(inv_times, [inv_model.fitted(d) for d in dims])
    eig_model = warm_model = None
    if cfg.eigen:
        eig_model, quality["eigen"] = fit_inverse_model(dims, times["eigen"])
        eig_model = InverseModel(eig_model.kind, eig_model.params, dict(zip(dims, times["eigen"])), name="eigen")
        quality["eigen"]["max_rel_error"] = _max_rel(times["eigen"], [eig_model.fitted(d) for d in dims])
        warm_model, quality["eigen_warm"] = fit_inverse_model(dims, times["eigen_warm"])
        warm_model = InverseModel(warm_model.kind, warm_model.params, dict(zip(dims, times["eigen_warm"])), name="eigen_warm")
        quality["eigen_warm"]["max_rel_error"] = _max_rel(times["eigen_warm"], [warm_model.fitted(d) for d in dims])

    meta = {
        "engine": engine.name,
        "world_size": engine.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "dtype": cfg.dtype,
        "torch": torch.__version__,
        "horovod": _version("horovod"),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
        "quick": cfg.quick,
        "model_dims_from": cfg.model_name,
    }
    batched = _measure_batched({"inverse": inv_model, "eigen": eig_model}, cfg, device, dtype, engine, progress, quality)

    measurements = {
        "allreduce": {"elements": sizes, "seconds": ar_times, "mean_seconds": means["allreduce"]} if ar_times else {},
        "broadcast": {"dims": dims, "seconds": bc_times, "mean_seconds": means["broadcast"]} if bc_times else {},
        "inverse": {"dims": dims, "seconds": inv_times, "mean_seconds": means["inverse"]},
    }
    if cfg.eigen:
        measurements["eigen"] = {"dims": dims, "seconds": times["eigen"], "mean_seconds": means["eigen"]}
        measurements["eigen_warm"] = {"dims": dims, "seconds": times["eigen_warm"], "mean_seconds": means["eigen_warm"]}
    return PerfModel(
        ar_model,
        bc_model,
        inv_model,
        meta=meta,
        measurements=measurements,
        fit_quality=quality,
        source="benchmark",
        eigen=eig_model,
        eigen_warm=warm_model,
        batched=batched,
    )


def _measure_batched(
    curves: dict[str, InverseModel | None],
    cfg: BenchmarkConfig,
    device: torch.device,
    dtype: torch.dtype,
    engine: CommBackend,
    progress: _Progress,
    quality: dict[str, Any],
) -> dict[str, BatchedModel]:
    """Time and fit the batched decompositions of every method with a curve; their fit quality goes into ``quality``."""
    batched: dict[str, BatchedModel] = {}
    for name, curve in curves.items():
        if curve is None or not cfg.batched_points():
            continue
        points = cfg.batched_points()
        seconds = _time_batched(name, points, cfg, device, dtype, engine, progress)
        (call, c0, c1, c2, c3), worst = fit_batched(points, seconds)
        batched[name] = BatchedModel(call, c0, c3, dict(zip(points, seconds)), c1=c1, c2=c2)
        quality[f"batched_{name}"] = {
            "max_rel_error": worst,
            "rule_max_rel_error": _max_rel(seconds, [BatchedModel.rule(curve, b, d) for b, d in points]),
        }
    return batched


def add_batched(model: PerfModel, cfg: BenchmarkConfig, engine: CommBackend | None = None) -> PerfModel:
    """``model`` with its batched decompositions (re)measured here, everything else kept.

    For model files fitted before batched measurements existed: without
    them a grouped convolution's factor is costed by
    :meth:`BatchedModel.rule`, which the single-matrix curves (fitted at
    ``d >= 64`` and floored) make far too cheap at depthwise sizes.
    """
    engine = engine or get_backend("auto")
    device = torch.device(
        "cuda" if (cfg.device == "auto" and torch.cuda.is_available()) else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    curves = {"inverse": model.inverse, "eigen": model.eigen}
    progress = _Progress(len(cfg.batched_points()) * sum(c is not None for c in curves.values()), engine.rank == 0)
    quality = dict(model.fit_quality)
    batched = _measure_batched(curves, cfg, device, getattr(torch, cfg.dtype), engine, progress, quality)
    meta = dict(model.meta)
    meta["batched_measured"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "torch_threads": torch.get_num_threads(),
        "world_size": engine.size,
    }
    return dataclasses.replace(model, meta=meta, fit_quality=quality, batched=batched)


def _time_batched(
    method: str,
    points: Sequence[tuple[int, int]],
    cfg: BenchmarkConfig,
    device: torch.device,
    dtype: torch.dtype,
    engine: CommBackend,
    progress: _Progress,
) -> list[float]:
    """Median seconds of one batched decomposition (as the decomposition stage runs it) at each ``(blocks, d)``."""
    decomposer = get_method(method)
    gen = torch.Generator(device="cpu").manual_seed(1)
    seconds = []
    for blocks, d in points:
        x = torch.randn(blocks, d, d + 3, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        spd = x @ x.transpose(1, 2) / (d + 3)
        shape = FactorShape(d, blocks)
        reps = _repeats_for(cfg, blocks * d**3 // 64)

        def run(shape: FactorShape = shape, spd: torch.Tensor = spd) -> None:
            decomposer.owned(shape, spd, cfg.damping)

        med, _ = _time(run, reps, min(cfg.warmup, reps), device)
        seconds.append(med)
        progress.step(f"{method} batched {blocks}x{d}")
    return _mean_over_ranks(engine, seconds) if engine.size > 1 else seconds


def warm_refresh_call(spd: torch.Tensor) -> Callable[[], Any]:
    """The warm refresh of ``spd`` from the basis of a nearby factor (as after one running-average step)."""
    nearby = 0.95 * spd + 0.05 * torch.diag(spd.diagonal())
    basis = descending_eigh(nearby)[1]
    refresh = WarmRefresh(tolerance=float("inf"))  # always the warm step, never the fallback eigh
    return lambda: refresh.refine(spd, basis)


def _max_rel(measured: Sequence[float], predicted: Sequence[float]) -> float:
    m = np.asarray(measured, dtype=float)
    p = np.asarray(predicted, dtype=float)
    return float(np.max(np.abs(p - m) / m))


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:
        return None
