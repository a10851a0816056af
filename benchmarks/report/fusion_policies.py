"""Fig. 10: the factor stage per fusion policy (``fusion_policies.json``, benchmarks/fusion_policies.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, ratio, renders, table


@renders("fusion_policies.json", "Pipelined factor communication per fusion policy (Fig. 10)", order=70, plot="fusion_policies.png")
def fusion_policies(path: Path, d: dict[str, Any]) -> list[str]:
    """Fig. 10: factor computation and unhidden factor communication per fusion policy."""
    need(d, path, "results")
    res = d["results"]
    naive = res.get("naive", {}).get("factor_stage")
    rows = []
    for policy, r in res.items():
        need(r, path, "factor_compute", "factor_comm_nonoverlap", "factor_comm_total", "factor_stage")
        groups = r.get("groups") or {}
        hidden = r.get("hidden")
        rows.append(
            [
                policy,
                f"{groups.get('A', '?')}/{groups.get('G', '?')}",
                ms(r["factor_compute"]),
                ms(r["factor_comm_nonoverlap"]),
                ms(r["factor_comm_total"]),
                "" if hidden is None else f"{hidden:.0%}",
                ms(r["factor_stage"]),
                ratio(naive / r["factor_stage"]) if naive and r["factor_stage"] else "",
            ]
        )
    lines = [
        "Milliseconds per iteration. Unhidden: time `step()` blocks on communication minus what plain SGD "
        "blocks on in the same run; alone: the same fused all-reduces timed back to back; factor stage = "
        "computation + unhidden communication.",
        "",
    ]
    lines += table(
        ["policy", "all-reduces A/G", "FactorComp", "unhidden FactorComm", "FactorComm alone", "hidden", "factor stage", "vs naive"], rows
    )
    return lines + command_block(
        d, "benchmarks.fusion_policies", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.fusion_policies"
    )
