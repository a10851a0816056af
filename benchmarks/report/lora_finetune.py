"""LoRA fine-tuning with K-FAC on PEFT's adapters against AdamW (``lora_finetune.json``, benchmarks/lora_finetune.py)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table

LABELS = {
    "adamw": "AdamW",
    "kfac-adamw": "AdamW with a KFACPreconditioner attached",
    "sgd": "momentum SGD",
    "kfac-sgd": "SPDKFACOptimizer (momentum SGD)",
}


@renders("lora_finetune.json", "LoRA fine-tuning (PEFT): K-FAC on the adapters against AdamW", order=99, optional=True)
def lora_finetune(path: Path, d: dict[str, Any]) -> list[str]:
    """Per arm at its best learning rate: best test accuracy, the per-seed difference against AdamW, and the epochs
    and seconds to AdamW's best mean accuracy."""
    need(d, path, "summary", "args")
    summary, args = d["summary"], d["args"]
    seeds = len(args["seeds"])
    lines = [
        f"An MLP (784-256-256-10) trained on MNIST 5k's digits 0-4, then PEFT's LoRA adapters (rank {args['rank']}, "
        f"its three Linear layers, the base frozen) fine-tuned on digits 5-9 for {args['epochs']} epochs (batch "
        f"{args['batch_size']}, cosine decay), tested on the held-out 5-9 digits; {seeds} seeds, each arm at the best "
        "rate of its grid (mean best test accuracy). K-FAC takes its factors and decompositions every "
        f"{args['kfac_freq']} steps. The target is AdamW's best mean test accuracy ({summary['target']:.1%}); epochs "
        "and training seconds to it are medians over the seeds that reach it.",
        "",
    ]
    adamw_seconds = _median_seconds(summary["adamw"])
    rows = []
    for arm, label in LABELS.items():
        if arm not in summary:
            continue
        row = summary[arm]
        reached = [r for r in row["to_target"] if r["epochs"] is not None]
        seconds = _median_seconds(row)
        edge = " (grid edge)" if row.get("lr_at_grid_edge") else ""
        rows.append(
            [
                label,
                f"{row['lr']:g}{edge}",
                f"{row['best_acc_mean']:.1%}",
                "—" if arm == "adamw" else f"{100 * row['vs_adamw_mean']:+.1f} ± {100 * row['vs_adamw_se']:.1f} points",
                f"{len(reached)} of {seeds}",
                "—" if not reached else f"{statistics.median(r['epochs'] for r in reached):g}",
                "—"
                if seconds is None
                else f"{seconds:.2f} s" + ("" if adamw_seconds is None else f" ({seconds / adamw_seconds:.2f}x AdamW's)"),
            ]
        )
    lines += table(
        ["optimizer", "lr", "best test acc", "per seed vs AdamW", "seeds reaching the target", "epochs to it", "seconds to it"], rows
    )
    return [*lines, "", *command_block(d, "benchmarks.lora_finetune", ".venv/bin/python -m benchmarks.lora_finetune")]


def _median_seconds(row: dict[str, Any]) -> float | None:
    reached = [r["seconds"] for r in row["to_target"] if r["seconds"] is not None]
    return statistics.median(reached) if reached else None
