"""How far the scale simulator's predictions are from measured iteration times.

    python -m spdkfac.simulate profile --model resnet50 --out benchmarks/results/profile_resnet50.json
    python -m benchmarks.simulator_check benchmarks/results/iteration_time.json [more iteration_time JSONs]

For every variant in each measured ``iteration_time`` result, predicts the
iteration time at that result's worker count with
:func:`spdkfac.simulate.predict` (``--contention`` for CPU workers without a
spare core, the default here) and prints the relative error, then the error
per phase of the breakdown the benchmark records (:data:`~spdkfac.simulate.PHASES`:
forward+backward, the hooks' own work, the gradient all-reduces, the factor
computation and all-reduces, the decompositions and their broadcasts, the
preconditioning, the update, the rest of ``step()``): measured and predicted
milliseconds and the difference as a share of the measured iteration, so that
the shares add up to the iteration's error and a drift shows the phase it
comes from. Measurements from before ``iteration_time`` recorded the hooks,
preconditioning and update apart show those inside FF&BP and Other.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from spdkfac.perfmodels import PerfModel
from spdkfac.runtime.output_path import unwritable_reason
from spdkfac.simulate import PART_OF_PHASE, PARTS, PHASES, load_profiles, parts_of_phases, predict_phases

from .common import RESULTS, machine, save_json


def measured_phases(row: dict[str, float]) -> dict[str, float]:
    """An ``iteration_time`` row's breakdown as :data:`~spdkfac.simulate.PHASES`: the phases it records inside a part
    (Hooks in FF&BP; Precondition and Update in Other) taken out of that part (0 where the row predates them)."""
    phases = {phase: float(row.get(phase, 0.0)) for phase in PHASES}
    for phase, part in PART_OF_PHASE.items():
        phases[part] -= phases[phase]
    return phases


def phase_errors(measured: dict[str, float], predicted: dict[str, float]) -> list[dict[str, float | str]]:
    """Per phase of :data:`~spdkfac.simulate.PHASES`: measured and predicted seconds, their difference, and that
    difference over the measured iteration (the phases' shares add up to the iteration's relative error
    when the measured phases add up to the iteration, as ``iteration_time`` records them)."""
    iteration = measured["mean_s"]
    got_phases = measured_phases(measured)
    out: list[dict[str, float | str]] = []
    for phase in PHASES:
        got, want = got_phases[phase] + 0.0, float(predicted[phase]) + 0.0  # no "-0.0"
        out.append(
            {
                "phase": phase,
                "measured_s": got,
                "predicted_s": want,
                "diff_s": want - got,
                "share_of_iteration": (want - got) / iteration if iteration else 0.0,
            }
        )
    return out


def print_phase_table(rows: list[dict[str, object]]) -> None:
    """Measured / predicted milliseconds per phase and variant, with the difference's share of the iteration."""
    print("\nper phase: measured / predicted ms (difference as a share of the measured iteration)")
    print(f"{'phase':<12} " + " ".join(f"{str(r['workers']) + ':' + str(r['variant']):>30}" for r in rows))
    for i, phase in enumerate(PHASES):
        cells = []
        for r in rows:
            e = r["phase_errors"][i]
            share = e["share_of_iteration"] if abs(e["share_of_iteration"]) >= 5e-4 else 0.0  # no "-0.0%"
            cells.append(f"{e['measured_s'] * 1e3:9.1f} / {e['predicted_s'] * 1e3:9.1f} ({share:+6.1%})")
        print(f"{phase:<12} " + " ".join(f"{c:>30}" for c in cells))


#: Two profiles of the same workload whose work differs more than this (max / min), or one whose ranks' work
#: differs more than this, were disturbed by something else running: the check says so.
DISAGREEMENT = 1.25


def profile_disturbances(paths: Sequence[str]) -> list[str]:
    """What says the profiles were taken on a busy machine: each profile's K-FAC and plain-SGD pass work, and its ranks' spread.

    The check brackets the measurement with two profiles of the same
    workers; on a quiet machine they agree within a few percent, and so do
    the ranks of each. Another job's load shows as one profile (or one rank)
    much slower than the rest, and is reported rather than averaged in
    silently.
    """
    notes = []
    profiles = [(path, load_profiles([path])) for path in paths]
    for what, work in (
        ("K-FAC pass work", lambda p: p.forward + p.backward + p.step_other),
        ("plain-SGD passes", lambda p: p.sgd_forward_backward or 0.0),
    ):
        values = [work(p) for _, p in profiles]
        if len(values) > 1 and min(values) > 0 and max(values) / min(values) > DISAGREEMENT:
            listed = ", ".join(f"{Path(path).name} {v:.2f} s" for (path, _), v in zip(profiles, values))
            notes.append(f"the profiles disagree on the {what} ({listed}): the machine was busy while profiling")
    for path, p in profiles:
        ranks = p.rank_passes
        if len(ranks) > 1 and min(ranks) > 0 and max(ranks) / min(ranks) > DISAGREEMENT:
            listed = ", ".join(f"{t:.2f}" for t in ranks)
            notes.append(f"{Path(path).name}: the ranks' K-FAC pass work differs ({listed} s): a rank shared its core while profiling")
    return notes


def machine_load(measured: Sequence[object]) -> dict[str, object]:
    """The load average to report: the busiest (by its 15-minute average) that the measured files recorded as they
    were written, else (files that did not record one) the load now, labelled as taken when predicting."""
    recorded = [load for load in measured if isinstance(load, list) and len(load) == 3]
    if recorded:
        return {"load_average": max(recorded, key=lambda load: load[2]), "load_average_when": "measured"}
    return {"load_average": machine()["load_average"], "load_average_when": "predicted"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measured", nargs="+", type=Path)
    ap.add_argument(
        "--profile",
        nargs="+",
        default=[str(RESULTS / "profile_resnet50.json")],
        help="per-layer profile(s) of the measured workload; several are averaged (taken before and after)",
    )
    ap.add_argument("--perf-model", default="perfmodels/reference-cpu-gloo-2.json")
    ap.add_argument("--no-contention", action="store_true", help="assume communication overlaps computation (GPU clusters)")
    ap.add_argument("--out", default="simulator_check.json", help="file name under benchmarks/results/")
    ap.add_argument("--script", default=None, help="the whole check's command (simulator_check.sh passes its own), recorded")
    ap.add_argument("--script-seconds", type=float, default=None, help="how long the whole check took so far, recorded")
    args = ap.parse_args()
    problem = unwritable_reason(RESULTS / args.out, make_parents=True)  # as save_json writes it
    if problem:
        ap.error(f"cannot write --out {RESULTS / args.out}: {problem}")
    try:
        profile = load_profiles(args.profile)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    perf = PerfModel.load(args.perf_model)
    disturbed = profile_disturbances(args.profile)
    for note in disturbed:
        print(f"warning: {note}", file=sys.stderr)
    rows = []
    measured_loads: list[object] = []
    print(f"{'workers':>7} {'variant':<10} {'updates':>8} {'measured':>10} {'predicted':>10} {'error':>7}")
    for path in args.measured:
        data = json.loads(path.read_text())
        workload = {k: data["args"].get(k) for k in ("model", "resolution", "batch_size")}
        profiled = {k: getattr(profile, k) for k in workload}
        if workload != profiled:
            raise SystemExit(
                f"error: {path} measured {workload} but the profile {' + '.join(args.profile)} is of {profiled}; "
                "profile the same workload (python -m spdkfac.simulate profile ...)"
            )
        workers = data["world_size"]
        measured_loads.append(data.get("machine", {}).get("load_average"))
        freq = tuple(data["args"]["update_freq"])
        for row in data["table"]:
            phases = predict_phases(profile, perf, workers, row["variant"], contention=not args.no_contention, update_freq=freq)
            pred = parts_of_phases(phases)
            err = (pred["iteration"] - row["mean_s"]) / row["mean_s"]
            rows.append(
                {
                    "workers": workers,
                    "variant": row["variant"],
                    "update_freq": freq,
                    "measured_s": row["mean_s"],
                    "predicted_s": pred["iteration"],
                    "rel_error": err,
                    "predicted_parts": pred,
                    "measured_parts": {k: row.get(k, 0.0) for k in PARTS},
                    "predicted_phases": phases,
                    "measured_phases": measured_phases(row),
                    "phase_errors": phase_errors(row, phases),
                }
            )
            print(
                f"{workers:>7} {row['variant']:<10} {freq[0]:>3}/{freq[1]:<4} {row['mean_s'] * 1e3:9.1f}m {pred['iteration'] * 1e3:9.1f}m {err:+7.1%}"
            )
    print_phase_table(rows)
    worst = max(abs(r["rel_error"]) for r in rows)
    print(f"largest error {worst:.1%}")
    result = {
        "rows": rows,
        "largest_abs_error": worst,
        "contention": not args.no_contention,
        "command": f"python -m benchmarks.simulator_check {shlex.join(sys.argv[1:])}",
        "machine": machine(),
        # How busy the machine was (1, 5 and 15 minutes): a loaded machine's check is indicative.
        **machine_load(measured_loads),
        "profile_disturbances": disturbed,
    }
    if args.script:
        result["script"] = args.script
        result["script_seconds"] = args.script_seconds
    print(f"wrote {save_json(result, args.out)}")


if __name__ == "__main__":
    main()
