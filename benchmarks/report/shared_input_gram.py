"""Linear layers reading one input, their Gram computed once (``shared_input_gram.json``, benchmarks/shared_input_gram.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("shared_input_gram.json", "Llama-style blocks: one Gram for the Linear layers reading one input", order=96, optional=True)
def shared_input_gram(path: Path, d: dict[str, Any]) -> list[str]:
    """Per model size: factor-step time with each input's Gram computed once against once per layer."""
    need(d, path, "models")
    lines = [
        "Whole iterations on factor steps (factors every step, decompositions at the first only) of a Llama-style "
        "model (2 blocks: separate q, k, v, o projections, SwiGLU MLP), two copies stepped in alternation on the "
        "same batches: Linear layers reading one input share its Gram (as shipped), or each computes its own; "
        "medians. The two copies' parameters must be bitwise equal at the end "
        "([docs/layers.md](../docs/layers.md#linear-layers-reading-one-input)).",
        "",
    ]
    rows = [
        [
            name,
            f"{r['grams_per_step']['apart']} / {r['grams_per_step']['shared']}",
            f"{ms(r['apart']['median'])} ms",
            f"{ms(r['shared']['median'])} ms",
            f"{r['speedup']:.3f}x",
            "yes" if r["parameters_bitwise_equal"] else "**no**",
        ]
        for name, r in d["models"].items()
    ]
    lines += table(["model", "Linear Grams per step: each / shared", "each its own", "shared", "speed-up", "bitwise equal"], rows)
    return lines + command_block(d, "benchmarks.shared_input_gram", ".venv/bin/python -m benchmarks.shared_input_gram")
