"""Table II: factor statistics per model and the amortised arithmetic floor (``model_stats.json``, benchmarks/model_stats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import need, renders, table


@renders("model_stats.json", "Model statistics (Table II) and the arithmetic floor", order=10, plot="factor_sizes.png")
def model_stats(path: Path, d: dict[str, Any]) -> list[str]:
    """Table II: factor statistics per model, and the arithmetic floor of the amortised setting."""
    need(d, path, "models")
    rows = []
    first_resolution = (next(iter(d["models"].values()), {}).get("arithmetic") or {}).get("resolution")
    for name, st in d["models"].items():
        need(st, path, "params", "layers", "a_elems", "g_elems")
        ar = st.get("arithmetic") or {}
        same = st.get("matches_paper")
        res = ar.get("resolution")
        rows.append(
            [
                name if res == first_resolution or res is None else f"{name} (floor at {res}×{res})",
                f"{st['params'] / 1e6:.1f}",
                str(st["layers"]),
                f"{st['a_elems'] / 1e6:.1f}",
                f"{st['g_elems'] / 1e6:.1f}",
                str(st.get("max_dim", "")),
                ""
                if not isinstance(same, dict)
                else ("yes" if all(same.values()) else "differs: " + ", ".join(k for k, v in same.items() if not v)),
                f"{ar['floor']:.2f}x" if "floor" in ar else "",
                f"{ar['floor_distributed_preconditioning']:.2f}x" if "floor_distributed_preconditioning" in ar else "",
            ]
        )
    first = next(iter(d["models"].values()), {}).get("arithmetic") or {}
    lines = [
        "Parameters and upper-triangle factor elements in millions. Floor: the lowest amortised K-FAC/SGD "
        "iteration-time ratio the arithmetic allows at one FLOP rate"
        + (
            f" ({first.get('resolution')}×{first.get('resolution')}, batch {first.get('batch_size')}, factors every "
            f"{first.get('factor_every')} iterations; distributed preconditioning over {first.get('workers')} workers)"
            if first
            else ""
        )
        + ".",
        "",
    ]
    lines += table(
        [
            "model",
            "params",
            "preconditioned layers",
            "A elements",
            "G elements",
            "largest factor",
            "matches the paper",
            "floor",
            "floor, dist. precond.",
        ],
        rows,
    )
    return [
        *lines,
        "Command (the benchmark's documented command):",
        "",
        "```bash",
        "python -m benchmarks.model_stats",
        "```",
        "",
        "Machine: not recorded (counts and arithmetic do not depend on it).",
        "",
    ]
