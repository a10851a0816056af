"""The scale simulator against measurements (``simulator_check.json``, and ``simulator_check_<name>.json`` for
other workloads; benchmarks/simulator_check.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report.common import LABELS, command_block, ms, need, renders, table


@renders("simulator_check.json", "Scale simulator against measurements", order=120)
@renders(  # checks of other workloads (CHECK_NAME=...)
    "simulator_check_*.json",
    lambda rel: f"Scale simulator against measurements ({rel.stem.removeprefix('simulator_check_')})",
    order=121,
)
def simulator_check(path: Path, d: dict[str, Any]) -> list[str]:
    """Predicted against measured iteration times."""
    need(d, path, "rows")
    rows = []
    for r in d["rows"]:
        need(r, path, "variant", "measured_s", "predicted_s", "rel_error")
        freq = "/".join(map(str, r.get("update_freq", ["?"])))
        rows.append(
            [
                str(r.get("workers", "?")),
                LABELS.get(r["variant"], r["variant"]),
                freq,
                ms(r["measured_s"]),
                ms(r["predicted_s"]),
                f"{r['rel_error']:+.1%}",
            ]
        )
    lines = [
        "Scale simulator's predicted iteration time against measured `iteration_time` results (milliseconds; "
        f"contention model {'on' if d.get('contention') else 'off'}).",
        "",
    ]
    lines += table(["workers", "variant", "factor/inverse every", "measured", "predicted", "error"], rows)
    if "largest_abs_error" in d:
        lines += [f"Largest error: {d['largest_abs_error']:.1%}.", ""]
    lines += simulator_conditions(d)
    lines += simulator_phases(path, d["rows"])
    return (
        lines
        + command_block(d, "benchmarks.simulator_check", "python -m benchmarks.simulator_check benchmarks/results/iteration_time.json")
        + [
            "`bash benchmarks/simulator_check.sh [iteration_time args]` fits the performance models, profiles, "
            "measures and predicts back to back, so that the machine's drift stays out of the comparison.",
            "",
        ]
    )


def simulator_conditions(d: dict[str, Any]) -> list[str]:
    """The whole check's command and duration, and how loaded the machine was (when recorded)."""
    lines = []
    if isinstance(d.get("script"), str):
        took = d.get("script_seconds")
        lines += [
            f"Made by `{d['script']}`" + (f" in {took / 60:.0f} min" if isinstance(took, (int, float)) else "") + ".",
            "",
        ]
    load = d.get("load_average")
    if isinstance(load, list) and len(load) == 3:
        cores = d.get("machine", {}).get("cores", "?")
        busy = "a loaded machine: indicative only" if load[2] > 1.5 * (cores if isinstance(cores, int) else 2) else "a quiet machine"
        when = "when measured" if d.get("load_average_when") == "measured" else "when predicted"
        lines += [f"Machine load (1/5/15 min) {when}: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {cores} cores ({busy}).", ""]
    for note in d.get("profile_disturbances") or []:
        lines += [f"**Disturbed:** {note}.", ""]
    return lines


def simulator_phases(path: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per phase of the breakdown: measured / predicted milliseconds and the difference's share of the iteration.

    Rows from checks made before the phases were recorded (no ``phase_errors``) are left out; none: no table.
    """
    shown = [r for r in rows if r.get("phase_errors")]
    if not shown:
        return []
    for r in shown:
        for e in r["phase_errors"]:
            need(e, path, "phase", "measured_s", "predicted_s", "share_of_iteration")
    head = ["phase"] + [f"{LABELS.get(r['variant'], r['variant'])} ({r.get('workers', '?')} workers)" for r in shown]
    body = []
    for i, e in enumerate(shown[0]["phase_errors"]):
        cells = [str(e["phase"])]
        for r in shown:
            p = r["phase_errors"][i]
            share = p["share_of_iteration"] if abs(p["share_of_iteration"]) >= 5e-4 else 0.0  # no "-0.0%"
            cells.append(f"{ms(p['measured_s'])} / {ms(p['predicted_s'])} ({share:+.1%})")
        body.append(cells)
    return [
        "Per phase of the measured breakdown (milliseconds, measured / predicted; in brackets the difference as a "
        "share of the measured iteration: the shares add up to the error above, so a drift shows the phase it "
        "comes from). Measured phases are the mean over the ranks, as `iteration_time` records them. Hooks is the "
        "factor hooks' work beyond computing the factors (taken out of FF&BP), Precondition and Update the "
        "preconditioning and the base update (taken out of the rest of `step()`, Other); InverseComp is the "
        "decompositions, InverseComm their broadcasts.",
        "",
        *table(head, body),
    ]
