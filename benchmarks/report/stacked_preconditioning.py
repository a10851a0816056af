"""Same-shape layers stacked or not, on the CPU (``stacked_preconditioning.json``, benchmarks/stacked_preconditioning.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("stacked_preconditioning.json", "Stacked preconditioning of same-shape layers on the CPU", order=94, optional=True)
def stacked_preconditioning(path: Path, d: dict[str, Any]) -> list[str]:
    """Per model: step()'s median time stacked and layer by layer, and their ratio."""
    need(d, path, "models")
    lines = [
        "`step()` on plain steps (K-FAC amortised 10/100), same-shape layers preconditioned stacked against layer by "
        "layer, two copies of the model stepped in alternation; medians. Above 1 the stacking is slower, which is "
        "why it is on by default on a GPU only ([docs/gpu.md](../docs/gpu.md)). Operations: the ATen operations one "
        "plain `step()` issues, views left out, a multi-tensor one counted as the kernels a GPU runs for it (one "
        "where its tensors are dense and laid out alike, else one per tensor), as this machine runs it and with the "
        "library's device-dependent choices taken as on a GPU (the finiteness check by one multi-tensor norm, not a "
        "sum per parameter; the KL clip's products summed once per stack; the write-back's copies sorted by layout).",
        "",
    ]
    rows = [
        [
            name,
            f"{r['stacked_layers']} of {r['layers']} in {r['groups']}",
            f"{ms(r['per_layer']['median'])} ms",
            f"{ms(r['stacked']['median'])} ms",
            f"{r['ratio']:.2f}x",
            f"{r['operations']['per_layer']} / {r['operations']['stacked']}" if "operations" in r else "not counted",
            f"{r['operations_as_on_gpu']['per_layer']} / {r['operations_as_on_gpu']['stacked']}"
            if "operations_as_on_gpu" in r
            else "not counted",
        ]
        for name, r in d["models"].items()
    ]
    lines += table(
        [
            "model",
            "layers stacked (groups)",
            "layer by layer",
            "stacked",
            "stacked / layer by layer",
            "operations: layer by layer / stacked",
            "the same, as on a GPU",
        ],
        rows,
    )
    return lines + command_block(d, "benchmarks.stacked_preconditioning", ".venv/bin/python -m benchmarks.stacked_preconditioning")
