"""This project's eigen and inverse methods beside KAISA's, in one run (``vs_kaisa*.json``, benchmarks/vs_kaisa.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, ratio, renders, table


def warm_refreshes(counts: dict[str, Any] | None) -> str:
    """``92% warm; full eigh in 1 of 10 iterations (1 scheduled, 0 on drift)`` for a warm system, else blank."""
    if not counts or counts.get("warm_share") is None:
        return ""
    scheduled = counts["iterations_with_full"] - counts["iterations_with_drift_fallback"]
    return (
        f"{100 * counts['warm_share']:.0f}% warm; full `eigh` in {counts['iterations_with_full']} of {counts['iterations']} "
        f"iterations ({scheduled} by schedule only, {counts['iterations_with_drift_fallback']} on the residual check)"
    )


KIND_ORDER = ("plain", "factor", "decomposition", "decomposition_warm", "decomposition_full")


def amortised_table(rows: list[dict[str, Any]], a: dict[str, Any]) -> list[str]:
    """Where factors and decompositions are not every iteration: each kind of iteration's mean and the schedule's
    amortised mean built from them (empty for an every-iteration run)."""
    if not any("amortised_s" in r for r in rows):
        return []
    kinds = [k for k in KIND_ORDER if any(k in r.get("kinds", {}) for r in rows)]
    body = []
    for r in rows:
        cells = [f"{r['kinds'][k]['mean']:.2f} (n={r['kinds'][k]['n']})" if k in r.get("kinds", {}) else "" for k in kinds]
        vs = r.get("vs_kaisa-eigen_amortised")
        amortised = f"{r['amortised_s']:.2f}" if "amortised_s" in r else "not all kinds measured"
        body.append([f"`{r['system']}`", *cells, amortised, "" if vs is None else f"{vs:.2f}x"])
    f, i = a["update_freq"]
    return [
        f"Per kind of iteration (mean seconds): plain, factors only, decomposition (a warm system's: warm — the "
        f"residual check's fallbacks included — or a full `eigh` by schedule). The schedule's amortised mean per "
        f"iteration is built from them: per {i} iterations one decomposition, {i // f - 1} factor iterations and "
        f"{i - i // f} plain ones, the warm system's decompositions a full `eigh` once in 10 (the optimizer's "
        "default) whatever `--eigen-full-every` measured one.",
        "",
        *table(["system", *(k.replace("_", " ") for k in kinds), "amortised (s)", "KAISA eigen / row (amortised)"], body),
    ]


def title(rel: Path) -> str:
    """``vs_kaisa_<suffix>.json``'s title."""
    suffix = rel.stem.removeprefix("vs_kaisa").strip("_")
    if suffix.startswith("lr"):  # an extra run at another learning rate than the training one
        suffix = f"at learning rate {suffix[2:]}"
    return "Eigen and inverse methods beside KAISA's, in one run" + (f": {suffix}" if suffix else "")


@renders("vs_kaisa*.json", title, order=60)
def vs_kaisa(path: Path, d: dict[str, Any]) -> list[str]:
    """This project's eigen (exact, warm) and inverse methods beside KAISA's, measured in one run: seconds and ratios."""
    need(d, path, "table", "args")
    a = d["args"]
    kaisa = d.get("kaisa") or {}
    specs = d.get("specs", {})
    memopt = any(r["system"] == "kaisa-eigen-memopt" for r in d["table"])  # (a column only where it ran)
    bases = [("kaisa-eigen", "median"), ("kaisa-eigen", "mean")] + [("kaisa-eigen-memopt", s) for s in ("median", "mean") if memopt]
    bases.append(("kaisa-inverse", "mean"))
    rows = []
    for r in d["table"]:
        ratios = [ratio(r.get(f"vs_{b}_{s}"), *(r.get(f"vs_{b}_{s}_interval") or (None, None))) for b, s in bases]
        rows.append([f"`{r['system']}`", f"{r['median']:.2f}", f"{r['mean']:.2f}", *ratios, warm_refreshes(r.get("refreshes"))])
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} per "
        f"worker, SGD learning rate {a.get('lr', 1e-4):g} (momentum 0.9), factors every {a['update_freq'][0]} and decompositions every {a['update_freq'][1]} iteration(s), damping "
        f"{a.get('damping')}, factor decay {a.get('factor_decay')}, KL-clip {a.get('kl_clip')} for every system. "
        f"{a.get('rounds', '?')} round(s); in each, every system in turn (the order rotates) is built, warmed up "
        f"({a.get('warmup', '?')} iterations) and measured ({a.get('iters', '?')} iterations). KAISA: `kfac` "
        f"{kaisa.get('version', 'not run')}, `KFACPreconditioner` with `grad_worker_fraction=1` (COMM-OPT; "
        "`kaisa-eigen-memopt`: 1/P, MEM-OPT), the model in `DistributedDataParallel`, its other options at their "
        "defaults. `spdkfac-eigen-warm*`: a full `eigh` every "
        f"{a.get('eigen_full_every', '?')} refreshes, so the mean over a window that long is the amortised cost and the "
        "median is a warm iteration's. Ratios: the row's speed-up over KAISA's eigen (COMM-OPT, MEM-OPT) / inverse method "
        "(95% bootstrap interval); the machine was shared with other jobs, so compare the ratios, not the seconds.",
        "",
    ]
    if a.get("warmup_update_freq"):
        f, i = a["warmup_update_freq"]
        lines += [
            f"**Measured after {a['warmup']} iterations of training**: the warm-up ran factors every {f} and "
            f"decompositions every {i} iterations (a cheap way past the first iterations of training, where the "
            "factors move most), its last iteration already on the measured schedule, so the measured window starts "
            "one iteration after a decomposition, as every window of a long run does.",
            "",
        ]
    if d.get("note"):
        lines += [f"_{d['note']}_", ""]
    if d.get("partial"):
        lines += ["_The run was stopped before its end: the systems and rounds measured until then._", ""]
    names = {"kaisa-eigen": "KAISA eigen", "kaisa-eigen-memopt": "KAISA eigen MEM-OPT", "kaisa-inverse": "KAISA inverse"}
    header = ["system", "median (s)", "mean (s)", *(f"{names[b]} / row ({s})" for b, s in bases), "warm refreshes"]
    lines += table(header, rows)
    lines += [
        "Warm refreshes: the share of factor refreshes over the measured iterations that were warm, and how many "
        "of those iterations made a full `eigh` of some factor (by schedule; on the residual check).",
        "",
    ]
    lines += amortised_table(d["table"], a)
    measured = {r["system"] for r in d["table"]}
    if specs:
        lines += ["Systems: " + "; ".join(f"`{k}` = `{v}`" for k, v in specs.items() if k in measured) + ".", ""]
    out = None if path.name == "vs_kaisa.json" else f"benchmarks/results/{path.name}"  # the default needs no --out
    return lines + command_block(d, "benchmarks.vs_kaisa", "torchrun --nproc_per_node 2 -m benchmarks.vs_kaisa", out)
