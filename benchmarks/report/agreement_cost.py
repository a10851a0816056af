"""The per-step agreement's share of a step (``agreement_cost.json``, benchmarks/agreement_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, model_at, ms, need, renders, table


@renders("agreement_cost.json", "Cost of the per-step agreement of the collective order", order=91)
def agreement_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """One agreement-size all-reduce against one SPD-KFAC step, per measured step."""
    need(d, path, "step", "agreement", "share", "agreement_entries", "workers")
    a = d.get("args", {})
    share = d["share"]
    lines = [
        f"The small all-reduce that ends every step's hook all-reduces with several workers (a layer may run on some "
        f"workers only, [shared-layers.md](../docs/shared-layers.md)), timed alone after each SPD-KFAC step "
        f"({model_at(a)}, batch {a.get('batch_size', '?')} per worker, {d['workers']} workers via {d.get('engine', '?')}; "
        f"medians over {d['step']['n']} steps).",
        "",
    ]
    lines += table(
        ["agreement (float64 values)", "agreement", "SPD-KFAC step", "share of the step (range)"],
        [
            [
                str(d["agreement_entries"]),
                f"{ms(d['agreement']['median'])} ms",
                f"{ms(d['step']['median'])} ms",
                f"{share['median']:.2%} ({share['min']:.2%}–{share['max']:.2%})",
            ]
        ],
    )
    default = "torchrun --nproc_per_node 2 -m benchmarks.agreement_cost --model mnist_cnn --resolution 28 --batch-size 32"
    return lines + command_block(d, "benchmarks.agreement_cost", default)
