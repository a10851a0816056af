"""Time to accuracy, one section per convergence run (``convergence/<run>/convergence.json``, benchmarks/convergence.py):
the optimizers' tables, the per-seed spreads, issue 27's targets, the DHO2 paper's claim, the command and the curves.

A run's ``notes.md`` beside its results (how its grids and schedule were chosen, where the JSON cannot say it) is
shown in italics under the run's title: one paragraph, its line breaks read as spaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.report.common import Section, Writer, command_block, need, ratio, register, table

#: The note beside a run's results, shown under its title.
NOTES = "notes.md"


@dataclass(frozen=True)
class ConvergenceRuns(Section):
    """One section per run folder under ``convergence/`` (a folder without its JSON gets the skipped note); a
    note when there is no run at all."""

    def write(self, w: Writer) -> None:
        conv = w.results / "convergence"
        runs = sorted(p.name for p in conv.iterdir() if p.is_dir()) if conv.is_dir() else []
        if not runs:
            w.lines += ["## Time to accuracy", "", f"_No runs under `{w.shown('convergence')}/`: section skipped._", ""]
            w.skipped.append("convergence/")
        for run in runs:
            w.section(f"convergence/{run}/convergence.json", f"Time to accuracy: {run}", convergence(w, run))


register(ConvergenceRuns(order=180, pattern="convergence/*/convergence.json"))


def run_note(w: Writer, run: str) -> str | None:
    """The run's ``notes.md`` as one line (None when it has none)."""
    path = w.results / "convergence" / run / NOTES
    return " ".join(path.read_text(encoding="utf-8").split()) if path.is_file() else None


def convergence(w: Writer, run: str) -> Callable[[Path, dict[str, Any]], list[str]]:
    """The renderer of one convergence run's folder (its tables, command and curves)."""

    def render(path: Path, d: dict[str, Any]) -> list[str]:
        need(d, path, "settings")
        note = run_note(w, run)
        lines: list[str] = [f"_{note}_", ""] if note else []
        if d.get("partial"):  # a stopped interleaved run's convergence.partial.json, kept as the result
            epochs = (d.get("args") or {}).get("epochs", "?")
            lines += [f"_Partial: the run was stopped after {d.get('epochs_done', '?')} of its {epochs} epochs (every run alike)._", ""]
        pngs = []
        for st in d["settings"]:
            need(st, path, "data", "batch_size", "optimizers")
            target = st.get("target_test_acc")
            lines += [
                f"{st['data']}, {st['batch_size']} per worker ({st.get('global_batch', '?')} in all, "
                f"{st.get('steps_per_epoch', '?')} steps per epoch); target: the reference's best test accuracy"
                + (f", {target:.1%}" if target is not None else "")
                + ".",
                "",
            ]
            second = st.get("second_reference")
            second_target = st.get("second_target_test_acc")
            if second is not None and second_target is not None:
                lines += [f"Second target: `{second}`'s best test accuracy, {second_target:.1%}.", ""]
            rows = []
            for spec, r in st["optimizers"].items():
                e, s = r.get("epochs_to_target"), r.get("seconds_to_target")
                row = [
                    f"`{spec}`",
                    f"{r['chosen_lr']:g}" if r.get("chosen_lr") is not None else "",
                    f"{r['best_test_acc']:.1%}" if r.get("best_test_acc") is not None else "",
                    f"{r['final_test_loss']:.3f}" if r.get("final_test_loss") is not None else "",
                    "not reached" if e is None else f"{e} ({ratio(r.get('epochs_ratio'))})",
                    "not reached" if s is None else f"{s:.1f} ({ratio(r.get('seconds_ratio'))})",
                ]
                if second is not None:
                    e2, s2 = r.get("epochs_to_second"), r.get("seconds_to_second")
                    row += ["not reached" if e2 is None else str(e2), "not reached" if s2 is None else f"{s2:.1f}"]
                rows.append(row)
            head = ["optimizer", "best LR of the grid", "best test acc", "final test loss", "epochs to target", "seconds to target"]
            lines += table(head + ([f"epochs to {second}'s", f"seconds to {second}'s"] if second is not None else []), rows)
            lines += diverged_runs(st) + per_seed_table(st) + issue_targets(st) + dho2_against_kfac(st) + kfac_pairs(st)
            pngs.append(f"convergence/{run}/convergence_{st['data']}_b{st['batch_size']}.png")
            pngs.append(f"convergence/{run}/convergence_{st['data']}_b{st['batch_size']}_per_seed.png")  # plot_curves.py --per-seed
        lines += command_block(
            d,
            "benchmarks.convergence",
            "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.convergence",
            out=w.shown(f"convergence/{run}"),
        )
        for png in pngs:
            lines += w.link(png, f"test accuracy and loss, {run}" + (", each seed" if png.endswith("_per_seed.png") else ""))
        return lines

    return render


def diverged_runs(st: dict[str, Any]) -> list[str]:
    """The chosen LR's runs that stopped on non-finite values (their mean curve ends where the first one stopped)."""
    notes = []
    for spec, r in st["optimizers"].items():
        point = next((p for p in (r.get("lr_grid") or {}).values() if p.get("lr") == r.get("chosen_lr")), None)
        runs = (point or {}).get("runs") or []
        stopped = [run for run in runs if run.get("diverged")]
        if stopped:
            seeds = ", ".join(f"seed {run.get('seed', '?')}: {run['diverged']}" for run in stopped)
            notes.append(f"- `{spec}` stopped on non-finite values in {len(stopped)} of {len(runs)} runs ({seeds}).")
    if not notes:
        return []
    return ["Diverged at the chosen LR (the mean curve ends at the first such epoch):", "", *notes, ""]


def _spread(seeds: dict[str, Any], key: str, fmt: str) -> str:
    """``median (min–max)`` of a per-seed value; '–' when a seed did not reach it (no median)."""
    lo_hi = seeds.get(f"{key}_range")
    median = seeds.get(f"{key}_median")
    values = seeds.get(key) or []
    missed = sum(v is None for v in values)
    text = "–" if median is None else format(median, fmt)
    if lo_hi is not None:
        text += f" ({format(lo_hi[0], fmt)}–{format(lo_hi[1], fmt)})"
    return text + (f", {missed} of {len(values)} not reached" if missed else "")


def per_seed_table(st: dict[str, Any]) -> list[str]:
    """Each optimizer's chosen LR over the seeds (median and range) and its LR grid with each point's best test accuracy."""
    rows = []
    for spec, r in st["optimizers"].items():
        seeds = r.get("per_seed")
        if not seeds:
            continue
        grid = ", ".join(
            f"{p['lr']:g}: {p['best_test_acc']:.1%}" if p.get("best_test_acc") is not None else f"{p['lr']:g}: –"
            for p in sorted(r["lr_grid"].values(), key=lambda p: p["lr"])
        )
        rows.append(
            [
                f"`{spec}`",
                grid,
                _spread(seeds, "best_test_acc", ".3f"),
                _spread(seeds, "final_test_loss", ".3f"),
                _spread(seeds, "epochs_to_target", "g"),
                _spread(seeds, "seconds_to_target", ".1f"),
                _spread(seeds, "epochs_to_second", "g"),
            ]
        )
    if not rows:
        return []
    head = ["optimizer", "LR grid (best test acc, mean over seeds)", "best test acc", "final test loss", "epochs to target"]
    head += ["seconds to target", "epochs to 2nd target"]
    return ["Per seed at the chosen LR: median (range) over the seeds.", "", *table(head, rows)]


def issue_targets(st: dict[str, Any]) -> list[str]:
    """Issue 27's targets for each K-FAC configuration: epochs to SGD's best no more than SOAP's, seconds no more than
    AdamW's, best test accuracy at least SOAP's, final test loss at most AdamW's (from the mean curves). Where a
    contender ran in several configurations (``soap`` and ``soap:weight_decay=0.05``), each target is held against
    its best value among them."""
    opts = st["optimizers"]

    def entries(name: str) -> dict[str, dict[str, Any]]:
        return {spec: r for spec, r in opts.items() if spec.partition(":")[0] == name}

    soap, adamw, kfac = entries("soap"), entries("adamw"), entries("spdkfac")
    if not soap or not adamw or not kfac:
        return []

    def lowest(among: dict[str, dict[str, Any]], key: str) -> Any:
        values = [r[key] for r in among.values() if r.get(key) is not None]
        return min(values) if values else None

    def at_most(mine: float | None, theirs: float | None) -> str:
        if mine is None:
            return "no (not reached)"
        if theirs is None:
            return "yes (theirs not reached)"
        return f"{'yes' if mine <= theirs else 'no'} ({mine:g} vs {theirs:g})"

    soap_spec = max(soap, key=lambda spec: soap[spec].get("best_test_acc") or -1.0)  # its most accurate configuration
    soap_acc, adamw_loss = soap[soap_spec].get("best_test_acc"), lowest(adamw, "final_test_loss")
    adamw_seconds = lowest(adamw, "seconds_to_target")
    rows = []
    for spec, r in kfac.items():
        acc, loss = r.get("best_test_acc"), r.get("final_test_loss")
        seeds = paired_text((r.get("paired_best_test_acc") or {}).get(soap_spec))
        rows.append(
            [
                f"`{spec}`",
                at_most(r.get("epochs_to_target"), lowest(soap, "epochs_to_target")),
                at_most(
                    None if r.get("seconds_to_target") is None else round(r["seconds_to_target"], 1),
                    None if adamw_seconds is None else round(adamw_seconds, 1),
                ),
                "–" if acc is None or soap_acc is None else f"{'yes' if acc >= soap_acc else 'no'} ({acc:.1%} vs {soap_acc:.1%}{seeds})",
                "–" if loss is None or adamw_loss is None else f"{'yes' if loss <= adamw_loss else 'no'} ({loss:.3f} vs {adamw_loss:.3f})",
            ]
        )
    head = ["K-FAC configuration", "epochs to target ≤ SOAP's", "seconds to target ≤ AdamW's", "best acc ≥ SOAP's"]
    head += ["final test loss ≤ AdamW's"]
    several = len(soap) > 1 or len(adamw) > 1
    return [
        "Issue 27's targets, per K-FAC configuration (mean curves over the seeds; the best accuracy also seed by seed, "
        "paired: the mean difference ± its standard error in points, and wins–ties–losses)"
        + (f"; each against the contender's best value over its configurations (best accuracy: `{soap_spec}`)" if several else "")
        + ":",
        "",
        *table(head, rows),
    ]


#: Per-seed values compared between K-FAC configurations: (key of ``per_seed``, label, scale, format).
PAIRED_KEYS = (
    ("best_test_acc", "best test acc (points)", 100.0, "+.2f"),
    ("final_test_loss", "final test loss", 1.0, "+.4f"),
    ("epochs_to_second", "epochs to the 2nd target", 1.0, "+.2f"),
    ("seconds_to_second", "seconds to the 2nd target", 1.0, "+.2f"),
)


def kfac_pairs(st: dict[str, Any]) -> list[str]:
    """In a run that leaves layers out of K-FAC in some configuration (``skip_layers=``: attention, depthwise
    convolutions), each later K-FAC configuration against the first, and each K-FAC configuration against the
    run's first ``adamw`` entry when it has one, seed by seed (same seed: same initialisation and data order): the
    mean difference ± its standard error over the seeds where both have a value."""
    kfac = {spec: r for spec, r in st["optimizers"].items() if spec.partition(":")[0] == "spdkfac" and r.get("per_seed")}
    if len(kfac) < 2 or not any("skip_layers=" in spec for spec in kfac):
        return []
    base_spec = next(iter(kfac))
    pairs = [(spec, base_spec) for spec in list(kfac)[1:]]
    adamw = next((spec for spec, r in st["optimizers"].items() if spec.partition(":")[0] == "adamw" and r.get("per_seed")), None)
    if adamw is not None:
        pairs += [(spec, adamw) for spec in kfac]
    rows = []
    for spec, other in pairs:
        mine, theirs = st["optimizers"][spec]["per_seed"], st["optimizers"][other]["per_seed"]
        if mine.get("seeds") != theirs.get("seeds"):
            continue
        row = [f"`{spec}` − `{other}`"]
        for key, _, scale, fmt in PAIRED_KEYS:
            diffs = [scale * (a - b) for a, b in zip(mine.get(key) or [], theirs.get(key) or []) if a is not None and b is not None]
            if not diffs:
                row.append("–")
                continue
            mean = sum(diffs) / len(diffs)
            se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5 if len(diffs) > 1 else None
            row.append(f"{format(mean, fmt)}" + ("" if se is None else f" ± {se:.2g}") + f" ({len(diffs)} seeds)")
        rows.append(row)
    if not rows:
        return []
    return [
        "",
        "K-FAC configurations against each other"
        + (f" and against `{adamw}`" if adamw is not None else "")
        + ", seed by seed (the row's value minus the other's: the mean difference ± its standard error):",
        "",
        *table(["pair", *(label for _, label, _, _ in PAIRED_KEYS)], rows),
    ]


def paired_text(p: dict[str, Any] | None) -> str:
    """``; per seed +0.02 ± 0.12 points, 3–1–2`` (benchmarks.convergence.paired_difference of best accuracies), or nothing."""
    if not p:
        return ""
    se = "" if p.get("standard_error") is None else f" ± {p['standard_error'] * 100:.2f}"
    return f"; per seed {p['mean'] * 100:+.2f}{se} points, {p['wins']}–{p['ties']}–{p['losses']}"


def dho2_against_kfac(st: dict[str, Any]) -> list[str]:
    """The DHO2 paper's claim, per DHO2 entry and K-FAC configuration: K-FAC's epochs and seconds to the target over
    DHO2's (above 1: DHO2 is faster; the paper reports 1.5–2x), from the mean curves, with DHO2's seconds per epoch
    and the part of them its eigenpair refreshes take."""
    opts = st["optimizers"]
    dho2 = {spec: r for spec, r in opts.items() if spec.partition(":")[0] in ("dho2", "dho2-wa")}
    kfac = {spec: r for spec, r in opts.items() if spec.partition(":")[0] == "spdkfac"}
    if not dho2 or not kfac:
        return []

    def over(theirs: float | None, mine: float | None, fmt: str) -> str:
        if mine is None:
            return "neither reached it" if theirs is None else f"DHO2 did not reach it (K-FAC: {theirs:{fmt}})"
        if theirs is None:
            return f"K-FAC did not reach it (DHO2: {mine:{fmt}})"
        return f"{theirs / mine:.2f}x ({theirs:{fmt}} / {mine:{fmt}})"

    rows = []
    for name, d in dho2.items():
        epoch_s, refresh_s = d.get("mean_epoch_s"), d.get("mean_refresh_s")
        per_epoch = "–" if epoch_s is None else f"{epoch_s:.1f}" + ("" if refresh_s is None else f" ({refresh_s:.1f})")
        for spec, k in kfac.items():
            rows.append(
                [
                    f"`{name}`",
                    f"`{spec}`",
                    over(k.get("epochs_to_target"), d.get("epochs_to_target"), "g"),
                    over(k.get("seconds_to_target"), d.get("seconds_to_target"), ".1f"),
                    per_epoch,
                ]
            )
    head = ["DHO2", "K-FAC configuration", "K-FAC's epochs to target / DHO2's", "K-FAC's seconds to target / DHO2's"]
    head += ["DHO2's s/epoch (refresh)"]
    return [
        "The DHO2 paper's claim (1.5–2x faster than K-FAC to a given accuracy), at this target (mean curves over the seeds):",
        "",
        *table(head, rows),
    ]
