"""A stride-1 convolution's ``A`` on the CPU: shared shifts against the im2col rows (``conv_factor.json``, benchmarks/conv_factor.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders(
    "conv_factor.json",
    "Convolutions on the CPU: the A factor by shared shifts or im2col rows, and the rows in parts",
    order=98,
    optional=True,
)
def conv_factor(path: Path, d: dict[str, Any]) -> list[str]:
    """Per convolution: both routes' medians, their ratio, the route the cost model takes and whether it is the faster;
    then the rows in parts against the rows at once."""
    need(d, path, "layers")
    layers = d["layers"]
    faster = sum(bool(r["rule_takes_the_faster"]) for r in layers.values())
    threads = d.get("args", {}).get("threads")
    on = f" on {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    lines = [
        "A stride-1 k×k convolution's `A` factor on the CPU by shared shifts ([docs/design.md](../docs/design.md#computing-the-factors)) "
        f"and by the im2col rows' one product, timed alternately{on}; medians, float32. The shipped rule takes the "
        "shared shifts where its cost model (`SharedShiftWork.pays`, which counts torch's threads) expects them to "
        f"be faster: on small maps, few channels or many threads the one product wins. The rule takes the faster route on {faster} of {len(layers)} layers; the "
        "two factors differ by rounding only.",
        "",
    ]
    rows = [
        [
            name,
            str(r["a_dim"]),
            f"{r['im2col']['median'] * 1e3:.2f} ms",
            f"{r['shared']['median'] * 1e3:.2f} ms",
            f"{r['shared_over_im2col']:.2f}",
            str(r["rule_takes"]) + ("" if r["rule_takes_the_faster"] else " (slower)"),
            f"{r['max_relative_difference']:.0e}",
        ]
        for name, r in layers.items()
    ]
    lines += table(["layer", "A dim", "im2col rows", "shared shifts", "shared / im2col", "the rule takes", "largest difference"], rows)
    if d.get("in_parts"):
        lines += [
            "",
            "Convolutions whose im2col rows exceed 64 MB (`IM2COL_ROWS_BYTES`): the shipped Gram, from rows built a few "
            "samples at a time with the parts' Grams summed, against the rows built at once; medians of interleaved "
            "rounds, float32.",
            "",
        ]
        parts = [
            [
                name,
                str(r["a_dim"]),
                f"{r['rows_bytes_at_once'] / 2**20:.0f} MB",
                f"{r['parts']} × {r['rows_bytes_per_part'] / 2**20:.0f} MB",
                f"{r['at_once']['median'] * 1e3:.0f} ms",
                f"{r['in_parts']['median'] * 1e3:.0f} ms",
                f"{r['parts_over_at_once']:.2f}",
                f"{r['max_relative_difference']:.0e}",
            ]
            for name, r in d["in_parts"].items()
        ]
        lines += table(
            ["layer", "A dim", "rows at once", "rows in parts", "at once", "in parts", "in parts / at once", "largest difference"], parts
        )
    grid = d.get("grid")
    if grid:
        n = len(grid["cases"])
        lost = {arm: math.exp(value / n) for arm, value in grid["log_time_lost"].items()}
        lines += [
            "",
            f"On the grid the cost model was fitted on ({n} cases: 3×3 and 5×5 kernels, 2×2 to 16×16 maps, 8 to 512 "
            f"channels, batch 8 and 64), the rule takes the faster route in {grid['rule_takes_the_faster']} of {n}. "
            "Against always taking the faster route, each case takes on average (geometric mean) "
            f"{lost['rule']:.2f}x the time with the rule, {lost['always_shared']:.2f}x always taking the shared shifts "
            f"(before the rule) and {lost['always_im2col']:.2f}x always taking the im2col rows; the rule's worst case "
            f"is {grid['rule_worst']:.2f}x.",
        ]
    return lines + command_block(d, "benchmarks.conv_factor", ".venv/bin/python -m benchmarks.conv_factor")
