"""The cost of preconditioning nn.MultiheadAttention (``attention_cost.json``, benchmarks/attention_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, machine_line, ms, need, renders, table

ROWS = {
    "sgd": "SGD (torch's attention forward)",
    "kfac-attention-skipped": "SPD-KFAC, attention in `skip_layers` (torch's forward)",
    "kfac-attention-preconditioned": "SPD-KFAC, attention preconditioned (explicit forward)",
}


@renders("attention_cost.json", "Cost of preconditioning nn.MultiheadAttention", order=92, optional=True)
def attention_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """Forward+backward and whole iterations, with and without a factor update, per configuration."""
    need(d, path, "times", "args")
    a, times = d["args"], d["times"]
    skipped = times.get("kfac-attention-skipped", {})

    def cell(name: str, key: str) -> str:
        value = times.get(name, {}).get(key, {}).get("median")
        if value is None:
            return ""
        ref = skipped.get(key, {}).get("median")
        return f"{ms(value)} ms" + (f" ({value / ref:.2f}x)" if ref and name == "kfac-attention-preconditioned" else "")

    rows = [
        [label, cell(n, "fb"), cell(n, "iter"), cell(n, "fb_factor"), cell(n, "iter_factor"), str(d.get("layers", {}).get(n, ""))]
        for n, label in ROWS.items()
        if n in times
    ]
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')}, "
        f"one process, factors and inverses every {a.get('freq', '?')} iterations; medians of {a.get('iters', '?')} "
        "interleaved iterations (x: against attention skipped).",
        "",
    ]
    lines += table(
        ["configuration", "fwd+bwd", "iteration", "fwd+bwd, factor step", "iteration, factor step", "preconditioned layers"], rows
    )
    lines += ["", machine_line(d), ""]
    return lines + command_block(
        d, "benchmarks.attention_cost", ".venv/bin/python -m benchmarks.attention_cost --model vit_s16_32 --batch-size 8"
    )
