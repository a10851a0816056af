"""The hooks' cost on steps without a factor update (``hook_overhead.json``, benchmarks/hook_overhead.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, model_at, ms, need, renders, table


@renders("hook_overhead.json", "Cost of the hooks on steps without a factor update", order=90)
def hook_overhead(path: Path, d: dict[str, Any]) -> list[str]:
    """Forward+backward with and without the hooks."""
    need(d, path, "plain", "hooked", "ratio")
    a = d.get("args", {})
    lines = [
        f"Forward+backward with and without the optimizer's hooks on a step that updates no factor "
        f"({model_at(a)}, batch {a.get('batch_size', '?')}; medians).",
        "",
    ]
    lines += table(
        ["without hooks", "with hooks", "overhead"],
        [[f"{ms(d['plain']['median'])} ms", f"{ms(d['hooked']['median'])} ms", f"{(d['ratio'] - 1):+.1%}"]],
    )
    return lines + command_block(d, "benchmarks.hook_overhead", ".venv/bin/python -m benchmarks.hook_overhead --model resnet50")
