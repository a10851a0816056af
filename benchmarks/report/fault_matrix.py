"""The fault matrix (``fault_matrix.json``, benchmarks/fault_matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders("fault_matrix.json", "Fault matrix: kills, damaged files, full disk, two jobs, frozen worker", order=140)
def fault_matrix(path: Path, d: dict[str, Any]) -> list[str]:
    """The fault matrix: per case, whether the job survived, reported the fault clearly and lost nothing."""
    need(d, path, "summary", "outcomes")
    sm = d["summary"]
    lines = [
        f"{sm['tried']} cases tried ({sm['cases']} in all): {sm['survived']} survived, {sm['detected_with_clear_message']} of "
        f"{sm['to_detect']} detected with a clear message, {sm['nothing_lost']} lost nothing; {sm['all_ok']} fully as expected.",
        "",
    ]

    def yes(v: Any) -> str:
        return "—" if v is None else ("yes" if v else "**no**")

    rows = [
        [
            o["engine"],
            o["group"],
            o["case"],
            yes(o["survived"]),
            yes(o["detected"]),
            yes(o["nothing_lost"]),
            f"{o['seconds']:.0f} s",
            "; ".join(o.get("notes") or []),
        ]
        for o in d["outcomes"]
    ]
    lines += table(["engine", "kind", "case", "survived", "detected (clear message)", "nothing lost", "time", "notes"], rows)
    return lines + command_block(d, "benchmarks.fault_matrix", "python -m benchmarks.fault_matrix")
