"""Grouped convolutions: batched decompositions against one call per block (``batched_decomposition.json``,
benchmarks/batched_decomposition.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders(
    "batched_decomposition.json",
    "Grouped convolutions: batched decompositions against one call per block",
    order=100,
    optional=True,
)
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
