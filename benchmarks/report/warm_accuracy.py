"""The warm eigenbasis refresh's preconditioned gradient against eigh's along a training run (``warm_accuracy.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, model_at, need, recorded_args, renders, table


def title(rel: Path) -> str:
    """``warm_accuracy_<model>.json``'s title."""
    suffix = rel.stem.removeprefix("warm_accuracy").strip("_")
    return "Warm eigenbasis refresh: its preconditioned gradient against eigh's" + (f", {suffix}" if suffix else "")


STEPS = {
    "block": "block step (the default)",
    "subspace": "one subspace step (earlier default)",
    "ritz": "subspace step with Rayleigh–Ritz",
}


@renders("warm_accuracy*.json", title, order=111, optional=True)
def warm_accuracy(path: Path, d: dict[str, Any]) -> list[str]:
    """Per iteration: each warm step's relative error over the model and its worst layer, and the residuals."""
    a = recorded_args(d, path, "rows")
    lines = [
        f"{model_at(a)}, one process, "
        + (
            f"a new random batch of {a['batch_size']} every iteration"
            if a.get("fresh_batches")
            else f"one fixed batch of {a['batch_size']}"
        )
        + f", SGD learning rate {a['lr']} (momentum 0.9), "
        f"damping {a['damping']}, trained with the exact eigen method; each warm step keeps its own chain of bases, "
        "refreshed every iteration and never replaced by an `eigh` (iteration t: t refreshes after one). Relative "
        "error of the preconditioned "
        "gradient against the exact one over the model (worst layer), and the largest residual of the refreshed "
        "bases (the shipped check's tolerance: 0.15).",
        "",
    ]
    rows = []
    steps = [step for step in STEPS if step in d["rows"][0]]  # runs before the block step have no column for it
    for r in d["rows"]:
        need(r, path, "iteration", *steps)
        cells = [str(r["iteration"])]
        for step in steps:
            s = r[step]
            cells.append(f"{100 * s['relative_error']:.2f}% ({100 * s['worst_layer_error']:.1f}%, {s['worst_layer'] or '-'})")
            cells.append(f"{s['max_residual']:.3f}")
        rows.append(cells)
    head = ["iteration"]
    for step in steps:
        head += [f"{STEPS[step]}: error (worst layer)", "residual"]
    lines += table(head, rows)
    out = None if path.name == "warm_accuracy.json" else f"benchmarks/results/{path.name}"  # the default needs no --out
    return lines + command_block(d, "benchmarks.warm_accuracy", "python -m benchmarks.warm_accuracy", out)
