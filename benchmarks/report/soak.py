"""The soak run's checks (``soak.json``, benchmarks/soak.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders("soak.json", "Soak run: replicas, memory and pending work over many steps", order=130)
def soak(path: Path, d: dict[str, Any]) -> list[str]:
    """The soak run's checks."""
    need(d, path, "steps", "replicas_bitwise_identical")
    rows = [
        ["steps", str(d["steps"])],
        ["workers", f"{d.get('workers', '?')} ({d.get('engine', '?')})"],
        ["steps delayed on the last rank (up to ms)", f"{d.get('delayed_steps_on_last_rank', '?')} ({d.get('max_delay_ms', '?')})"],
        ["replicas bitwise identical at the end", "yes" if d["replicas_bitwise_identical"] else "**no**"],
        ["resident memory growth after warm-up", f"{d.get('rss_growth_mb_after_warmup', 0):+.1f} MB"],
        ["most gradient handles pending after `step()`", str(d.get("max_pending_grad_handles", "?"))],
        ["most factor all-reduces pending after `step()`", str(d.get("max_pending_factor_allreduces", "?"))],
    ]
    lines = table(["", ""], rows)
    return lines + command_block(d, "benchmarks.soak", "horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.soak --steps 3000")
