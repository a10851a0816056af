"""A transposed convolution's ``A`` by stride residue class (``transposed_conv_factor.json``, benchmarks/transposed_conv_factor.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("transposed_conv_factor.json", "Transposed convolutions: the A factor by stride residue class", order=93, optional=True)
def transposed_conv_factor(path: Path, d: dict[str, Any]) -> list[str]:
    """Per up-sampling layer: the zero-filled patches' Gram against the residue classes' Grams."""
    need(d, path, "layers")
    lines = [
        "A transposed convolution's `A` factor, per residue class of the output position modulo the stride (each "
        "class the patches of a plain stride-1 convolution of the input, as shipped), against the Gram of the "
        "equivalent convolution's zero-filled patches; medians of interleaved rounds, float32. The factors differ "
        "by rounding only ([docs/layers.md](../docs/layers.md#transposed-convolutions)).",
        "",
    ]
    rows = [
        [
            name,
            str(r["a_dim"]),
            f"{ms(r['zero_filled']['median'])} ms",
            f"{ms(r['classes']['median'])} ms",
            f"{r['speedup']:.1f}x",
            f"{r['max_relative_difference']:.0e}",
        ]
        for name, r in d["layers"].items()
    ]
    lines += table(["layer", "A dim", "zero-filled patches", "by residue class", "speed-up", "largest difference"], rows)
    return lines + command_block(d, "benchmarks.transposed_conv_factor", ".venv/bin/python -m benchmarks.transposed_conv_factor")
