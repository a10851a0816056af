"""DHO2's ADMM outer iteration against DHO2-WA (and the DHO2 paper's comparison) from convergence-benchmark results.

    python -m benchmarks.dho2_admm \\
        --set mnist5k_b256=benchmarks/results/convergence/mnist5k_b256_admm/convergence.json,benchmarks/results/convergence/mnist5k_b256_dho2/convergence.json \\
        --set digits_b32_2w=benchmarks/results/convergence/digits_b32_admm_2w_wide/convergence.json,benchmarks/results/convergence/digits_b32_admm_2w/convergence.json \\
        --out benchmarks/results/dho2_admm.json

Each ``--set`` names one setting (data set and per-worker batch) and the
``benchmarks.convergence`` result files it draws on (the same data, split,
batch and seeds; an optimizer spec found in several files is taken from the
first). Per optimizer, at its chosen learning rate: best test accuracy,
final test loss and the epochs to DHO2-WA's best test accuracy (the mean
curve's), per seed and as the paired per-seed difference to DHO2-WA (mean
and standard error; only for optimizers in DHO2-WA's file); the runs that stopped on a non-finite value; the test
loss just before and just after each ADMM outer step (the convergence
benchmark's probe) and at the end of that epoch; and epochs and seconds to
SGD's best test accuracy (seconds from different files were measured on a
shared machine at different times: compare them within a file).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import RESULTS, save_json
from .report.common import load

__all__ = ["main", "summarise"]


def _mean_se(values: list[float]) -> dict[str, float | None]:
    """Mean and standard error of the mean (None with fewer than two values)."""
    if not values:
        return {"mean": None, "se": None}
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "se": se}


def _reach(rows: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    for row in rows:
        if row["test_acc"] >= target - 1e-12:
            return int(row["epoch"]), float(row["seconds"])
    return None, None


def _runs(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return list(entry["lr_grid"][_lr_key(entry)]["runs"])


def _lr_key(entry: dict[str, Any]) -> str:
    chosen = float(entry["chosen_lr"])
    return next(k for k in entry["lr_grid"] if math.isclose(float(k), chosen))


def _mean_best(runs: list[dict[str, Any]]) -> float | None:
    """Mean over the runs of their best test accuracy (runs without an epoch left out)."""
    bests = [max(e["test_acc"] for e in r["epochs"]) for r in runs if r["epochs"]]
    return statistics.fmean(bests) if bests else None


def _outer_steps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over the seeds of the test loss and accuracy just before / after each outer step, and the test loss at the end
    of the next epoch (one epoch after the step, as the authors' code measures it)."""
    steps: list[dict[str, Any]] = []
    probes = [r.get("outer_steps") or [] for r in runs]
    for i in range(min((len(p) for p in probes), default=0)):
        rows = [p[i] for p in probes]
        next_end = [math.ceil(row["epoch"] - 1e-9) + (1 if float(row["epoch"]).is_integer() else 0) for row in rows]
        ends = [r["epochs"][e - 1] for r, e in zip(runs, next_end) if len(r["epochs"]) >= e]
        steps.append(
            {
                "step": rows[0]["step"],
                "epoch": rows[0]["epoch"],
                "before_test_loss": statistics.fmean(row["before"]["test_loss"] for row in rows),
                "after_test_loss": statistics.fmean(row["after"]["test_loss"] for row in rows),
                "before_test_acc": statistics.fmean(row["before"]["test_acc"] for row in rows),
                "after_test_acc": statistics.fmean(row["after"]["test_acc"] for row in rows),
                "next_epoch_test_loss": statistics.fmean(e["test_loss"] for e in ends) if len(ends) == len(rows) else None,
                "seeds": len(rows),
            }
        )
    return steps


def summarise(name: str, files: Sequence[Path]) -> dict[str, Any]:
    """One setting's comparison from its convergence result files (see the module docstring)."""
    entries: dict[str, tuple[dict[str, Any], str]] = {}
    setting: dict[str, Any] | None = None
    for path in files:
        data = load(path)
        for st in data["settings"]:
            setting = setting or st
            for spec, entry in st["optimizers"].items():
                entries.setdefault(spec, (entry, str(path)))
    assert setting is not None, f"{name}: no settings in {files}"
    wa_spec = next((s for s in entries if s.partition(":")[0] == "dho2-wa"), None)
    sgd_spec = next((s for s in entries if s.partition(":")[0] == "sgd"), None)
    if wa_spec is None:
        raise SystemExit(f"{name}: no dho2-wa runs in {', '.join(map(str, files))}")
    wa_target = float(entries[wa_spec][0]["best_test_acc"])
    sgd_target = None if sgd_spec is None else float(entries[sgd_spec][0]["best_test_acc"])
    wa_runs = {r["seed"]: r for r in _runs(entries[wa_spec][0])}
    methods: dict[str, Any] = {}
    for spec, (entry, source) in entries.items():
        runs = _runs(entry)
        per_seed = []
        for r in runs:
            accs = [e["test_acc"] for e in r["epochs"]]
            per_seed.append(
                {
                    "seed": r["seed"],
                    "best_test_acc": max(accs) if accs else None,
                    "final_test_loss": r["epochs"][-1]["test_loss"] if r["epochs"] else None,
                    "epochs_to_wa_best": _reach(r["epochs"], wa_target)[0],
                    "diverged": r.get("diverged"),
                }
            )
        paired: dict[str, Any] = {}
        for key in ("best_test_acc", "final_test_loss"):
            diffs = []
            for row in per_seed if source == entries[wa_spec][1] else []:  # pairs only within one run of the benchmark
                ref = wa_runs.get(row["seed"])
                if ref is None or row["diverged"] or ref.get("diverged") or row[key] is None:
                    continue
                ref_value = max(e["test_acc"] for e in ref["epochs"]) if key == "best_test_acc" else ref["epochs"][-1]["test_loss"]
                diffs.append(row[key] - ref_value)
            paired[key] = {**_mean_se(diffs), "n": len(diffs)}
        curve = entry["curve"]
        sgd_epochs, sgd_seconds = (None, None) if sgd_target is None else _reach(curve, sgd_target)
        methods[spec] = {
            "source": source,
            "chosen_lr": entry["chosen_lr"],
            "grid": {lr: _mean_best(g["runs"]) for lr, g in entry["lr_grid"].items()},
            "best_test_acc": entry["best_test_acc"],
            "final_test_loss": entry["final_test_loss"],
            "epochs_to_wa_best": _reach(curve, wa_target)[0],
            "epochs_to_sgd_best": sgd_epochs,
            "seconds_to_sgd_best": sgd_seconds,
            "nonfinite_stops": sum(1 for r in runs if r.get("diverged")),
            "runs": len(runs),
            "per_seed": per_seed,
            "paired_vs_wa": paired,
            "outer_steps": _outer_steps(runs),
            "test_loss_curve": [row["test_loss"] for row in curve],
        }
    return {
        "data": setting["data"],
        "batch_size": setting["batch_size"],
        "steps_per_epoch": setting["steps_per_epoch"],
        "files": [str(p) for p in files],
        "dho2_wa": wa_spec,
        "dho2_wa_best_test_acc": wa_target,
        "sgd": sgd_spec,
        "sgd_best_test_acc": sgd_target,
        "methods": methods,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", required=True, help="NAME=convergence.json[,convergence.json...]")
    ap.add_argument("--out", default=str(RESULTS / "dho2_admm.json"))
    args = ap.parse_args(argv)
    settings = {}
    for item in args.set:
        name, eq, files = item.partition("=")
        if not eq or not files:
            ap.error(f"--set {item!r}: write NAME=file[,file...]")
        settings[name] = summarise(name, [Path(f) for f in files.split(",")])
    command = "python -m benchmarks.dho2_admm " + " ".join(f"--set {s}" for s in args.set) + f" --out {args.out}"
    out = Path(args.out)
    save_json({"command": command, "settings": settings}, out.name, out.parent)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
