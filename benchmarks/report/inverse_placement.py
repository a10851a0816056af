"""Fig. 12: the decomposition stage per placement (``inverse_placement.json``, benchmarks/inverse_placement.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, ratio, renders, table

PLACEMENT_LABELS = {"lbp": "LBP (SPD-KFAC)", "seq": "Seq-Dist (MPD-KFAC)", "local": "Non-Dist (D-KFAC)"}


@renders("inverse_placement.json", "Placement of the inversions (Fig. 12)", order=80, plot="inverse_placement.png")
def inverse_placement(path: Path, d: dict[str, Any]) -> list[str]:
    """Fig. 12: time to hold every inverse per placement, speed-ups and model errors."""
    need(d, path, "results", "summary")
    rows = [
        [
            PLACEMENT_LABELS.get(k, k),
            f"{r['median_s']:.2f} s",
            f"{r['predicted_s']:.2f} s" if r.get("predicted_s") is not None else "",
            str(r.get("local_factors", "")),
        ]
        for k, r in d["results"].items()
    ]
    s = d["summary"]
    lines = ["Time until every worker holds every inverse (median over rounds).", ""]
    lines += table(["placement", "measured", "predicted by the models", "factors inverted locally"], rows)
    facts = []
    for other, name in (("seq", "Seq-Dist"), ("local", "Non-Dist")):
        key = f"lbp_speedup_vs_{other}"
        if key in s:
            iv = s.get(f"{key}_interval") or [None, None]
            facts.append(f"LBP vs {name}: {ratio(s[key], *iv)}")
    if "lbp_over_lower_bound" in s:
        facts.append(
            f"LBP over the lower bound max(largest inversion, total/P) = {s.get('lower_bound_s', 0):.2f} s: "
            f"{s['lbp_over_lower_bound']:.2f}x"
        )
    if "inverse_model_mean_rel_error" in s:
        facts.append(
            f"inversion model error: mean {s['inverse_model_mean_rel_error']:.0%}"
            + (f", largest for d ≥ 512 {s['inverse_model_max_rel_error_d>=512']:.0%}" if "inverse_model_max_rel_error_d>=512" in s else "")
        )
    if s.get("broadcast_model_mean_rel_error") is not None:
        facts.append(f"broadcast model error: mean {s['broadcast_model_mean_rel_error']:.0%}")
    lines += [f"- {f}" for f in facts] + [""]
    return lines + command_block(
        d, "benchmarks.inverse_placement", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.inverse_placement"
    )
