"""Update fusion measured (``update_fusion*.json``, benchmarks/iteration_time.py ``--update-fusions``): one section per model and worker count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import LABELS, command_block, ms, need, ratio, renders, table


def paired_ratios(samples: dict[str, list[float]], base: str, variant: str) -> str:
    """Median (min–max) of the unfused over the fused time, iteration by iteration (interleaved runs only)."""
    a, b = samples.get(base), samples.get(variant)
    if not a or not b or len(a) != len(b):
        return ""
    ratios = sorted(x / y for x, y in zip(a, b))
    n = len(ratios)
    median = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return f"{median:.2f}x ({ratios[0]:.2f}–{ratios[-1]:.2f})"


def title(rel: Path) -> str:
    """``update_fusion_<model>_w<P>.json``'s title (``update_fusion_model.json`` has its own section)."""
    setting = rel.stem.removeprefix("update_fusion_")
    return "Update fusion: the update in the next forward pass or in backward" + (f" ({setting})" if rel.stem != "update_fusion" else "")


@renders("update_fusion*.json", title, order=40)
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
