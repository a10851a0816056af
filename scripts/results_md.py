"""Generate benchmarks/RESULTS.md from the result JSON files the benchmarks write.

    python scripts/results_md.py [--results benchmarks/results] [--out benchmarks/RESULTS.md]

One table per claim, each with the command that produced it (as recorded in
the JSON, or rebuilt from the arguments the JSON records, or else the
benchmark's documented command) and the machine it ran on (from the JSON's
``machine`` record, or "not recorded"). Result files that are absent are
skipped with a note; a file that is not valid JSON, or lacks what its
benchmark always writes, stops the script with an error naming the file.
The output depends only on the input files, so regenerating it after an
unchanged set of results gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")
LABELS = {
    "sgd": "SGD",
    "dkfac": "D-KFAC",
    "mpdkfac": "MPD-KFAC",
    "spdkfac": "**SPD-KFAC**",
    "-pipe-lbp": "−Pipe−LBP",
    "+pipe-lbp": "+Pipe−LBP",
    "-pipe+lbp": "−Pipe+LBP",
    "+pipe+lbp": "+Pipe+LBP",
    "spdkfac-dp": "SPD-KFAC + dist. precond.",
}
PLACEMENT_LABELS = {"lbp": "LBP (SPD-KFAC)", "seq": "Seq-Dist (MPD-KFAC)", "local": "Non-Dist (D-KFAC)"}
#: Recorded arguments that are derived by the benchmark, not given on its command line.
DERIVED_ARGS = {"grids"}


class ResultsError(Exception):
    """A result file that cannot be read or lacks what its benchmark writes (the message names the file)."""


def load(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ResultsError` naming the file when it is malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def need(data: dict[str, Any], path: Path, *keys: str) -> None:
    """Raise :class:`ResultsError` naming ``path`` unless ``data`` has every key in ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise ResultsError(f"{path}: missing {', '.join(repr(k) for k in missing)} (not a file this benchmark writes?)")


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds ('–' when not recorded)."""
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


def ratio(value: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """A ratio as ``1.23x``, with its 95% interval when recorded."""
    if value is None:
        return ""
    text = f"{value:.2f}x"
    return f"{text} ({lo:.2f}–{hi:.2f})" if lo is not None and hi is not None else text


def machine_line(data: dict[str, Any]) -> str:
    """What the numbers were measured on, from the JSON's ``machine`` record."""
    m = data.get("machine")
    if not isinstance(m, dict):
        return "not recorded"
    bits = [str(m.get("cpu", "?")), f"{m.get('cores', '?')} cores"]
    bits.append(f"GPU {m['cuda']}" if m.get("cuda") else "no GPU")
    bits.append(f"torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} thread(s) per worker")
    bits.append(f"Python {m.get('python', '?')}")
    workers = data.get("world_size", data.get("workers"))
    if workers is not None:
        bits.append(f"{workers} worker(s) via {data.get('engine', '?')}")
    if m.get("horovod_cycle_time_ms"):
        bits.append(f"HOROVOD_CYCLE_TIME={m['horovod_cycle_time_ms']}")
    if m.get("bound_cores"):
        bits.append("workers bound to cores")
    return "; ".join(bits)


def launcher(data: dict[str, Any], module: str) -> str:
    """The launch prefix for ``python -m module`` under the engine and worker count the JSON records."""
    engine, n = data.get("engine"), data.get("world_size", data.get("workers"))
    if engine == "horovod" and n:
        return f"horovodrun -np {n} -H localhost:{n} --gloo .venv/bin/python -m {module}"
    if engine == "torch" and n:
        return f"torchrun --nproc_per_node {n} -m {module}"
    return f".venv/bin/python -m {module}"


def rebuilt_command(data: dict[str, Any], module: str, out: str | None = None) -> str:
    """The benchmark's command line rebuilt from the ``args`` the JSON records (``--out`` replaced by ``out``)."""
    words = [launcher(data, module)]
    for key, value in data["args"].items():
        if key in DERIVED_ARGS or key == "out" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words.append(" ".join([flag, *map(str, value)]))
        else:
            words.append(f"{flag} {value}")
    if out is not None:
        words.append(f"--out {out}")
    return " ".join(words)


def recorded_command(data: dict[str, Any], module: str) -> str:
    """The JSON's ``command``; an ``ENGINE xN: python -m ...`` record is written with its launcher."""
    cmd: str = data["command"]
    match = re.fullmatch(rf"(\w+) x(\d+): python -m {re.escape(module)}(.*)", cmd)
    if match:
        engine, n, rest = match.groups()
        return launcher({"engine": engine, "world_size": int(n)}, module) + rest
    return cmd


def command_block(data: dict[str, Any], module: str, documented: str, out: str | None = None) -> list[str]:
    """Markdown lines giving the command and the machine of one result."""
    if isinstance(data.get("command"), str):
        how, cmd = "as recorded", recorded_command(data, module)
    elif isinstance(data.get("args"), dict):
        how, cmd = "rebuilt from the arguments recorded in the JSON", rebuilt_command(data, module, out)
    else:
        how, cmd = "not recorded; the benchmark's documented command", documented
    return [f"Command ({how}):", "", "```bash", cmd, "```", "", f"Machine: {machine_line(data)}.", ""]


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


class Writer:
    """Collects the sections; knows where the results and the output file lie, for paths and links."""

    def __init__(self, results: Path, out: Path, label: str) -> None:
        self.results, self.out, self.label = results, out, label
        self.lines: list[str] = []
        self.skipped: list[str] = []

    def shown(self, rel: str) -> str:
        """A results-relative path as the reader should type it."""
        return f"{self.label}/{rel}"

    def link(self, rel: str, text: str) -> list[str]:
        """Markdown lines showing a plot next to the results (none when the file does not exist)."""
        target = self.results / rel
        if not target.is_file():
            return []
        href = Path(os.path.relpath(target, self.out.parent)).as_posix()
        return [f"![{text}]({href})", ""]

    def section(self, rel: str, title: str, render: Callable[[Path, dict[str, Any]], list[str]], plot: str | None = None) -> None:
        """One claim's section from ``results/rel`` (and its plot), or a note that the file is absent."""
        path = self.results / rel
        self.lines += [f"## {title}", ""]
        if not path.is_file():
            self.skipped.append(rel)
            self.lines += [f"_No `{self.shown(rel)}`: section skipped._", ""]
            return
        self.lines += render(path, load(path))
        if plot is not None:
            self.lines += self.link(plot, title)


def gpu_check(path: Path, d: dict[str, Any]) -> list[str]:
    """One GPU check (benchmarks/gpu_check.py): the card, the gpu tests, iteration times against SGD, phases, decompositions."""
    need(d, path, "environment", "stages")
    env, stages = d["environment"], d["stages"]
    lines = [
        f"{env.get('card', '?')} ({env.get('memory_gib', '?')} GiB), torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"cupy {env.get('cupy') or 'absent'}, Python {env.get('python')}; {env.get('date')}"
        + (" — `--quick`: proves the script, measures nothing" if d.get("quick") else "")
        + ". Command: `bash scripts/gpu_check.sh` (benchmarks/gpu_check.py).",
        "",
    ]
    for stage, value in stages.items():
        if "error" in value:
            lines += [f"- stage `{stage}` stopped: `{str(value['error']).splitlines()[0][:300]}`", ""]
    tests = stages.get("tests")
    if tests and "counts" in tests:
        c = tests["counts"]
        lines += [f"**gpu tests** (tests/test_gpu.py on the card): {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped.", ""]
        bad = [t for t in tests["tests"] if t["outcome"] != "passed"]
        if bad:
            lines += table(["test", "outcome", "message"], [[t["name"], t["outcome"], t["message"].replace("|", "/")[:160]] for t in bad])
    timing = stages.get("timing")
    for batch, rows in (timing or {}).get("batches", {}).items():
        st = timing["setting"]
        lines += [
            f"**Iteration time**, {st['model']} {st['resolution']}x{st['resolution']}, batch {batch}, bf16 autocast, channels-last, "
            f"one process; interleaved; ratio to SGD's median with its 95% interval (peak memory {rows.get('cuda_peak_gib', 0):.1f} GiB):",
            "",
        ]
        body = []
        for name, row in rows.items():
            if not isinstance(row, dict) or "median" not in row:
                continue
            body.append(
                [
                    name,
                    str(row["n"]),
                    ms(row["median"]),
                    ms(row["mean"]),
                    ratio(row.get("vs_sgd_median"), *(row.get("vs_sgd_median_95") or (None, None))),
                    ratio(row.get("vs_sgd_mean")),
                ]
            )
        lines += table(["configuration", "iterations", "median ms", "mean ms", "x SGD (median)", "x SGD (mean)"], body)
        phased = {n: r["phases_s"] for n, r in rows.items() if isinstance(r, dict) and r.get("phases_s")}
        if phased:
            phases = ["forward+backward", "factors", "decompositions", "preconditioning", "update", "other"]
            lines += ["Every-step K-FAC per phase (ms; a separate run with the timeline, which waits for the GPU at each phase):", ""]
            lines += table(
                ["configuration", *phases, "iteration"],
                [[n, *(ms(p.get(k)) for k in phases), ms(p.get("iteration"))] for n, p in phased.items()],
            )
        if "error" in rows:
            lines += [f"Batch {batch}: {rows['error']}", ""]
    dec = stages.get("decompositions")
    if dec and "stage_s" in dec:
        names = sorted(dec["stage_s"])
        lines += [
            f"**One decomposition stage** of the model ({dec['factors']} factors, {dec['dims_measured']} of {dec['dims']} distinct "
            "dimensions measured, median of repeats), by backend:",
            "",
        ]
        lines += table(["backend", "ms per stage"], [[n, ms(dec["stage_s"][n])] for n in names])
        largest = sorted(dec["per_dim_s"], key=int, reverse=True)[:4]
        lines += table(["dimension", *names], [[dim, *(f"{dec['per_dim_s'][dim][n] * 1e3:.1f}" for n in names)] for dim in largest])
    pm = stages.get("perfmodel")
    if pm and "file" in pm:
        lines += [f"Decomposition curves for planning: `{pm['file']}` (copied to `perfmodels/`).", ""]
    sim = stages.get("simulate")
    if sim and "predictions" in sim:
        preds = sim["predictions"]
        workers = sorted({int(k.split(":")[0]) for k in preds})
        variants = list(dict.fromkeys(k.split(":", 1)[1] for k in preds))
        lines += [
            f"**Predicted** by the simulator from a profile taken on the card (batch {sim['batch']} per GPU, fp32), its "
            "decomposition curves and an assumed 100 Gb/s InfiniBand network; factors every 10, decompositions every "
            "100; ms per iteration (x SGD's):",
            "",
        ]
        body = []
        for v in variants:
            row = [v]
            for w in workers:
                it, sgd = preds[f"{w}:{v}"]["iteration"], preds.get(f"{w}:sgd", {}).get("iteration")
                row.append(f"{it * 1e3:.0f}" + (f" ({it / sgd:.2f}x)" if sgd and v != "sgd" else ""))
            body.append(row)
        lines += table(["variant", *(f"{w} GPUs" for w in workers)], body)
    return lines


def model_stats(path: Path, d: dict[str, Any]) -> list[str]:
    """Table II: factor statistics per model, and the arithmetic floor of the amortised setting."""
    need(d, path, "models")
    rows = []
    for name, st in d["models"].items():
        need(st, path, "params", "layers", "a_elems", "g_elems")
        ar = st.get("arithmetic") or {}
        same = st.get("matches_paper")
        rows.append(
            [
                name,
                f"{st['params'] / 1e6:.1f}",
                str(st["layers"]),
                f"{st['a_elems'] / 1e6:.1f}",
                f"{st['g_elems'] / 1e6:.1f}",
                str(st.get("max_dim", "")),
                ""
                if not isinstance(same, dict)
                else ("yes" if all(same.values()) else "differs: " + ", ".join(k for k, v in same.items() if not v)),
                f"{ar['floor']:.2f}x" if "floor" in ar else "",
                f"{ar['floor_distributed_preconditioning']:.2f}x" if "floor_distributed_preconditioning" in ar else "",
            ]
        )
    first = next(iter(d["models"].values()), {}).get("arithmetic") or {}
    lines = [
        "Parameters and upper-triangle factor elements in millions. Floor: the lowest amortised K-FAC/SGD "
        "iteration-time ratio the arithmetic allows at one FLOP rate"
        + (
            f" ({first.get('resolution')}×{first.get('resolution')}, batch {first.get('batch_size')}, factors every "
            f"{first.get('factor_every')} iterations; distributed preconditioning over {first.get('workers')} workers)"
            if first
            else ""
        )
        + ".",
        "",
    ]
    lines += table(
        [
            "model",
            "params",
            "preconditioned layers",
            "A elements",
            "G elements",
            "largest factor",
            "matches the paper",
            "floor",
            "floor, dist. precond.",
        ],
        rows,
    )
    return [
        *lines,
        "Command (the benchmark's documented command):",
        "",
        "```bash",
        "python -m benchmarks.model_stats",
        "```",
        "",
        "Machine: not recorded (counts and arithmetic do not depend on it).",
        "",
    ]


def iteration_time(path: Path, d: dict[str, Any]) -> list[str]:
    """Table III: iteration time, its breakdown, speed-ups and memory per variant."""
    need(d, path, "table")
    a = d.get("args", {})
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch "
        f"{a.get('batch_size', '?')} per worker, factors/inverses every {'/'.join(map(str, a.get('update_freq', ['?'])))} "
        f"iteration(s); {a.get('warmup', '?')} warm-up and {a.get('iters', '?')} measured iterations per variant"
        f"{', interleaved' if a.get('interleave') else ''}. Milliseconds per iteration; SP1 = D-KFAC's time over "
        "the row's, SP2 = MPD-KFAC's (95% bootstrap interval when recorded).",
        "",
    ]
    rows = []
    for r in d["table"]:
        need(r, path, "variant", "mean_s")
        rows.append(
            [
                LABELS.get(r["variant"], r["variant"]),
                f"{ms(r['mean_s'])} ± {ms(r.get('stdev_s'))}",
                *[ms(r.get(p)) for p in PARTS],
                *(
                    ("", "")
                    if r["variant"] == "sgd"
                    # SGD's speed-up over K-FAC says nothing
                    else (ratio(r.get("SP1"), r.get("SP1_lo"), r.get("SP1_hi")), ratio(r.get("SP2"), r.get("SP2_lo"), r.get("SP2_hi")))
                ),
                ratio(r.get("vs_sgd"), r.get("vs_sgd_lo"), r.get("vs_sgd_hi")),
                f"{r['rss_mb']:.0f} MB" if r.get("rss_mb") and math.isfinite(r["rss_mb"]) else "",  # NaN: interleaved
                f"{r['kfac_state_mb']:.1f} MB" if r.get("kfac_state_mb") is not None else "",
            ]
        )
    lines += table(["variant", "iteration", *PARTS, "SP1", "SP2", "vs SGD", "RSS", "K-FAC state"], rows)
    split = [r for r in d["table"] if "factor_steps_s" in r or "other_steps_s" in r]
    if split:
        lines += table(
            ["variant", "factor-update iterations", "other iterations"],
            [
                [
                    LABELS.get(r["variant"], r["variant"]),
                    f"{r['factor_steps_s']:.2f} s (n={r.get('factor_steps_n', '?')})" if "factor_steps_s" in r else "",
                    f"{r['other_steps_s']:.2f} s (n={r.get('other_steps_n', '?')})" if "other_steps_s" in r else "",
                ]
                for r in split
            ],
        )
    lines += command_block(
        d, "benchmarks.iteration_time", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.iteration_time"
    )
    return lines


def paired_ratios(samples: dict[str, list[float]], base: str, variant: str) -> str:
    """Median (min–max) of the unfused over the fused time, iteration by iteration (interleaved runs only)."""
    a, b = samples.get(base), samples.get(variant)
    if not a or not b or len(a) != len(b):
        return ""
    ratios = sorted(x / y for x, y in zip(a, b))
    n = len(ratios)
    median = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return f"{median:.2f}x ({ratios[0]:.2f}–{ratios[-1]:.2f})"


def update_fusion(path: Path, d: dict[str, Any]) -> list[str]:
    """Update fusion: iteration time with the update in step(), in the next forward pass, or in backward."""
    need(d, path, "table")
    a = d.get("args", {})
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} "
        f"per worker, {d.get('world_size', 1)} worker(s), factors/inverses every {'/'.join(map(str, a.get('update_freq', ['?'])))} iteration(s); "
        f"{a.get('warmup', '?')} warm-up and {a.get('iters', '?')} measured iterations per variant and round, "
        f"{a.get('rounds', 1)} round(s){', interleaved' if a.get('interleave') else ''}. Milliseconds per iteration; "
        "speed-up = the unfused time over the row's (throughput gain); per-iteration: median (range) of the "
        "paired ratios of interleaved iterations. With fusion the update runs inside "
        "FF&BP (forward: the next forward pass; backward: the backward pass), so FF&BP grows and Other shrinks.",
        "",
    ]
    rows, base = [], {}
    for r in d["table"]:
        need(r, path, "variant", "mean_s")
        name, _, change = r["variant"].partition(":")
        fusion = change.partition("update_fusion=")[2] or "none"
        if fusion == "none":
            base[name] = r["mean_s"]
        speedup = base[name] / r["mean_s"] if name in base and fusion != "none" else None
        rows.append(
            [
                LABELS.get(name, name),
                fusion,
                f"{ms(r['mean_s'])} ± {ms(r.get('stdev_s'))}",
                ms(r.get("FF&BP")),
                ms(r.get("Other")),
                ratio(speedup),
                paired_ratios(d.get("samples", {}), name, r["variant"]) if fusion != "none" else "",
            ]
        )
    lines += table(["optimizer", "update fusion", "iteration", "FF&BP", "Other", "speed-up", "per-iteration speed-ups"], rows)
    lines += command_block(d, "benchmarks.iteration_time", "python -m benchmarks.iteration_time --model mobilenet_v2_32 --batch-size 32")
    return lines


def update_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """The separate update pass against forward + backward: the most update fusion can save."""
    need(d, path, "model", "fwd_bwd_s", "update_s", "update_share", "parameters", "tensors", "update_gb_per_s")
    a = d.get("args", {})
    lines = [
        f"{d['model']} ({d['parameters'] / 1e6:.2f} M parameters in {d['tensors']} tensors), batch {a.get('batch_size', '?')}; "
        f"medians of {a.get('iters', '?')} interleaved repetitions. The unfused momentum-SGD update (weight decay on) is "
        "the pass that fusion folds into forward or backward: its time bounds the saving.",
        "",
    ]
    lines += table(
        ["forward + backward", "update pass", "update share", "update bandwidth"],
        [[f"{ms(d['fwd_bwd_s'])} ms", f"{d['update_s'] * 1e3:.1f} ms", f"{d['update_share']:.1%}", f"{d['update_gb_per_s']:.1f} GB/s"]],
    )
    lines += command_block(d, "benchmarks.update_cost", "python -m benchmarks.update_cost --model mobilenet_v2_32 --batch-size 32")
    return lines


def update_fusion_model(path: Path, d: dict[str, Any]) -> list[str]:
    """The update-fusion cost model: its CPU prediction beside the measurements, then its V100-class GPU prediction."""
    need(d, path, "cpu_device", "cpu", "gpu_device", "gpu")
    c, g = d["cpu_device"], d["gpu_device"]

    def gain(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}x"

    lines = [
        "`spdkfac/simulate/update_fusion_cost.py`: each kernel of a step (counted on meta tensors) takes "
        "max(FLOPs / rate, bytes / bandwidth) on the device; one host thread spends a launch time per kernel; the "
        "update's kernels move into the next forward pass or into backward; the one read that follows a write of a "
        "tensor that fits in the cache is saved.",
        "",
        f"**CPU check** (this machine, synchronous: the host runs each kernel): {c['bandwidth'] / 1e9:.1f} GB/s and "
        f"{c['launch_s'] * 1e6:.1f} µs per kernel (the update's own kernels), {c['flop_rate'] / 1e9:.0f} GFLOP/s (a 3×3 "
        f"convolution), {c['cache_bytes'] / 2**20:.0f} MiB cache. 32×32, batch 32, one thread; recipe `spdkfac` (this "
        "optimizer's non-finite checks and, in backward fusion, its rollback copies). Measured speed-ups: SGD rows of "
        "`update_fusion_<model>_w1.json`.",
        "",
    ]
    rows = []
    for r in d["cpu"]:
        m, p, mf = r["measured"], r["predicted"], r.get("measured_fusion") or {}
        rows.append(
            [
                r["model"],
                f"{r['tensors']} / {r['parameters'] / 1e6:.1f} M",
                f"{ms(m['fwd_bwd_s'])} / {ms(p['fwd_bwd_s'])}",
                f"{m['update_s'] * 1e3:.1f} / {p['update_s'] * 1e3:.1f}",
                f"{gain(mf.get('forward'))} / {gain(p['forward'])}",
                f"{gain(mf.get('backward'))} / {gain(p['backward'])}",
            ]
        )
    lines += table(
        ["model", "tensors / parameters", "fwd+bwd ms (measured / model)", "update pass ms", "forward fusion", "backward fusion"],
        rows,
    )
    seed = d.get("seed_reported", {})
    lines += [
        f"**GPU prediction** (V100-class, asynchronous: {g['bandwidth'] / 1e9:.0f} GB/s, {g['flop_rate'] / 1e12:.2f} "
        f"TFLOP/s achieved, {g['cache_bytes'] / 2**20:.0f} MiB L2), 224×224, batch 32, one GPU. Speed-up = unfused "
        "time over fused. `seed`: the update alone, the loop waiting for the device after backward (the seed's "
        "baseline, whose step overlaps nothing); `spdkfac`: this optimizer's checks and copies too; last column: "
        "`seed` with the loop waiting after `step()` instead. The seed reports "
        f"{gain(seed.get('forward'))} (forward) and {gain(seed.get('backward'))} (backward) on MobileNetV2, batch 32.",
        "",
    ]
    rows = []
    for model in d["gpu"]:
        for r in model["rows"]:
            sd, ours, late = r["seed"], r["spdkfac"], r["seed_sync_after_step"]
            rows.append(
                [
                    model["model"],
                    f"{model['tensors']} / {model['parameters'] / 1e6:.1f} M",
                    f"{r['launch_s'] * 1e6:.0f}",
                    f"{sd['none_s'] * 1e3:.1f}",
                    f"{gain(sd['forward'])} / {gain(sd['backward'])}",
                    f"{gain(ours['forward'])} / {gain(ours['backward'])}",
                    f"{gain(late['forward'])} / {gain(late['backward'])}",
                ]
            )
    lines += table(
        ["model", "tensors / parameters", "µs per kernel", "unfused ms", "seed: forward / backward", "spdkfac", "seed, sync after step()"],
        rows,
    )
    return lines + command_block(d, "benchmarks.update_fusion_model", ".venv/bin/python -m benchmarks.update_fusion_model")


def eigenbasis_iteration(path: Path, d: dict[str, Any]) -> list[str]:
    """The eigen method, exact and warm-started, beside the inverse method: time per iteration and its ratios."""
    need(d, path, "table")
    a = d.get("args", {})
    by_variant = {r["variant"]: r for r in d["table"] if "variant" in r and "mean_s" in r}
    exact = next((r for v, r in by_variant.items() if "compute_method=eigen" in v and "eigen_refresh=warm" not in v), None)
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} per "
        f"worker, factors and decompositions every iteration; {a.get('warmup', '?')} warm-up and {a.get('iters', '?')} measured "
        f"iterations per variant{', interleaved' if a.get('interleave') else ''}. `eigen_refresh='warm'` makes a full `eigh` "
        "every `eigen_full_every` refreshes (10 unless the variant says), so a measured window that long holds one. "
        "Exact eigen / row: the speed-up over the exact "
        "eigen method measured in the same run.",
        "",
    ]
    rows = []
    for variant, r in by_variant.items():
        rows.append(
            [
                f"`{variant}`",
                f"{ms(r['mean_s'])} ± {ms(r.get('stdev_s'))}",
                ms(r.get("InverseComp")),
                ms(r.get("InverseComm")),
                ratio(exact["mean_s"] / r["mean_s"]) if exact is not None else "",
            ]
        )
    lines += table(["variant", "iteration", "InverseComp", "InverseComm", "exact eigen / row"], rows)
    lines += command_block(
        d,
        "benchmarks.iteration_time",
        "torchrun --nproc_per_node 2 -m benchmarks.iteration_time --variants spdkfac spdkfac:compute_method=eigen ...",
    )
    return lines


def vs_kaisa(path: Path, d: dict[str, Any]) -> list[str]:
    """This project's eigen (exact, warm) and inverse methods beside KAISA's, measured in one run: seconds and ratios."""
    need(d, path, "table", "args")
    a = d["args"]
    kaisa = d.get("kaisa") or {}
    specs = d.get("specs", {})
    memopt = any(r["system"] == "kaisa-eigen-memopt" for r in d["table"])  # (a column only where it ran)
    bases = [("kaisa-eigen", "median"), ("kaisa-eigen", "mean")] + [("kaisa-eigen-memopt", s) for s in ("median", "mean") if memopt]
    bases.append(("kaisa-inverse", "mean"))
    rows = []
    for r in d["table"]:
        ratios = [ratio(r.get(f"vs_{b}_{s}"), *(r.get(f"vs_{b}_{s}_interval") or (None, None))) for b, s in bases]
        rows.append([f"`{r['system']}`", f"{r['median']:.2f}", f"{r['mean']:.2f}", *ratios])
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} per "
        f"worker, factors every {a['update_freq'][0]} and decompositions every {a['update_freq'][1]} iteration(s), damping "
        f"{a.get('damping')}, factor decay {a.get('factor_decay')}, KL-clip {a.get('kl_clip')} for every system. "
        f"{a.get('rounds', '?')} round(s); in each, every system in turn (the order rotates) is built, warmed up "
        f"({a.get('warmup', '?')} iterations) and measured ({a.get('iters', '?')} iterations). KAISA: `kfac` "
        f"{kaisa.get('version', 'not run')}, `KFACPreconditioner` with `grad_worker_fraction=1` (COMM-OPT; "
        "`kaisa-eigen-memopt`: 1/P, MEM-OPT), the model in `DistributedDataParallel`, its other options at their "
        "defaults. `spdkfac-eigen-warm*`: a full `eigh` every "
        f"{a.get('eigen_full_every', '?')} refreshes, so the mean over a window that long is the amortised cost and the "
        "median is a warm iteration's. Ratios: the row's speed-up over KAISA's eigen (COMM-OPT, MEM-OPT) / inverse method "
        "(95% bootstrap interval); the machine was shared with other jobs, so compare the ratios, not the seconds.",
        "",
    ]
    if d.get("partial"):
        lines += ["_The run was stopped before its end: the systems and rounds measured until then._", ""]
    names = {"kaisa-eigen": "KAISA eigen", "kaisa-eigen-memopt": "KAISA eigen MEM-OPT", "kaisa-inverse": "KAISA inverse"}
    lines += table(["system", "median (s)", "mean (s)", *(f"{names[b]} / row ({s})" for b, s in bases)], rows)
    measured = {r["system"] for r in d["table"]}
    if specs:
        lines += ["Systems: " + "; ".join(f"`{k}` = `{v}`" for k, v in specs.items() if k in measured) + ".", ""]
    out = None if path.name == "vs_kaisa.json" else f"benchmarks/results/{path.name}"  # the default needs no --out
    return lines + command_block(d, "benchmarks.vs_kaisa", "torchrun --nproc_per_node 2 -m benchmarks.vs_kaisa", out)


def fusion_policies(path: Path, d: dict[str, Any]) -> list[str]:
    """Fig. 10: factor computation and unhidden factor communication per fusion policy."""
    need(d, path, "results")
    res = d["results"]
    naive = res.get("naive", {}).get("factor_stage")
    rows = []
    for policy, r in res.items():
        need(r, path, "factor_compute", "factor_comm_nonoverlap", "factor_comm_total", "factor_stage")
        groups = r.get("groups") or {}
        hidden = r.get("hidden")
        rows.append(
            [
                policy,
                f"{groups.get('A', '?')}/{groups.get('G', '?')}",
                ms(r["factor_compute"]),
                ms(r["factor_comm_nonoverlap"]),
                ms(r["factor_comm_total"]),
                "" if hidden is None else f"{hidden:.0%}",
                ms(r["factor_stage"]),
                ratio(naive / r["factor_stage"]) if naive and r["factor_stage"] else "",
            ]
        )
    lines = [
        "Milliseconds per iteration. Unhidden: time `step()` blocks on communication minus what plain SGD "
        "blocks on in the same run; alone: the same fused all-reduces timed back to back; factor stage = "
        "computation + unhidden communication.",
        "",
    ]
    lines += table(
        ["policy", "all-reduces A/G", "FactorComp", "unhidden FactorComm", "FactorComm alone", "hidden", "factor stage", "vs naive"], rows
    )
    return lines + command_block(
        d, "benchmarks.fusion_policies", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.fusion_policies"
    )


def inverse_placement(path: Path, d: dict[str, Any]) -> list[str]:
    """Fig. 12: time to hold every inverse per placement, speed-ups and model errors."""
    need(d, path, "results", "summary")
    rows = [
        [
            PLACEMENT_LABELS.get(k, k),
            f"{r['median_s']:.2f} s",
            f"{r['predicted_s']:.2f} s" if r.get("predicted_s") is not None else "",
            str(r.get("local_factors", "")),
        ]
        for k, r in d["results"].items()
    ]
    s = d["summary"]
    lines = ["Time until every worker holds every inverse (median over rounds).", ""]
    lines += table(["placement", "measured", "predicted by the models", "factors inverted locally"], rows)
    facts = []
    for other, name in (("seq", "Seq-Dist"), ("local", "Non-Dist")):
        key = f"lbp_speedup_vs_{other}"
        if key in s:
            iv = s.get(f"{key}_interval") or [None, None]
            facts.append(f"LBP vs {name}: {ratio(s[key], *iv)}")
    if "lbp_over_lower_bound" in s:
        facts.append(
            f"LBP over the lower bound max(largest inversion, total/P) = {s.get('lower_bound_s', 0):.2f} s: "
            f"{s['lbp_over_lower_bound']:.2f}x"
        )
    if "inverse_model_mean_rel_error" in s:
        facts.append(
            f"inversion model error: mean {s['inverse_model_mean_rel_error']:.0%}"
            + (f", largest for d ≥ 512 {s['inverse_model_max_rel_error_d>=512']:.0%}" if "inverse_model_max_rel_error_d>=512" in s else "")
        )
    if s.get("broadcast_model_mean_rel_error") is not None:
        facts.append(f"broadcast model error: mean {s['broadcast_model_mean_rel_error']:.0%}")
    lines += [f"- {f}" for f in facts] + [""]
    return lines + command_block(
        d, "benchmarks.inverse_placement", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.inverse_placement"
    )


def hook_overhead(path: Path, d: dict[str, Any]) -> list[str]:
    """Forward+backward with and without the hooks."""
    need(d, path, "plain", "hooked", "ratio")
    a = d.get("args", {})
    lines = [
        f"Forward+backward with and without the optimizer's hooks on a step that updates no factor "
        f"({a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')}; "
        "medians).",
        "",
    ]
    lines += table(
        ["without hooks", "with hooks", "overhead"],
        [[f"{ms(d['plain']['median'])} ms", f"{ms(d['hooked']['median'])} ms", f"{(d['ratio'] - 1):+.1%}"]],
    )
    return lines + command_block(d, "benchmarks.hook_overhead", ".venv/bin/python -m benchmarks.hook_overhead --model resnet50")


def batched_decomposition(path: Path, d: dict[str, Any]) -> list[str]:
    """Block-diagonal factors: one batched decomposition against one call per block."""
    need(d, path, "rows", "totals")
    lines = [
        "Grouped and depthwise convolutions have block-diagonal factors; the methods decompose a factor's blocks in "
        "one batched call. Per model, every block-diagonal factor decomposed once (one process, medians, timed "
        "alternately); then per shape, with the fitted performance model's prediction of the batched call.",
        "",
    ]
    rows = []
    for t in d["totals"]:
        need(t, path, "model", "method", "factors", "batched_s", "per_block_s", "speedup")
        rows.append(
            [
                t["model"],
                t["method"],
                str(t["factors"]),
                f"{t['batched_s'] * 1e3:.1f}",
                f"{t['per_block_s'] * 1e3:.1f}",
                f"{t['speedup']:.1f}x",
            ]
        )
    lines += table(["model", "method", "factors", "batched (ms)", "one call per block (ms)", "batched faster by"], rows)
    rows = []
    for r in d["rows"]:
        need(r, path, "blocks", "dim", "method", "batched_s", "per_block_s", "speedup")
        err = f"{r['prediction_error']:+.0%}" if "prediction_error" in r else "-"
        rows.append(
            [
                f"{r['blocks']} x {r['dim']}",
                r["method"],
                f"{r['batched_s'] * 1e3:.2f}",
                f"{r['per_block_s'] * 1e3:.2f}",
                f"{r['speedup']:.1f}x",
                err,
            ]
        )
    lines += table(["blocks x d", "method", "batched (ms)", "per block (ms)", "speed-up", "model error"], rows)
    return lines + command_block(d, "benchmarks.batched_decomposition", ".venv/bin/python -m benchmarks.batched_decomposition")


def warm_step(path: Path, d: dict[str, Any]) -> list[str]:
    """The warm eigenbasis step per dimension against eigh, and its Householder QR against CholeskyQR2."""
    need(d, path, "rows")
    lines = [
        "One warm refresh (`eigen_refresh='warm'`: the product `F Q`, the residual check, a QR, the sign and order "
        "fix-up) against a full `eigh`, per factor dimension of the model, and the same step with the QR replaced by "
        "CholeskyQR2 (Gram matrix, Cholesky, triangular solve, twice: products instead of LAPACK's QR). One process, "
        "one thread, median thread CPU time, the variants timed in turn, on a well-conditioned float32 factor. Last "
        "columns: whether CholeskyQR2 survives `F Q` for the plain `X Xᵀ/d` (condition number ~d²) and for a "
        "rank-deficient factor (where the Gram matrix is singular in float32 its Cholesky fails, and it would need a "
        "fall-back).",
        "",
    ]
    rows = []
    for r in d["rows"]:
        need(r, path, "dim", "seconds", "warm_over_eigh", "warm_cholqr2_over_warm", "cholqr2_over_qr")
        s = r["seconds"]
        rows.append(
            [
                str(r["dim"]),
                f"{s['eigh'] * 1e3:.1f}",
                f"{s['warm'] * 1e3:.1f}",
                f"{r['warm_over_eigh']:.2f}x",
                f"{s['warm_cholqr2'] * 1e3:.1f}",
                f"{r['warm_cholqr2_over_warm']:.2f}x",
                f"{r['cholqr2_over_qr']:.2f}x",
                r.get("cholqr2_on_plain_factor", "-"),
                r.get("cholqr2_on_rank_deficient_factor", "-"),
            ]
        )
    lines += table(
        [
            "d",
            "eigh (ms)",
            "warm (ms)",
            "warm / eigh",
            "warm, CholeskyQR2 (ms)",
            "CholeskyQR2 warm / warm",
            "CholeskyQR2 / QR",
            "CholeskyQR2 on X Xᵀ/d",
            "on a rank-deficient F",
        ],
        rows,
    )
    tot = d.get("model_totals")
    if tot:
        t = tot["seconds"]
        lines += [
            f"{tot['model']}, every dense factor once: `eigh` {t['eigh']:.2f} s, warm {t['warm']:.2f} s "
            f"({t['warm'] / t['eigh']:.2f}x), warm with CholeskyQR2 {t['warm_cholqr2']:.2f} s ({t['warm_cholqr2'] / t['eigh']:.2f}x).",
            "",
        ]
    return lines + command_block(d, "benchmarks.warm_step", ".venv/bin/python -m benchmarks.warm_step")


def simulator_check(path: Path, d: dict[str, Any]) -> list[str]:
    """Predicted against measured iteration times."""
    need(d, path, "rows")
    rows = []
    for r in d["rows"]:
        need(r, path, "variant", "measured_s", "predicted_s", "rel_error")
        freq = "/".join(map(str, r.get("update_freq", ["?"])))
        rows.append(
            [
                str(r.get("workers", "?")),
                LABELS.get(r["variant"], r["variant"]),
                freq,
                ms(r["measured_s"]),
                ms(r["predicted_s"]),
                f"{r['rel_error']:+.1%}",
            ]
        )
    lines = [
        "Scale simulator's predicted iteration time against measured `iteration_time` results (milliseconds; "
        f"contention model {'on' if d.get('contention') else 'off'}).",
        "",
    ]
    lines += table(["workers", "variant", "factor/inverse every", "measured", "predicted", "error"], rows)
    if "largest_abs_error" in d:
        lines += [f"Largest error: {d['largest_abs_error']:.1%}.", ""]
    lines += simulator_conditions(d)
    lines += simulator_phases(path, d["rows"])
    return (
        lines
        + command_block(d, "benchmarks.simulator_check", "python -m benchmarks.simulator_check benchmarks/results/iteration_time.json")
        + [
            "`bash benchmarks/simulator_check.sh [iteration_time args]` fits the performance models, profiles, "
            "measures and predicts back to back, so that the machine's drift stays out of the comparison.",
            "",
        ]
    )


def simulator_conditions(d: dict[str, Any]) -> list[str]:
    """The whole check's command and duration, and how loaded the machine was (when recorded)."""
    lines = []
    if isinstance(d.get("script"), str):
        took = d.get("script_seconds")
        lines += [
            f"Made by `{d['script']}`" + (f" in {took / 60:.0f} min" if isinstance(took, (int, float)) else "") + ".",
            "",
        ]
    load = d.get("load_average")
    if isinstance(load, list) and len(load) == 3:
        cores = d.get("machine", {}).get("cores", "?")
        busy = "a loaded machine: indicative only" if load[2] > 1.5 * (cores if isinstance(cores, int) else 2) else "a quiet machine"
        lines += [f"Machine load (1/5/15 min) when predicted: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {cores} cores ({busy}).", ""]
    for note in d.get("profile_disturbances") or []:
        lines += [f"**Disturbed:** {note}.", ""]
    return lines


def simulator_phases(path: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per phase of the breakdown: measured / predicted milliseconds and the difference's share of the iteration.

    Rows from checks made before the phases were recorded (no ``phase_errors``) are left out; none: no table.
    """
    shown = [r for r in rows if r.get("phase_errors")]
    if not shown:
        return []
    for r in shown:
        for e in r["phase_errors"]:
            need(e, path, "phase", "measured_s", "predicted_s", "share_of_iteration")
    head = ["phase"] + [f"{LABELS.get(r['variant'], r['variant'])} ({r.get('workers', '?')} workers)" for r in shown]
    body = []
    for i, e in enumerate(shown[0]["phase_errors"]):
        cells = [str(e["phase"])]
        for r in shown:
            p = r["phase_errors"][i]
            share = p["share_of_iteration"] if abs(p["share_of_iteration"]) >= 5e-4 else 0.0  # no "-0.0%"
            cells.append(f"{ms(p['measured_s'])} / {ms(p['predicted_s'])} ({share:+.1%})")
        body.append(cells)
    return [
        "Per phase of the measured breakdown (milliseconds, measured / predicted; in brackets the difference as a "
        "share of the measured iteration: the shares add up to the error above, so a drift shows the phase it "
        "comes from). Measured phases are the mean over the ranks, as `iteration_time` records them. Hooks is the "
        "factor hooks' work beyond computing the factors (taken out of FF&BP), Precondition and Update the "
        "preconditioning and the base update (taken out of the rest of `step()`, Other); InverseComp is the "
        "decompositions, InverseComm their broadcasts.",
        "",
        *table(head, body),
    ]


def soak(path: Path, d: dict[str, Any]) -> list[str]:
    """The soak run's checks."""
    need(d, path, "steps", "replicas_bitwise_identical")
    rows = [
        ["steps", str(d["steps"])],
        ["workers", f"{d.get('workers', '?')} ({d.get('engine', '?')})"],
        ["steps delayed on the last rank (up to ms)", f"{d.get('delayed_steps_on_last_rank', '?')} ({d.get('max_delay_ms', '?')})"],
        ["replicas bitwise identical at the end", "yes" if d["replicas_bitwise_identical"] else "**no**"],
        ["resident memory growth after warm-up", f"{d.get('rss_growth_mb_after_warmup', 0):+.1f} MB"],
        ["most gradient handles pending after `step()`", str(d.get("max_pending_grad_handles", "?"))],
        ["most factor all-reduces pending after `step()`", str(d.get("max_pending_factor_allreduces", "?"))],
    ]
    lines = table(["", ""], rows)
    return lines + command_block(d, "benchmarks.soak", "horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.soak --steps 3000")


def fault_matrix(path: Path, d: dict[str, Any]) -> list[str]:
    """The fault matrix: per case, whether the job survived, reported the fault clearly and lost nothing."""
    need(d, path, "summary", "outcomes")
    sm = d["summary"]
    lines = [
        f"{sm['tried']} cases tried ({sm['cases']} in all): {sm['survived']} survived, {sm['detected_with_clear_message']} of "
        f"{sm['to_detect']} detected with a clear message, {sm['nothing_lost']} lost nothing; {sm['all_ok']} fully as expected.",
        "",
    ]

    def yes(v: Any) -> str:
        return "—" if v is None else ("yes" if v else "**no**")

    rows = [
        [
            o["engine"],
            o["group"],
            o["case"],
            yes(o["survived"]),
            yes(o["detected"]),
            yes(o["nothing_lost"]),
            f"{o['seconds']:.0f} s",
            "; ".join(o.get("notes") or []),
        ]
        for o in d["outcomes"]
    ]
    lines += table(["engine", "kind", "case", "survived", "detected (clear message)", "nothing lost", "time", "notes"], rows)
    return lines + command_block(d, "benchmarks.fault_matrix", "python -m benchmarks.fault_matrix")


#: How a convergence run's grids and schedule were chosen, where the JSON cannot say it (shown under its title).
RUN_NOTES = {
    "mnist5k_b256_dho2": "LR grids: one point where mnist5k_b256_race's 3-point grid already chose the LR (adamw, "
    "spdkfac, spdkfac:base=adamw..., soap, muon; soap's, muon's and spdkfac's choices were at an end of that grid); "
    "2 points for sgd (its choice was the race grid's lowest) and for DHO2, new here. DHO2 refreshes its eigenpairs "
    "every 2 epochs (14 steps; FOSI's default of 100 would refresh once in the run) and its ADMM period is the "
    "paper's 4 epochs. Not interleaved: seconds come from a 2-core machine shared with other jobs (load average "
    "9-19 during the run) and are noisy; epochs are not.",
    "digits_b32_race": "LR grids: one point where digits_b32 / digits_b32_dho2 (1 seed, 15 epochs) chose the LR "
    "(sgd, spdkfac, adamw, dho2, dho2-wa), 2 points for the optimizers new on digits. DHO2 refreshes every epoch "
    "(22 steps), ADMM period 4 epochs. Seconds are noisy (shared, loaded machine); epochs are not.",
    "mnist5k_b256_race": "LR grids: factors of 2, extended from the previous race's 3 points until each optimizer's "
    "choice was inside its grid there (sgd down to 0.00625, soap down to 0.00125, muon down to 0.0125, "
    "spdkfac every 10 steps up to 0.2). SPD-KFAC every step (97.2% best, 0.128 final loss, 13.5 s per epoch in the "
    "previous race) was left out to fit the time available: it was the slowest and no contender for the targets.",
    "mnist5k_b256_regularise": "Why Adam in K-FAC's eigenbasis ends below SOAP's best accuracy (issue 27): the race's data, "
    "schedule, 12 epochs, seeds and weight decay (0.05); the contenders at the LR mnist5k_b256_race chose from its "
    "grids; the K-FAC configurations each on the race's 3-point grid, varying what a practitioner would against "
    "overfitting: the second-moment decay (`ekfac_decay` 0.8, 0.95, 0.99), Adam's `eps` (1e-8, 1e-4: a floor like "
    "damping on small eigenbasis coordinates) and the factors' decay (`factor_decay` 0.99: a smoother basis). "
    "Weight decay is in mnist5k_b256_wd0.5 (it applies to every Adam-type optimizer alike).",
    "mnist5k_b256_wd0.5": "mnist5k_b256_regularise with ten times the decoupled weight decay (0.5 instead of 0.05) for "
    "every Adam-type optimizer alike (AdamW, SOAP, Muon, K-FAC with an AdamW base; SGD, the reference, keeps its "
    "5e-4): at the race's LRs and 12 epochs, `lr·wd` over the run shrinks the weights by ~2% at 0.05, too little to "
    "regularise; SOAP on 2 LRs, the K-FAC configurations on the race's 3.",
    "mnist5k_b256_wd0.5_seeds345": "mnist5k_b256_wd0.5 again on seeds 3, 4, 5, run after the choice, each optimizer at "
    "the LR chosen on seeds 0-2: whether the best accuracy's order (K-FAC's `ekfac_decay=0.8` above SOAP on seeds 0-2) "
    "holds on seeds nothing was chosen on.",
    "mnist5k_b256_wd0.05_seeds345": "The race's weight decay (0.05) on the same held-out seeds 3, 4, 5, for the "
    "comparison with SOAP at its race setting; one LR each, the race's choice.",
    "mnist5k_b256_screen_wd0.5": "Screening for issue 27's best-accuracy target on seeds 0-5 (the six seeds of "
    "mnist5k_b256_wd0.5 and its held-out run): Adam in K-FAC's eigenbasis (`ekfac_decay=0.8`, weight decay 0.5) "
    "with fresher factors (`factor_update_freq=1`), rarer or more frequent bases (`inv_update_freq` 20, 5), a faster "
    "basis average (`factor_decay=0.8`) or `ekfac_decay=0.9`, each at 2 LRs, beside SOAP at 2: every one within "
    "±0.15 points of SOAP seed by seed.",
    "mnist5k_b256_screen_wd1.0": "The screening's weight-decay step (seeds 0-5): every Adam-type optimizer at decoupled "
    "weight decay 1.0, one LR each (the wd 0.5 screening's choices).",
    "mnist5k_b256_screen_wd2.0": "The screening's weight-decay step (seeds 0-5): every Adam-type optimizer at decoupled "
    "weight decay 2.0, one LR each. Its best K-FAC configuration (`factor_decay=0.8`) and weight decay were then run "
    "on twelve fresh seeds: mnist5k_b256_fresh_seeds.",
    "mnist5k_b256_fresh_seeds": "Issue 27's targets on twelve seeds nothing was chosen on (6-17), interleaved, every "
    "optimizer at its own best decoupled weight decay from the earlier runs: AdamW 0.05 (the race's), Muon 0.5 "
    "(mnist5k_b256_wd0.5), SOAP at 0.05 and at 2.0 (tied with 1.0 for its best on seeds 0-5), the two K-FAC "
    "configurations at 2.0 and the LR fixed on seeds 0-5 (mnist5k_b256_screen_wd*); AdamW on 3 LRs, SOAP on 2 at each "
    "decay, Muon and SGD at the race's LR.",
    "mnist5k_b256_fresh_seeds_soap_lr": "mnist5k_b256_fresh_seeds' SOAP (weight decay 2.0) one LR further, whether its "
    "choice at the grid's top (0.01) is its best: 0.01 again (its curves identical to the interleaved run's) and 0.02. "
    "Its own target is SOAP's best (no SGD here): ignore the epochs and seconds to it.",
    "digits_b32_ekfac": "The race on digits with Adam in K-FAC's eigenbasis: every optimizer on a 3-point grid (factors "
    "of 2 around digits_b32_race's choice), interleaved so that seconds compare. SPD-KFAC every step and DHO2 are in "
    "digits_b32_race (left out here: the slowest, and no contenders).",
    "mnist5k_b32_ekfac": "The race at 32 per worker on MNIST 5k with Adam in K-FAC's eigenbasis, interleaved, 10 epochs "
    "(mnist5k_b32_race had to stop at 3); one LR each (no grid, to fit the time): the contenders' from "
    "digits_b32_race and mnist5k_b32_interleaved (the same 32 per worker), the K-FAC configurations' from the main job "
    "(digits, 32 per worker, 0.002).",
    "mnist5k_b32_race": "Cut to 3 epochs to fit the time available on a loaded machine; LRs from digits_b32_race "
    "(the same 32 per worker) for the Adam-type optimizers and from mnist5k_b32_interleaved for sgd and spdkfac, "
    "one point each (no grid). DHO2 refreshes every epoch (62 steps), ADMM period 2 epochs (4 would never end "
    "within the run). Seconds are noisy (shared, loaded machine); epochs are not.",
}


def convergence(w: Writer, run: str) -> Callable[[Path, dict[str, Any]], list[str]]:
    """The renderer of one convergence run's folder (its tables, command and curves)."""

    def render(path: Path, d: dict[str, Any]) -> list[str]:
        need(d, path, "settings")
        lines: list[str] = [f"_{RUN_NOTES[run]}_", ""] if run in RUN_NOTES else []
        if d.get("partial"):  # a stopped interleaved run's convergence.partial.json, kept as the result
            epochs = (d.get("args") or {}).get("epochs", "?")
            lines += [f"_Partial: the run was stopped after {d.get('epochs_done', '?')} of its {epochs} epochs (every run alike)._", ""]
        pngs = []
        for st in d["settings"]:
            need(st, path, "data", "batch_size", "optimizers")
            target = st.get("target_test_acc")
            lines += [
                f"{st['data']}, {st['batch_size']} per worker ({st.get('global_batch', '?')} in all, "
                f"{st.get('steps_per_epoch', '?')} steps per epoch); target: the reference's best test accuracy"
                + (f", {target:.1%}" if target is not None else "")
                + ".",
                "",
            ]
            second = st.get("second_reference")
            second_target = st.get("second_target_test_acc")
            if second is not None and second_target is not None:
                lines += [f"Second target: `{second}`'s best test accuracy, {second_target:.1%}.", ""]
            rows = []
            for spec, r in st["optimizers"].items():
                e, s = r.get("epochs_to_target"), r.get("seconds_to_target")
                row = [
                    f"`{spec}`",
                    f"{r['chosen_lr']:g}" if r.get("chosen_lr") is not None else "",
                    f"{r['best_test_acc']:.1%}" if r.get("best_test_acc") is not None else "",
                    f"{r['final_test_loss']:.3f}" if r.get("final_test_loss") is not None else "",
                    "not reached" if e is None else f"{e} ({ratio(r.get('epochs_ratio'))})",
                    "not reached" if s is None else f"{s:.1f} ({ratio(r.get('seconds_ratio'))})",
                ]
                if second is not None:
                    e2, s2 = r.get("epochs_to_second"), r.get("seconds_to_second")
                    row += ["not reached" if e2 is None else str(e2), "not reached" if s2 is None else f"{s2:.1f}"]
                rows.append(row)
            head = ["optimizer", "best LR of the grid", "best test acc", "final test loss", "epochs to target", "seconds to target"]
            lines += table(head + ([f"epochs to {second}'s", f"seconds to {second}'s"] if second is not None else []), rows)
            lines += diverged_runs(st) + per_seed_table(st) + issue_targets(st) + dho2_against_kfac(st)
            pngs.append(f"convergence/{run}/convergence_{st['data']}_b{st['batch_size']}.png")
            pngs.append(f"convergence/{run}/convergence_{st['data']}_b{st['batch_size']}_per_seed.png")  # plot_curves.py --per-seed
        lines += command_block(
            d,
            "benchmarks.convergence",
            "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.convergence",
            out=w.shown(f"convergence/{run}"),
        )
        for png in pngs:
            lines += w.link(png, f"test accuracy and loss, {run}" + (", each seed" if png.endswith("_per_seed.png") else ""))
        return lines

    return render


def diverged_runs(st: dict[str, Any]) -> list[str]:
    """The chosen LR's runs that stopped on non-finite values (their mean curve ends where the first one stopped)."""
    notes = []
    for spec, r in st["optimizers"].items():
        point = next((p for p in (r.get("lr_grid") or {}).values() if p.get("lr") == r.get("chosen_lr")), None)
        runs = (point or {}).get("runs") or []
        stopped = [run for run in runs if run.get("diverged")]
        if stopped:
            seeds = ", ".join(f"seed {run.get('seed', '?')}: {run['diverged']}" for run in stopped)
            notes.append(f"- `{spec}` stopped on non-finite values in {len(stopped)} of {len(runs)} runs ({seeds}).")
    if not notes:
        return []
    return ["Diverged at the chosen LR (the mean curve ends at the first such epoch):", "", *notes, ""]


def _spread(seeds: dict[str, Any], key: str, fmt: str) -> str:
    """``median (min–max)`` of a per-seed value; '–' when a seed did not reach it (no median)."""
    lo_hi = seeds.get(f"{key}_range")
    median = seeds.get(f"{key}_median")
    values = seeds.get(key) or []
    missed = sum(v is None for v in values)
    text = "–" if median is None else format(median, fmt)
    if lo_hi is not None:
        text += f" ({format(lo_hi[0], fmt)}–{format(lo_hi[1], fmt)})"
    return text + (f", {missed} of {len(values)} not reached" if missed else "")


def per_seed_table(st: dict[str, Any]) -> list[str]:
    """Each optimizer's chosen LR over the seeds (median and range) and its LR grid with each point's best test accuracy."""
    rows = []
    for spec, r in st["optimizers"].items():
        seeds = r.get("per_seed")
        if not seeds:
            continue
        grid = ", ".join(
            f"{p['lr']:g}: {p['best_test_acc']:.1%}" if p.get("best_test_acc") is not None else f"{p['lr']:g}: –"
            for p in sorted(r["lr_grid"].values(), key=lambda p: p["lr"])
        )
        rows.append(
            [
                f"`{spec}`",
                grid,
                _spread(seeds, "best_test_acc", ".3f"),
                _spread(seeds, "final_test_loss", ".3f"),
                _spread(seeds, "epochs_to_target", "g"),
                _spread(seeds, "seconds_to_target", ".1f"),
                _spread(seeds, "epochs_to_second", "g"),
            ]
        )
    if not rows:
        return []
    head = ["optimizer", "LR grid (best test acc, mean over seeds)", "best test acc", "final test loss", "epochs to target"]
    head += ["seconds to target", "epochs to 2nd target"]
    return ["Per seed at the chosen LR: median (range) over the seeds.", "", *table(head, rows)]


def issue_targets(st: dict[str, Any]) -> list[str]:
    """Issue 27's targets for each K-FAC configuration: epochs to SGD's best no more than SOAP's, seconds no more than
    AdamW's, best test accuracy at least SOAP's, final test loss at most AdamW's (from the mean curves). Where a
    contender ran in several configurations (``soap`` and ``soap:weight_decay=0.05``), each target is held against
    its best value among them."""
    opts = st["optimizers"]

    def entries(name: str) -> dict[str, dict[str, Any]]:
        return {spec: r for spec, r in opts.items() if spec.partition(":")[0] == name}

    soap, adamw, kfac = entries("soap"), entries("adamw"), entries("spdkfac")
    if not soap or not adamw or not kfac:
        return []

    def lowest(among: dict[str, dict[str, Any]], key: str) -> Any:
        values = [r[key] for r in among.values() if r.get(key) is not None]
        return min(values) if values else None

    def at_most(mine: float | None, theirs: float | None) -> str:
        if mine is None:
            return "no (not reached)"
        if theirs is None:
            return "yes (theirs not reached)"
        return f"{'yes' if mine <= theirs else 'no'} ({mine:g} vs {theirs:g})"

    soap_spec = max(soap, key=lambda spec: soap[spec].get("best_test_acc") or -1.0)  # its most accurate configuration
    soap_acc, adamw_loss = soap[soap_spec].get("best_test_acc"), lowest(adamw, "final_test_loss")
    adamw_seconds = lowest(adamw, "seconds_to_target")
    rows = []
    for spec, r in kfac.items():
        acc, loss = r.get("best_test_acc"), r.get("final_test_loss")
        seeds = paired_text((r.get("paired_best_test_acc") or {}).get(soap_spec))
        rows.append(
            [
                f"`{spec}`",
                at_most(r.get("epochs_to_target"), lowest(soap, "epochs_to_target")),
                at_most(
                    None if r.get("seconds_to_target") is None else round(r["seconds_to_target"], 1),
                    None if adamw_seconds is None else round(adamw_seconds, 1),
                ),
                "–" if acc is None or soap_acc is None else f"{'yes' if acc >= soap_acc else 'no'} ({acc:.1%} vs {soap_acc:.1%}{seeds})",
                "–" if loss is None or adamw_loss is None else f"{'yes' if loss <= adamw_loss else 'no'} ({loss:.3f} vs {adamw_loss:.3f})",
            ]
        )
    head = ["K-FAC configuration", "epochs to target ≤ SOAP's", "seconds to target ≤ AdamW's", "best acc ≥ SOAP's"]
    head += ["final test loss ≤ AdamW's"]
    several = len(soap) > 1 or len(adamw) > 1
    return [
        "Issue 27's targets, per K-FAC configuration (mean curves over the seeds; the best accuracy also seed by seed, "
        "paired: the mean difference ± its standard error in points, and wins–ties–losses)"
        + (f"; each against the contender's best value over its configurations (best accuracy: `{soap_spec}`)" if several else "")
        + ":",
        "",
        *table(head, rows),
    ]


def paired_text(p: dict[str, Any] | None) -> str:
    """``; per seed +0.02 ± 0.12 points, 3–1–2`` (benchmarks.convergence.paired_difference of best accuracies), or nothing."""
    if not p:
        return ""
    se = "" if p.get("standard_error") is None else f" ± {p['standard_error'] * 100:.2f}"
    return f"; per seed {p['mean'] * 100:+.2f}{se} points, {p['wins']}–{p['ties']}–{p['losses']}"


def main_job_seeds(path: Path, d: dict[str, Any]) -> list[str]:
    """The main job per seed: each configuration's final test loss and best test accuracy, the target against SGD, the curves."""
    need(d, path, "configs", "seeds", "runs")
    names = list(d["configs"])
    seeds = [str(s) for s in d["seeds"]]
    args = {name: " ".join(extra) or "(defaults)" for name, extra in d["configs"].items()}
    lines = [
        f"`spdkfac.train --data digits --epochs {d.get('epochs', '?')}` on {d.get('world_size', '?')} workers, one run per "
        "configuration and seed (the seed also draws the train/test split). Configurations (the arguments each adds):",
        "",
        *table(["configuration", "arguments"], [[f"`{n}`", f"`{args[n]}`"] for n in names]),
        "Final test loss (best test accuracy):",
        "",
    ]
    head = ["seed", *(f"`{n}`" for n in names)]
    rows = []
    for seed in seeds:
        cells = []
        for n in names:
            s = d["runs"].get(n, {}).get(seed, {}).get("summary")
            cells.append("–" if s is None else f"{s['final_test_loss']:.4f} ({s['best_test_acc']:.1%})")
        rows.append([seed, *cells])
    lines += table(head, rows)
    for name, t in d.get("targets", {}).items():
        per_seed = t["per_seed"]
        verdicts = ", ".join(f"seed {s}: {'yes' if v['final_loss_at_most_sgd'] else '**no**'}" for s, v in per_seed.items())
        every = "yes" if t["final_loss_at_most_sgd_every_seed"] else "**no**"
        worst = t.get("worst_final_loss_over_sgd")
        margin = "" if worst is None else f"; at most {worst:.2f}x SGD's on any seed"
        lines += [f"`{name}`: final test loss ≤ SGD's for every seed: {every} ({verdicts}{margin}).", ""]
    aborted = [f"`{n}` seed {seed} ({r['exit_status']})" for n, per in d["runs"].items() for seed, r in per.items() if r.get("exit_status")]
    if aborted:
        lines += ["Runs that trained every epoch but exited with a non-zero status: " + ", ".join(aborted) + ".", ""]
    epochs = max((len(r["curve"]) for per in d["runs"].values() for r in per.values()), default=0)
    curve_rows = [
        [f"`{n}`", seed, *(f"{row['test_loss']:.3f}" for row in d["runs"][n][seed]["curve"])]
        for n in names
        for seed in seeds
        if seed in d["runs"].get(n, {})
    ]
    lines += ["Test loss per epoch:", "", *table(["configuration", "seed", *map(str, range(epochs))], curve_rows)]
    return lines + command_block(d, "benchmarks.main_job_seeds", "python -m benchmarks.main_job_seeds")


def dho2_against_kfac(st: dict[str, Any]) -> list[str]:
    """The DHO2 paper's claim, per DHO2 entry and K-FAC configuration: K-FAC's epochs and seconds to the target over
    DHO2's (above 1: DHO2 is faster; the paper reports 1.5–2x), from the mean curves, with DHO2's seconds per epoch
    and the part of them its eigenpair refreshes take."""
    opts = st["optimizers"]
    dho2 = {spec: r for spec, r in opts.items() if spec.partition(":")[0] in ("dho2", "dho2-wa")}
    kfac = {spec: r for spec, r in opts.items() if spec.partition(":")[0] == "spdkfac"}
    if not dho2 or not kfac:
        return []

    def over(theirs: float | None, mine: float | None, fmt: str) -> str:
        if mine is None:
            return "neither reached it" if theirs is None else f"DHO2 did not reach it (K-FAC: {theirs:{fmt}})"
        if theirs is None:
            return f"K-FAC did not reach it (DHO2: {mine:{fmt}})"
        return f"{theirs / mine:.2f}x ({theirs:{fmt}} / {mine:{fmt}})"

    rows = []
    for name, d in dho2.items():
        epoch_s, refresh_s = d.get("mean_epoch_s"), d.get("mean_refresh_s")
        per_epoch = "–" if epoch_s is None else f"{epoch_s:.1f}" + ("" if refresh_s is None else f" ({refresh_s:.1f})")
        for spec, k in kfac.items():
            rows.append(
                [
                    f"`{name}`",
                    f"`{spec}`",
                    over(k.get("epochs_to_target"), d.get("epochs_to_target"), "g"),
                    over(k.get("seconds_to_target"), d.get("seconds_to_target"), ".1f"),
                    per_epoch,
                ]
            )
    head = ["DHO2", "K-FAC configuration", "K-FAC's epochs to target / DHO2's", "K-FAC's seconds to target / DHO2's"]
    head += ["DHO2's s/epoch (refresh)"]
    return [
        "The DHO2 paper's claim (1.5–2x faster than K-FAC to a given accuracy), at this target (mean curves over the seeds):",
        "",
        *table(head, rows),
    ]


def dho2_cost(w: Writer, paths: Sequence[Path]) -> list[str]:
    """DHO2's iteration time split and curvature memory per worker, one row per worker count (``dho2_cost/w<P>.json``)."""
    rows, commands = [], []
    for path in paths:
        d = load(path)
        need(d, path, "world_size", "grad_s", "refresh_s", "update_s", "per_iteration_s", "memory", "params", "lanczos_steps")
        every = (d.get("args") or {}).get("refresh_every", "?")
        mem = d["memory"]
        rows.append(
            [
                f"{d['world_size']} ({d.get('engine', '?')})",
                f"{d.get('model', '?')} (n={d['params']}, m={d['lanczos_steps']})",
                ms(d["grad_s"]),
                f"{ms(d['refresh_s'])} (every {every})",
                f"{d['update_s'] * 1e3:.1f}",
                ms(d["per_iteration_s"]),
                f"{mem.get('lanczos_basis', 0) / 2**20:.2f}",
                f"{mem.get('eigenvectors', 0) / 2**20:.2f}",
            ]
        )
        commands += command_block(d, "benchmarks.dho2_cost", "python -m benchmarks.dho2_cost", out=w.shown("dho2_cost"))
    head = [
        "workers",
        "model",
        "gradient (ms)",
        "refresh: HVPs + Lanczos (ms)",
        "update (ms)",
        "per iteration, amortised (ms)",
        "Lanczos basis per worker (MiB)",
        "eigenvectors (MiB)",
    ]
    lines = table(head, rows)
    predicted = [load(p) for p in paths]
    predicted = [d for d in predicted if d.get("predicted_memory")]
    if predicted:
        d = max(predicted, key=lambda d: d["world_size"])
        lines += [
            f"Curvature memory per worker at more workers, analytic ({d.get('model', '?')}, n={d['params']}, "
            f"m={d['lanczos_steps']}): only the Lanczos basis is split, ceil(n/P)·m float32 values per worker; "
            "the eigenvectors, ADMM variables and base-optimizer state are replicated (as measured). At the "
            "measured worker counts the formula equals the allocation.",
            "",
        ]
        lines += table(
            ["workers", "Lanczos basis (MiB)", "replicated (MiB)", "total per worker (MiB)"],
            [
                [str(r["workers"]), f"{r['lanczos_basis'] / 2**20:.3f}", f"{r['replicated'] / 2**20:.2f}", f"{r['total'] / 2**20:.2f}"]
                for r in d["predicted_memory"]
            ],
        )
    return lines + commands


def kaisa_fraction(path: Path, d: dict[str, Any]) -> list[str]:
    """KAISA's grad_worker_fraction, measured: step time, decomposition stage and K-FAC memory per worker."""
    need(d, path, "measured", "modelled", "workers", "inv_update_freq")
    modelled = {r["fraction"]: r for r in d["modelled"]}
    freq = d["inv_update_freq"]
    timing = (
        "*Step*: a whole iteration, factors and decompositions updated every step (there is no separate stage)."
        if freq == 1
        else "*Step*: a step that keeps the decompositions (preconditioning and the broadcasts of its results); *stage*: one "
        "decomposition stage (decompositions and their broadcasts to each layer's gradient workers); *amortised*: step + "
        f"stage / {freq}."
    )
    rounds = len(d["measured"][0].get("rounds_amortised_s", [None])) if d["measured"] else 1
    order = (
        "one run, one fraction after another" if rounds == 1 else f"{rounds} rounds alternating the fractions, each row the median round"
    )
    lines = [
        f"{d.get('model', '?')} at {d.get('resolution', '?')}×{d.get('resolution', '?')}, batch {d.get('batch_size', '?')} per worker, "
        f"{d['workers']} workers ({d.get('engine', '?')}), `compute_method='{d.get('compute_method', '?')}'`, {order}. {timing} Memory: running factors and decompositions, fullest and emptiest worker. "
        f"*Modelled*: what the `'auto'` decision charged ({'sub-group broadcasts' if d.get('native_subgroups') else 'broadcasts to all'}).",
        "",
    ]
    rows = []
    for r in d["measured"]:
        m = modelled.get(r["fraction"])
        rows.append(
            [
                f"{r['fraction']} ({r['grad_workers']} per layer)" if r["fraction"] == "auto" else r["fraction"],
                ms(r["step_s"]),
                ms(r["decomposition_stage_s"]),
                ms(r["amortised_s"]),
                f"{r['kfac_mib_max']:.0f}",
                f"{r['kfac_mib_min']:.0f}",
                ms(m["seconds"]) if m else ms(r.get("auto_predicted_s")),
            ]
        )
    lines += table(["fraction", "step (ms)", "stage (ms)", "amortised (ms)", "MiB max", "MiB min", "modelled (ms)"], rows)
    return lines + command_block(d, "benchmarks.kaisa_fraction", "torchrun --nproc_per_node 4 -m benchmarks.kaisa_fraction measure")


def kaisa_fraction_simulated(path: Path, d: dict[str, Any]) -> list[str]:
    """KAISA's grad_worker_fraction at scale, predicted by the simulator."""
    need(d, path, "predicted", "update_freq")
    f, i = d["update_freq"]
    lines = [
        f"Predicted from `{d.get('profile', '?')}` (`compute_method='{d.get('compute_method', '?')}'`, factors every {f}, "
        f"decompositions every {i} iterations): iteration time and K-FAC memory per worker. `gpu-cluster` is an "
        "assumed 100 Gb/s InfiniBand cluster for communication and decompositions (constants in the JSON), the step's "
        "linear algebra (preconditioning, packing, the update) scaled to the same arithmetic rate, and the passes (forward, "
        "backward, the factors) to "
        + (
            f"{d['gpu_sgd_passes_s'] * 1e3:.0f} ms of plain-SGD passes per worker (ResNet-50 at 224×224, batch 32, on a V100). "
            if "gpu_sgd_passes_s" in d
            else "the reference machine's. "
        )
        + f"Memory is the fullest worker's and the mean. KAISA reports: {d.get('kaisa_reported', '')}.",
        "",
    ]
    for key, rows in d["predicted"].items():
        chose = next((r.get("chose") for r in rows if r["fraction"] == "auto"), None)
        fractions = [r for r in rows if r["fraction"] != "auto"]
        fewest, most = fractions[0]["iteration_s"], fractions[-1]["iteration_s"]
        change = (most / fewest - 1) * 100 if fewest else 0.0
        trend = f"; from 1 to {len(fractions) and fractions[-1]['fraction'].split('/')[0]} gradient workers the iteration is {abs(change):.1f}% {'shorter' if change < 0 else 'longer'}"
        lines += [f"**{key.replace('/', ', ')} workers** ('auto' chose {chose}{trend})", ""]
        lines += table(
            ["fraction", "iteration (ms)", "MiB max", "MiB mean"],
            [
                [r["fraction"], ms(r["iteration_s"]), f"{r['kfac_mib_max']:.0f}", f"{r.get('kfac_mib_mean', float('nan')):.0f}"]
                for r in rows
            ],
        )
    return lines + command_block(d, "benchmarks.kaisa_fraction", ".venv/bin/python -m benchmarks.kaisa_fraction simulate")


def build(results: Path, out: Path, label: str | None = None) -> str:
    """The Markdown text of RESULTS.md for the result files under ``results``."""
    if not results.is_dir():
        raise ResultsError(f"{results}: no such results folder")
    w = Writer(results, out, label or results.as_posix())
    w.lines += [
        "# Results",
        "",
        f"Generated by `python scripts/results_md.py` from the JSON files in `{w.label}/`; do not edit by "
        "hand. Each benchmark writes its JSON (and a PNG) there; rerun it, then regenerate this file. "
        "Ratios from one run are meaningful; absolute seconds depend on the machine and its load. "
        "Explanations: [docs/performance.md](../docs/performance.md).",
        "",
    ]
    w.section("model_stats.json", "Model statistics (Table II) and the arithmetic floor", model_stats, "factor_sizes.png")
    for run in sorted(results.glob("gpu_check*.json")):  # optional: one section per card
        w.section(
            run.name,
            "On a GPU: the gpu tests, iteration time against SGD and AdamW, decompositions"
            + (f" ({run.stem.removeprefix('gpu_check_')})" if run.stem != "gpu_check" else ""),
            gpu_check,
        )
    w.section("iteration_time.json", "Iteration time and breakdown per variant (Table III)", iteration_time, "iteration_time.png")
    for extra in sorted(results.glob("iteration_time_*.json")):  # other models (e.g. grouped/depthwise networks)
        if extra.name == "iteration_time_eigenbasis.json":
            continue  # the eigenbasis comparison has its own section, below
        model = extra.stem.removeprefix("iteration_time_")
        png = extra.with_suffix(".png").name
        w.section(extra.name, f"Iteration time and memory per variant: {model}", iteration_time, png if (results / png).is_file() else None)
    for fused in sorted(results.glob("update_fusion*.json")):  # optional: one section per model and worker count
        if fused.name == "update_fusion_model.json":
            continue  # the cost model's prediction has its own section, below
        title = "Update fusion: the update in the next forward pass or in backward"
        w.section(
            fused.name, title + (f" ({fused.stem.removeprefix('update_fusion_')})" if fused.stem != "update_fusion" else ""), update_fusion
        )
    if (results / "update_cost.json").is_file():
        w.section("update_cost.json", "Update fusion: what the separate update pass costs", update_cost)
    if (results / "update_fusion_model.json").is_file():  # optional, and new: no note when absent
        w.section("update_fusion_model.json", "Update fusion: the cost model on this CPU and on a V100-class GPU", update_fusion_model)
    if (results / "iteration_time_eigenbasis.json").is_file():  # optional, and new: no note when absent
        w.section(
            "iteration_time_eigenbasis.json",
            "Eigen method: exact and warm-started eigenbasis refresh beside the inverse method",
            eigenbasis_iteration,
        )
    for run in sorted(results.glob("vs_kaisa*.json")):  # optional, and new: no note when absent
        suffix = run.stem.removeprefix("vs_kaisa").strip("_")
        w.section(run.name, "Eigen and inverse methods beside KAISA's, in one run" + (f": {suffix}" if suffix else ""), vs_kaisa)
    w.section("fusion_policies.json", "Pipelined factor communication per fusion policy (Fig. 10)", fusion_policies, "fusion_policies.png")
    w.section("inverse_placement.json", "Placement of the inversions (Fig. 12)", inverse_placement, "inverse_placement.png")
    w.section("hook_overhead.json", "Cost of the hooks on steps without a factor update", hook_overhead)
    if (results / "batched_decomposition.json").is_file():  # optional, and new: no note when absent
        w.section(
            "batched_decomposition.json", "Grouped convolutions: batched decompositions against one call per block", batched_decomposition
        )
    if (results / "warm_step.json").is_file():  # optional, and new: no note when absent
        w.section("warm_step.json", "Warm eigenbasis step per dimension: against eigh, and QR against CholeskyQR2", warm_step)
    w.section("simulator_check.json", "Scale simulator against measurements", simulator_check)
    for other in sorted(results.glob("simulator_check_*.json")):  # optional: checks of other workloads (CHECK_NAME=...)
        w.section(other.name, f"Scale simulator against measurements ({other.stem.removeprefix('simulator_check_')})", simulator_check)
    w.section("soak.json", "Soak run: replicas, memory and pending work over many steps", soak)
    w.section("fault_matrix.json", "Fault matrix: kills, damaged files, full disk, two jobs, frozen worker", fault_matrix)
    for measured in sorted(results.glob("kaisa_fraction*.json")):  # optional: one section per worker count and method
        if measured.name == "kaisa_fraction_simulated.json":
            continue
        suffix = measured.stem.removeprefix("kaisa_fraction").strip("_")
        title = "KAISA's grad_worker_fraction: step time and K-FAC memory per worker" + (f" ({suffix})" if suffix else "")
        w.section(measured.name, title, kaisa_fraction)
    if (results / "kaisa_fraction_simulated.json").is_file():  # optional, and new: no note when absent
        png = "kaisa_fraction_simulated.png"
        w.section(
            "kaisa_fraction_simulated.json",
            "KAISA's grad_worker_fraction at scale (simulator)",
            kaisa_fraction_simulated,
            png if (results / png).is_file() else None,
        )
    if (results / "main_job_seeds.json").is_file():  # optional, and new: no note when absent
        w.section("main_job_seeds.json", "The main job over seeds: SPD-KFAC's final test loss against SGD's", main_job_seeds)
    costs = sorted((results / "dho2_cost").glob("w*.json"))
    if costs:  # optional, and new: no note when absent
        w.lines += ["## DHO2: time per iteration and curvature memory per worker", "", *dho2_cost(w, costs)]
    conv = results / "convergence"
    runs = sorted(p.name for p in conv.iterdir() if p.is_dir()) if conv.is_dir() else []
    if not runs:
        w.lines += ["## Time to accuracy", "", f"_No runs under `{w.shown('convergence')}/`: section skipped._", ""]
        w.skipped.append("convergence/")
    for run in runs:
        w.section(f"convergence/{run}/convergence.json", f"Time to accuracy: {run}", convergence(w, run))
    if w.skipped:
        w.lines += ["## Not present", "", "Skipped because the file is absent: " + ", ".join(f"`{s}`" for s in w.skipped) + ".", ""]
    return "\n".join(w.lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results", help="folder holding the result JSON files")
    ap.add_argument("--out", default="benchmarks/RESULTS.md", help="Markdown file to write")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        text = build(Path(args.results), out, args.results.rstrip("/"))
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
