"""The cost of preconditioning nn.MultiheadAttention (``attention_cost.json``, benchmarks/attention_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, labelled_rows, machine_line, model_at, ms, recorded_args, renders, table

ROWS = {
    "sgd": "SGD (torch's attention forward)",
    "kfac-attention-skipped": "SPD-KFAC, attention in `skip_layers` (torch's forward)",
    "kfac-attention-preconditioned": "SPD-KFAC, attention preconditioned (explicit forward)",
}


@renders("attention_cost.json", "Cost of preconditioning nn.MultiheadAttention", order=92, optional=True)
def attention_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """Forward+backward and whole iterations, with and without a factor update, per configuration."""
    a, times = recorded_args(d, path, "times"), d["times"]
    skipped = times.get("kfac-attention-skipped", {})

    def cell(name: str, key: str) -> str:
        value = times.get(name, {}).get(key, {}).get("median")
        if value is None:
            return ""
        ref = skipped.get(key, {}).get("median")
        return f"{ms(value)} ms" + (f" ({value / ref:.2f}x)" if ref and name == "kfac-attention-preconditioned" else "")

    def cells(n: str, _: Any) -> list[str]:
        return [cell(n, "fb"), cell(n, "iter"), cell(n, "fb_factor"), cell(n, "iter_factor"), str(d.get("layers", {}).get(n, ""))]

    lines = [
        f"{model_at(a)}, batch {a['batch_size']}, one process, factors and inverses every {a['freq']} iterations; "
        f"medians of {a['iters']} "
        "interleaved iterations (x: against attention skipped).",
        "",
    ]
    lines += table(
        ["configuration", "fwd+bwd", "iteration", "fwd+bwd, factor step", "iteration, factor step", "preconditioned layers"],
        labelled_rows(ROWS, times, cells),
    )
    lines += ["", machine_line(d), ""]
    return lines + command_block(
        d, "benchmarks.attention_cost", ".venv/bin/python -m benchmarks.attention_cost --model vit_s16_32 --batch-size 8"
    )
