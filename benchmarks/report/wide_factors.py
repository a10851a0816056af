"""A language model's vocabulary-wide factors kept dense or diagonal (``wide_factors.json``, benchmarks/wide_factors.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("wide_factors.json", "Vocabulary-wide factors kept diagonal (max_factor_dim)", order=97, optional=True)
def wide_factors(path: Path, d: dict[str, Any]) -> list[str]:
    """Per vocabulary: K-FAC memory and step times with every factor dense against the vocabulary-wide ones diagonal."""
    need(d, path, "vocabularies")
    lines = [
        "A Llama-style model (width 256, 2 blocks, MLP 688, 64 tokens, batch 16) whose output layer's `G` is as wide "
        "as the vocabulary, in two copies stepped in alternation on the same batches: every factor dense, or "
        "`max_factor_dim=1000` (only the vocabulary-wide factors diagonal). K-FAC's memory (`memory_usage()`: "
        "running factors and decompositions) and median seconds per kind of step; the amortised column is "
        "`(89 plain + 9 factor + 1 decomposition step) / 100`, factors every 10 and decompositions every 100 steps "
        "([docs/layers.md](../docs/layers.md#factors-too-wide-to-keep-max_factor_dim)).",
        "",
    ]
    rows = []
    for name, r in d["vocabularies"].items():
        for arm in ("dense", "diagonal"):
            a = r[arm]
            rows.append(
                [
                    name if arm == "dense" else "",
                    arm,
                    f"{a['kfac_bytes'] / 2**20:.1f} MiB",
                    *(f"{ms(a['seconds'][kind]['median'])} ms" for kind in ("plain", "factors", "decompositions")),
                    f"{ms(a['amortised_10_100'])} ms",
                ]
            )
        s = r["speedup"]
        rows.append(
            [
                "",
                "dense / diagonal",
                f"{r['memory_ratio']:.1f}x",
                *(f"{s[kind]:.2f}x" for kind in ("plain", "factors", "decompositions", "amortised_10_100")),
            ]
        )
    lines += table(["vocabulary", "factors", "K-FAC memory", "plain step", "factor step", "decomposition step", "amortised 10/100"], rows)
    return lines + command_block(d, "benchmarks.wide_factors", "flock /tmp/spdkfac-bench.lock .venv/bin/python -m benchmarks.wide_factors")
