"""The GPU path checked and timed in one command that fits a short loan of one GPU.

    bash scripts/gpu_check.sh --out $OUT/gpu_check.json      # one H100/H200: under 8 minutes
    bash scripts/gpu_check.sh --device cpu --quick           # the script itself, on a CPU

Stages, each written to the JSON as soon as it ends (a stage that fails or
runs out of its time is recorded with its error, and the next one runs):

1. ``tests``: the ``gpu`` tests (tests/test_gpu.py): the K-FAC step on the
   device against the float64 CPU reference for every compute method, cupy
   against ``torch.linalg``, bf16 autocast, the fp16 GradScaler, checkpoints
   moved between CPU and device, and 2 torchrun processes sharing the device
   (gloo over its tensors) against one process, bitwise replicas.
2. ``decompositions``: every factor dimension of the model, inverted by
   cuSOLVER through cupy and by ``torch.linalg``, and eigendecomposed by both;
   the totals of one decomposition stage of the whole model.
3. ``timing``: iteration times, interleaved, on one device: the model at
   224x224 under bf16 autocast and channels-last, SGD and AdamW (torch's own,
   what a user has), and the K-FAC configurations, every step and amortised
   (factors every 10, decompositions every 100, a window holding one
   decomposition step), each as a ratio to SGD's time; then the every-step
   configurations' phases from the optimizer's timeline (a separate,
   synchronised run). Later batch sizes repeat SGD and amortised K-FAC. Then
   ViT-S/16 at the first batch size (a transformer, whose usual optimizer is
   AdamW): SGD, AdamW, and amortised K-FAC on an SGD and on an AdamW base.
4. ``perfmodel``: ``python -m spdkfac.perfmodels benchmark`` on the device:
   the decomposition curves placement and ``grad_worker_fraction='auto'``
   plan with (one device: no communication curves).
5. ``simulate``: a per-layer profile taken on the device
   (``python -m spdkfac.simulate profile --device``) and the simulator's
   prediction for 8-64 such GPUs from it, with the device's decomposition
   curves and an assumed cluster network (100 Gb/s InfiniBand, as
   benchmarks/kaisa_fraction.py assumes): one GPU has no network to measure.
6. ``compiled``: the model under ``torch.compile`` (inductor), at the first
   batch size: eager SGD and amortised K-FAC, compiled SGD and compiled
   amortised K-FAC, interleaved (compiled K-FAC relative to compiled SGD,
   compiled SGD to eager SGD), with Dynamo's graph and graph-break counts
   (K-FAC's hooks are meant to stay in one graph).

Data are synthetic (fixed random images), as in the iteration-time
benchmark: the time per iteration does not depend on the values.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from spdkfac import make_optimizer
from spdkfac.kfac.layers import factor_list, kfac_layers
from spdkfac.kfac.linalg import cupy_available, invert_spd
from spdkfac.models import get_model
from spdkfac.runtime.output_path import output_file
from spdkfac.step.timeline import Timeline

from .common import RESULTS, ratio_interval, stats

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "sgd"
STAGES = ("tests", "decompositions", "timing", "perfmodel", "simulate", "compiled")
PHASES = ("forward+backward", "factors", "decompositions", "preconditioning", "update", "other")


@dataclass
class Setting:
    """How big the check is: the full one for a GPU, a quick one that proves the script on a CPU."""

    model: str = "resnet50"
    resolution: int = 224
    batch_sizes: tuple[int, ...] = (64, 256)
    #: Past the one-time start: cuDNN's autotuning, the first decompositions, and the fusion plan's profiled factor
    #: steps (KFACConfig.profile_steps = 3 after one warm-up: steps 0-30 here), which wait for the GPU at each factor.
    warmup: int = 31
    amortised_iters: int = 100  # steps warmup .. warmup+99: one decomposition step (100) and ten factor steps
    every_step_warmup: int = 4  # (every step a factor step: steps 0-3 are the profiled ones)
    every_step_iters: int = 10  # the warm refresh's full eigh every 10: one in the window
    phase_iters: int = 3
    decomposition_repeats: int = 5
    profile_batch: int = 64
    workers: tuple[int, ...] = (8, 16, 32, 64)
    #: Whether ``model`` is timed (off: only the further models, ``--other-models-only``).
    main_model: bool = True
    #: Further models timed at the first batch size, amortised configurations only: (zoo name, resolution).
    other_models: tuple[tuple[str, int], ...] = (("vit_s16", 224),)
    #: torch.compile's backend for the ``compiled`` stage (the quick check proves the stage without inductor's compiles).
    compile_backend: str = "inductor"
    budget_s: dict[str, float] = field(
        default_factory=lambda: {"tests": 180, "decompositions": 25, "timing": 270, "perfmodel": 35, "simulate": 60, "compiled": 150}
    )


QUICK = Setting(
    model="cifar_resnet20",
    resolution=32,
    batch_sizes=(8, 16),
    warmup=2,
    amortised_iters=4,
    every_step_warmup=1,
    every_step_iters=2,
    phase_iters=2,
    decomposition_repeats=2,
    profile_batch=8,
    workers=(8, 16),
    other_models=(("vit_s16_32", 32),),
    # (A busy CI machine: generous, so that no iteration is cut and the test of the script sees every one.)
    compile_backend="aot_eager",
    budget_s={"tests": 600, "decompositions": 300, "timing": 1800, "perfmodel": 300, "simulate": 300, "compiled": 600},
)

#: name -> (spdkfac variant or torch optimizer, options, every step?)
CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "sgd": ("torch.sgd", {}, False),
    "adamw": ("torch.adamw", {}, False),
    "spdkfac-sgd": ("sgd", {}, False),  # the optimizer with K-FAC off: its own gradient path, no preconditioning
    "kfac-inverse-amortised": ("spdkfac", dict(factor_update_freq=10, inv_update_freq=100), False),
    "kfac-eigen-amortised": ("spdkfac", dict(compute_method="eigen", factor_update_freq=10, inv_update_freq=100), False),
    "kfac-inverse": ("spdkfac", {}, True),
    "kfac-eigen": ("spdkfac", dict(compute_method="eigen"), True),
    "kfac-eigen-warm": ("spdkfac", dict(compute_method="eigen", eigen_refresh="warm"), True),
    # With TF32 float32 products (torch.backends.cuda.matmul.allow_tf32, as timm's training script sets): K-FAC's
    # float32 preconditioning products follow the user's setting; these rows are relative to SGD's under it.
    "sgd-tf32": ("torch.sgd", dict(tf32=True), False),
    "kfac-inverse-amortised-tf32": ("spdkfac", dict(factor_update_freq=10, inv_update_freq=100, tf32=True), False),
}
#: What later batch sizes repeat (the largest batch costs the most memory and time).
LARGE_BATCH_CONFIGS = ("sgd", "spdkfac-sgd", "kfac-inverse-amortised", "sgd-tf32", "kfac-inverse-amortised-tf32")
#: What the other models (a transformer: AdamW is its usual optimizer) time, amortised.
OTHER_MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "sgd": CONFIGS["sgd"],
    "adamw": CONFIGS["adamw"],
    "kfac-inverse-amortised": CONFIGS["kfac-inverse-amortised"],
    "kfac-adamw-amortised": ("spdkfac", dict(base="adamw", factor_update_freq=10, inv_update_freq=100), False),
    "spdkfac-sgd": CONFIGS["spdkfac-sgd"],  # what the optimizer costs without K-FAC
    # The same layers preconditioned one by one: what stacking same-shape layers saves (spdkfac.step.stacked_preconditioning).
    "kfac-inverse-amortised-per-layer": ("spdkfac", dict(factor_update_freq=10, inv_update_freq=100, per_layer=True), False),
}
#: The ``compiled`` stage: the model under torch.compile; K-FAC's row relative to compiled SGD's, eager SGD beside.
COMPILED_CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "sgd": CONFIGS["sgd"],
    "kfac-inverse-amortised": CONFIGS["kfac-inverse-amortised"],  # eager K-FAC in the same window: what compiling gains
    "sgd-compiled": ("torch.sgd", dict(compiled=True), False),
    "kfac-inverse-amortised-compiled": ("spdkfac", {**CONFIGS["kfac-inverse-amortised"][1], "compiled": True}, False),
}
#: Rows measured under a setting of their own, each relative to SGD's under the same setting (``sgd`` + the suffix).
VARIANT_SUFFIXES = ("-tf32", "-compiled")
HYPER = dict(lr=0.1, momentum=0.9, weight_decay=5e-5)  # ResNet-50's ImageNet setting (Pauloski et al.), damping as default
ADAMW_HYPER = dict(lr=1e-3, weight_decay=0.05)  # torch's AdamW beside it, and K-FAC on an AdamW base


def log(*msg: Any) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}]", *msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict[str, Any]:
    """The card, the software and the date the numbers belong to."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cupy": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        try:
            import cupy

            info["cupy"] = cupy.__version__
        except Exception:
            pass
    else:
        import platform

        info["card"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return info


# --------------------------------------------------------------------------------------------------- 1. tests
def run_tests(device: torch.device, out_dir: Path, budget: float, select: str | None = None) -> dict[str, Any]:
    """The ``gpu`` tests (those ``select`` names, as pytest's ``-k``) in a subprocess on ``device``; each test's
    outcome from pytest's JUnit XML."""
    xml = out_dir / "gpu_tests.xml"
    env = dict(os.environ, SPDKFAC_TEST_DEVICE=str(device), PYTHONPATH=str(ROOT), SPDKFAC_RUN_SLOW="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "tests/test_gpu.py",
        f"--junitxml={xml}",
        "-W",
        "ignore::UserWarning",
    ]
    cmd += ["-k", select] if select else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = ("failed" if tag != "skipped" else "skipped"), (node.get("message") or "")[:400]
        tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    log(f"tests: {counts} in {time.perf_counter() - t0:.0f} s")
    if proc.returncode not in (0, 5):
        print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
    return {"returncode": proc.returncode, "counts": counts, "tests": tests}


# ------------------------------------------------------------------------------------------ 2. decompositions
def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: handles, workspaces, compilation
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cupy_eigh(matrix: torch.Tensor) -> Any:
    import cupy

    with cupy.cuda.ExternalStream(torch.cuda.current_stream(matrix.device).cuda_stream):
        return cupy.linalg.eigh(cupy.from_dlpack(matrix))


def decompositions(setting: Setting, device: torch.device, budget: float) -> dict[str, Any]:
    """Seconds per factor dimension of the model, and per whole decomposition stage, by each backend."""
    dims = [dim for _, dim in factor_list(kfac_layers(get_model(setting.model)))]
    count = {d: dims.count(d) for d in sorted(set(dims))}
    backends: dict[str, Callable[[torch.Tensor], Any]] = {
        "inverse/torch.linalg": lambda m: invert_spd(m, 1e-3, use_cupy=False),
        "eigh/torch.linalg": torch.linalg.eigh,
    }
    if device.type == "cuda" and cupy_available():
        backends["inverse/cupy"] = lambda m: invert_spd(m, 1e-3, use_cupy=True)
        backends["eigh/cupy"] = _cupy_eigh
    deadline = time.perf_counter() + budget
    per_dim: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for d in sorted(count, reverse=True):  # the largest first: they decide the totals
        if time.perf_counter() > deadline:
            break
        a = torch.randn(d, d + 8, generator=gen)
        spd = (a @ a.T / (d + 8)).to(device)
        per_dim[str(d)] = {
            name: _median_seconds(lambda f=f, m=spd: f(m), device, setting.decomposition_repeats) for name, f in backends.items()
        }
    done = [int(d) for d in per_dim]
    totals = {name: sum(count[d] * per_dim[str(d)][name] for d in done) for name in backends}
    log(
        "decompositions, one stage of",
        setting.model,
        {k: f"{v * 1e3:.1f} ms" for k, v in totals.items()},
        f"({len(done)}/{len(count)} dims)",
    )
    return {
        "dims_measured": len(done),
        "dims": len(count),
        "factors": len(dims),
        "count": {str(d): c for d, c in count.items()},
        "per_dim_s": per_dim,
        "stage_s": totals,
    }


# --------------------------------------------------------------------------------------------------- 3. timing
class Run:
    """One configuration's model and optimizer, stepped one iteration at a time so that configurations interleave."""

    def __init__(self, name: str, model_name: str, device: torch.device, channels_last: bool, compile_backend: str = "inductor") -> None:
        kind, options, self.every_step = {**CONFIGS, **OTHER_MODEL_CONFIGS, **COMPILED_CONFIGS}[name]
        self.name = name
        torch.manual_seed(0)
        model = get_model(model_name).to(device)
        model = model.to(memory_format=torch.channels_last) if channels_last else model
        # A compiled model is given to the optimizer as it is (K-FAC's hooks run inside the graph).
        self.model = torch.compile(model, backend=compile_backend) if options.get("compiled") else model
        self.kfac = kind == "spdkfac"
        self.tf32 = bool(options.get("tf32", False))
        self.opt: Any
        if kind == "torch.sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), **HYPER)
        elif kind == "torch.adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW_HYPER)
        else:
            hyper = ADAMW_HYPER if options.get("base") == "adamw" else HYPER
            per_layer = options.get("per_layer", False)
            options = {k: v for k, v in options.items() if k not in ("per_layer", "tf32", "compiled")}
            self.opt = make_optimizer(kind, self.model, backend="single", **hyper, **options)
            if per_layer:
                self.opt.kfac_step.preconditioner.stack_groups = False
        self.seconds: list[float] = []
        self.trace: dict[str, Any] | None = None  # the phase iterations' timeline, drawn (phases())

    def _timed(self, x: torch.Tensor, y: torch.Tensor, wait_after_backward: bool) -> tuple[float, float]:
        """One iteration under bf16 autocast: (its seconds, those of forward + backward; 0 unless waited for)."""
        sync(x.device)
        torch.backends.cuda.matmul.allow_tf32 = self.tf32  # (runs interleave: each sets its own)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        if wait_after_backward:
            sync(x.device)
        t1 = time.perf_counter()
        self.opt.step()
        sync(x.device)
        return time.perf_counter() - t0, (t1 - t0) if wait_after_backward else 0.0

    def iteration(self, x: torch.Tensor, y: torch.Tensor, keep: bool) -> float:
        seconds = self._timed(x, y, wait_after_backward=False)[0]
        if keep:
            self.seconds.append(seconds)
        return seconds

    def phases(self, x: torch.Tensor, y: torch.Tensor, iters: int) -> dict[str, float]:
        """Mean seconds per phase over ``iters`` iterations recorded with the (synchronising) timeline."""
        self.opt.timeline = Timeline()
        totals, fwdbwd = [], []
        for _ in range(iters + 1):  # the first opens the timeline's record
            total, passes = self._timed(x, y, wait_after_backward=True)
            totals.append(total)
            fwdbwd.append(passes)
        recs = self.opt.timeline.iterations[-iters:]
        self.trace = self.opt.timeline.trace()  # (what the phases are read from, drawn: Timeline.trace)
        self.opt.timeline = None
        n = len(recs)
        if n == 0:
            return {}
        mean = statistics.fmean(totals[-n:])
        parts = {
            "factors": sum(r.factor_compute + r.hooks for r in recs) / n,
            "decompositions": sum(r.inverse_stage for r in recs) / n,
            "preconditioning": sum(r.precondition for r in recs) / n,
            "update": sum(r.update for r in recs) / n,
        }
        parts["forward+backward"] = statistics.fmean(fwdbwd[-n:]) - parts["factors"]
        parts["other"] = max(0.0, mean - sum(parts.values()))
        parts["iteration"] = mean
        return parts

    def close(self) -> None:
        if hasattr(self.opt, "remove_hooks"):
            self.opt.remove_hooks()
        del self.opt, self.model


@contextlib.contextmanager
def _interleaved(
    names: list[str],
    model: str,
    device: torch.device,
    x,
    y,
    warmup: int,
    iters: int,
    deadline: float,
    label: str,
    compile_backend: str = "inductor",
) -> Iterator[list[Run]]:
    """The configurations' runs, stepped in turn until ``iters`` are measured or ``deadline``; every run built is
    closed on leaving (out of memory too, so that its hooks and tensors do not outlive the measurement)."""
    runs: list[Run] = []
    tf32 = torch.backends.cuda.matmul.allow_tf32  # each run sets its own; what the caller had is restored on leaving
    try:
        for n in names:
            runs.append(Run(n, model, device, channels_last=device.type == "cuda", compile_backend=compile_backend))
        for it in range(warmup + iters):
            if time.perf_counter() > deadline:
                log(f"{label}: out of time after {it} iterations")
                break
            secs = [r.iteration(x, y, keep=it >= warmup) for r in runs]
            if it in (0, warmup - 1) or (it + 1) % 25 == 0 or it == warmup + iters - 1:
                log(f"{label} iteration {it + 1}/{warmup + iters}: " + ", ".join(f"{r.name} {s * 1e3:.0f} ms" for r, s in zip(runs, secs)))
        yield runs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for r in runs:
            r.close()


def _summary(run: Run, base: Run | None) -> dict[str, Any]:
    row: dict[str, Any] = {"seconds": run.seconds, **dict(stats(run.seconds).items())} if run.seconds else {"seconds": []}
    if base is not None and run is not base and len(run.seconds) >= 2 and len(run.seconds) == len(base.seconds):
        for statistic in ("median", "mean"):
            row[f"vs_sgd_{statistic}"] = stats(run.seconds)[statistic] / stats(base.seconds)[statistic]
            row[f"vs_sgd_{statistic}_95"] = ratio_interval(run.seconds, base.seconds, paired=True, statistic=statistic)
    return row


def _inputs(batch: int, resolution: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random images (channels-last on a GPU) and labels: an iteration's time does not depend on the values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, resolution, resolution, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    return (x.contiguous(memory_format=torch.channels_last) if device.type == "cuda" else x), y


def _summarise(runs: list[Run], rows: dict[str, Any], suffix: Callable[[str], str] = lambda name: "") -> None:
    """Each run's row into ``rows``: ratios to SGD's, the first run's, or for a row of a variant setting (TF32,
    compiled) to SGD's under that setting."""
    by_name = {r.name: r for r in runs}
    for r in runs:
        variant = next((v for v in VARIANT_SUFFIXES if r.name.endswith(v)), None)
        base = by_name.get(f"sgd{variant}", runs[0]) if variant else runs[0]
        rows[r.name + suffix(r.name)] = _summary(r, runs[0] if base is r else base)  # (SGD under a variant: to SGD's)


@contextlib.contextmanager
def _measured(rows: dict[str, Any], device: torch.device, label: str) -> Iterator[None]:
    """Around filling ``rows``: running out of device memory is recorded in ``rows`` (and the check goes on), as is
    the peak memory; the rows are logged."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        rows["error"] = f"out of memory: {str(exc)[:200]}"
        log(f"{label}: out of memory")
    finally:
        if device.type == "cuda":
            rows["cuda_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        for name, row in rows.items():
            if isinstance(row, dict) and "median" in row:
                ratio = f", {row['vs_sgd_median']:.2f}x SGD (median)" if "vs_sgd_median" in row else ""
                log(f"{label} {name:<28} median {row['median'] * 1e3:8.1f} ms, mean {row['mean'] * 1e3:8.1f} ms{ratio}")


def timing(
    setting: Setting, device: torch.device, budget: float, emit: Callable[[dict[str, Any]], None], traces: Path | None = None
) -> dict[str, Any]:
    """Interleaved iteration times per batch size: SGD, AdamW and K-FAC amortised together, then every step with SGD;
    then each other model (a transformer) at the first batch size, amortised, with an AdamW-based K-FAC beside. The
    every-step configurations' phase iterations are also written as traces (Perfetto) into ``traces``."""
    torch.backends.cudnn.benchmark = True
    deadline = time.perf_counter() + budget
    settings = {k: v for k, v in vars(setting).items() if k != "budget_s"}
    result: dict[str, Any] = {"setting": settings, "hyper": HYPER, "adamw_hyper": ADAMW_HYPER, "batches": {}, "models": {}}
    for bi, batch in enumerate(setting.batch_sizes if setting.main_model else ()):
        x, y = _inputs(batch, setting.resolution, device)
        rows: dict[str, Any] = {}
        result["batches"][str(batch)] = rows
        amortised = [n for n, c in CONFIGS.items() if not c[2]] if bi == 0 else list(LARGE_BATCH_CONFIGS)
        label = f"batch {batch}"
        with _measured(rows, device, label):
            with _interleaved(amortised, setting.model, device, x, y, setting.warmup, setting.amortised_iters, deadline, label) as runs:
                _summarise(runs, rows)
            if bi == 0:
                every = ["sgd"] + [n for n, c in CONFIGS.items() if c[2]]
                # At most half of what is left, so that the larger batch and the other models still get their turn.
                share = time.perf_counter() + (deadline - time.perf_counter()) / 2
                iters = (setting.every_step_warmup, setting.every_step_iters)
                with _interleaved(every, setting.model, device, x, y, *iters, share, f"{label} every step") as runs:
                    _summarise(runs, rows, suffix=lambda name: "@every-step-window" if name == "sgd" else "")
                    for r in runs:
                        if r.kfac and time.perf_counter() < share:
                            rows[r.name]["phases_s"] = r.phases(x, y, setting.phase_iters)
                            if traces is not None and r.trace is not None:
                                path = traces / f"trace_{setting.model}_b{batch}_{r.name}.json"
                                path.write_text(json.dumps(r.trace))
                                rows[r.name]["trace_file"] = path.name
        emit(result)
    batch = setting.batch_sizes[0]
    for model, resolution in setting.other_models:
        x, y = _inputs(batch, resolution, device)
        rows = {}
        result["models"][model] = {"resolution": resolution, "batches": {str(batch): rows}}
        label = f"{model} batch {batch}"
        with _measured(rows, device, label):
            names = list(OTHER_MODEL_CONFIGS)
            with _interleaved(names, model, device, x, y, setting.warmup, setting.amortised_iters, deadline, label) as runs:
                _summarise(runs, rows)
        emit(result)
    return result


# ------------------------------------------------------------------------------------------------- 6. compiled
def compiled(setting: Setting, device: torch.device, budget: float) -> dict[str, Any]:
    """The model under torch.compile at the first batch size: eager SGD and K-FAC, compiled SGD and K-FAC,
    interleaved (the first iterations compile), with Dynamo's counts of graphs and graph breaks."""
    torch.backends.cudnn.benchmark = True
    torch._dynamo.reset()
    counters.clear()
    batch = setting.batch_sizes[0]
    x, y = _inputs(batch, setting.resolution, device)
    rows: dict[str, Any] = {}
    label = f"compiled batch {batch}"
    deadline = time.perf_counter() + budget
    # Two instances of one class compiled side by side, one with K-FAC's hooks: Dynamo must tell them apart by their
    # hooks (by default it does not guard on hooks, docs/compile.md), else one's graph would serve the other.
    guards = torch._dynamo.config.skip_nnmodule_hook_guards
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    try:
        with _measured(rows, device, label):
            names = list(COMPILED_CONFIGS)
            iters = (setting.warmup, setting.amortised_iters)
            with _interleaved(names, setting.model, device, x, y, *iters, deadline, label, setting.compile_backend) as runs:
                _summarise(runs, rows)
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = guards
    breaks = {str(k): int(v) for k, v in counters["graph_break"].items()}
    log(f"{label}: {counters['stats']['unique_graphs']} graphs, graph breaks {breaks or 'none'}")
    return {
        "model": setting.model,
        "resolution": setting.resolution,  # (the report's heading names it)
        "batch": batch,
        "backend": setting.compile_backend,
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": breaks,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------ 4. perfmodel
def perfmodel(setting: Setting, device: torch.device, out_dir: Path, card: str, budget: float) -> dict[str, Any]:
    """The performance-model benchmark on the device: decomposition curves for the planner."""
    name = "".join(c if c.isalnum() else "-" for c in card.lower()).strip("-")
    path = out_dir / f"perfmodel-{name}.json"
    cmd = [sys.executable, "-m", "spdkfac.perfmodels", "benchmark", "--engine", "single", "--device", str(device)]
    cmd += ["--model", setting.model, "--repeats", "5" if setting is not QUICK else "2", "--warmup", "2", "--out", str(path)]
    if setting is QUICK:
        cmd += ["--quick", "--dims", "16", "64", "--no-batched"]
    else:  # the model's own dimensions are added to these
        cmd += ["--dims", "64", "256", "512", "1024", "2048", "4096"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=budget
    )
    log(f"perfmodel: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s")
    if proc.returncode:
        raise RuntimeError(f"perfmodels benchmark failed: {proc.stderr[-1500:]}")
    return {"file": path.name, "model": json.loads(path.read_text()), "summary": proc.stdout[-3000:]}


# ------------------------------------------------------------------------------------------------- 5. simulate
#: The network of the GPU cluster the prediction assumes (one GPU has none to measure): 100 Gb/s InfiniBand,
#: NCCL-like, as benchmarks/kaisa_fraction.py assumes. Seconds: alpha per collective, beta per float32 element.
ASSUMED_NETWORK = {"allreduce": {"alpha": 5e-5, "beta": 2 * 4 / 12.5e9}, "broadcast": {"alpha": 5e-5, "beta": 4 / 12.5e9}}


def simulate(setting: Setting, device: torch.device, out_dir: Path, perf_file: Path, budget: float) -> dict[str, Any]:
    """A profile on the device, then the simulator's iteration time at ``setting.workers`` such devices."""
    deadline = time.perf_counter() + budget
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    profile = out_dir / "profile.json"
    cmd = [sys.executable, "-m", "spdkfac.simulate", "profile", "--model", setting.model, "--resolution", str(setting.resolution)]
    cmd += [
        "--batch-size",
        str(setting.profile_batch),
        "--device",
        str(device),
        "--threads",
        str(torch.get_num_threads()),
        "--out",
        str(profile),
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
    if proc.returncode:
        raise RuntimeError(f"simulate profile failed: {proc.stderr[-1500:]}")
    model = json.loads(perf_file.read_text())
    model.update(ASSUMED_NETWORK)
    model["meta"] = {**model.get("meta", {}), "note": "decompositions measured on the device; network assumed (100 Gb/s InfiniBand)"}
    cluster = out_dir / "perfmodel-cluster.json"
    cluster.write_text(json.dumps(model, indent=1))
    predictions = out_dir / "prediction.json"
    cmd = [sys.executable, "-m", "spdkfac.simulate", "predict", "--profile", str(profile), "--perf-model", str(cluster)]
    cmd += ["--workers", *map(str, setting.workers), "--update-freq", "10", "100", "--json", str(predictions)]
    cmd += ["--variants", "sgd", "dkfac", "mpdkfac", "spdkfac"]
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, deadline - time.perf_counter())
    )
    if proc.returncode:
        raise RuntimeError(f"simulate predict failed: {proc.stderr[-1500:]}")
    log("simulated (factors every 10, decompositions every 100):\n" + proc.stdout[-2500:])
    result = json.loads(predictions.read_text())["predictions"]
    return {"batch": setting.profile_batch, "update_freq": [10, 100], "network": ASSUMED_NETWORK, "predictions": result}


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (to test this script)")
    ap.add_argument("--quick", action="store_true", help="a small model and few iterations: proves the script, measures nothing")
    ap.add_argument("--out", default=str(RESULTS / "gpu_check.json"), type=output_file(make_parents=True))
    ap.add_argument("--tests-k", default=None, help="only the gpu tests this pytest -k expression selects")
    ap.add_argument(
        "--stages",
        nargs="+",
        default=list(STAGES),
        choices=list(STAGES),
    )
    ap.add_argument("--other-models-only", action="store_true", help="time only the further models (ViT-S/16), not ResNet-50")
    ap.add_argument("--model", default=None, help="the zoo model the timing and compiled stages time (default: resnet50)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (use --device cpu --quick to test the script)")
    setting = QUICK if args.quick else Setting()
    if args.other_models_only:
        setting = dataclasses.replace(setting, main_model=False)
    if args.model:
        setting = dataclasses.replace(setting, model=args.model)
    warnings.filterwarnings("ignore", message="no perf_model given")  # one process: no placement or fusion to plan
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    given = list(sys.argv[1:] if argv is None else argv)
    arguments = [a for i, a in enumerate(given) if a != "--out" and not a.startswith("--out=") and (i == 0 or given[i - 1] != "--out")]
    report: dict[str, Any] = {"environment": environment(device), "quick": args.quick, "argv": arguments, "stages": {}}
    log("environment:", json.dumps(report["environment"]))

    def emit(stage: str, value: Any) -> None:
        report["stages"][stage] = value
        out.write_text(json.dumps(report, indent=1))

    started = time.perf_counter()
    for stage in args.stages:
        t0 = time.perf_counter()
        budget = setting.budget_s[stage]
        log(f"stage {stage} (at most {budget:.0f} s)")
        try:
            if stage == "tests":
                value = run_tests(device, out.parent, budget, args.tests_k)
            elif stage == "decompositions":
                value = decompositions(setting, device, budget)
            elif stage == "timing":
                value = timing(setting, device, budget, lambda partial: emit("timing", partial), out.parent)
            elif stage == "compiled":
                value = compiled(setting, device, budget)
            elif stage == "perfmodel":
                value = perfmodel(setting, device, out.parent, report["environment"]["card"], budget)
            else:
                pm = report["stages"].get("perfmodel", {})
                if "file" not in pm:
                    raise RuntimeError("the simulate stage needs the perfmodel stage's curves (run it first)")
                value = simulate(setting, device, out.parent, out.parent / pm["file"], budget)
        except Exception as exc:  # recorded, and the next stage runs: one loan must give every stage its chance
            traceback.print_exc()
            value = {"error": f"{type(exc).__name__}: {exc}"[:2000], **(report["stages"].get(stage) or {})}
        value["stage_seconds"] = time.perf_counter() - t0
        emit(stage, value)
    log(f"done in {time.perf_counter() - started:.0f} s; wrote {out}")
    failed = report["stages"].get("tests", {}).get("counts", {}).get("failed", 0)
    errors = [s for s, v in report["stages"].items() if "error" in v]
    if errors:
        log("stages with errors:", errors)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
