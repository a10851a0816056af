"""The main job over seeds: SPD-KFAC's final test loss against SGD's (``main_job_seeds.json``, benchmarks/main_job_seeds.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders("main_job_seeds.json", "The main job over seeds: SPD-KFAC's final test loss against SGD's", order=160, optional=True)
def main_job_seeds(path: Path, d: dict[str, Any]) -> list[str]:
    """The main job per seed: each configuration's final test loss and best test accuracy, the target against SGD, the curves."""
    need(d, path, "configs", "seeds", "runs")
    names = list(d["configs"])
    seeds = [str(s) for s in d["seeds"]]
    args = {name: " ".join(extra) or "(defaults)" for name, extra in d["configs"].items()}
    lines = [
        f"`spdkfac.train --data digits --epochs {d.get('epochs', '?')}` on {d.get('world_size', '?')} workers, one run per "
        "configuration and seed (the seed also draws the train/test split). Configurations (the arguments each adds):",
        "",
        *table(["configuration", "arguments"], [[f"`{n}`", f"`{args[n]}`"] for n in names]),
        "Final test loss (best test accuracy):",
        "",
    ]
    head = ["seed", *(f"`{n}`" for n in names)]
    rows = []
    for seed in seeds:
        cells = []
        for n in names:
            s = d["runs"].get(n, {}).get(seed, {}).get("summary")
            cells.append("–" if s is None else f"{s['final_test_loss']:.4f} ({s['best_test_acc']:.1%})")
        rows.append([seed, *cells])
    lines += table(head, rows)
    for name, t in d.get("targets", {}).items():
        per_seed = t["per_seed"]
        verdicts = ", ".join(f"seed {s}: {'yes' if v['final_loss_at_most_sgd'] else '**no**'}" for s, v in per_seed.items())
        every = "yes" if t["final_loss_at_most_sgd_every_seed"] else "**no**"
        worst = t.get("worst_final_loss_over_sgd")
        margin = "" if worst is None else f"; at most {worst:.2f}x SGD's on any seed"
        lines += [f"`{name}`: final test loss ≤ SGD's for every seed: {every} ({verdicts}{margin}).", ""]
    aborted = [f"`{n}` seed {seed} ({r['exit_status']})" for n, per in d["runs"].items() for seed, r in per.items() if r.get("exit_status")]
    if aborted:
        lines += ["Runs that trained every epoch but exited with a non-zero status: " + ", ".join(aborted) + ".", ""]
    epochs = max((len(r["curve"]) for per in d["runs"].values() for r in per.values()), default=0)
    curve_rows = [
        [f"`{n}`", seed, *(f"{row['test_loss']:.3f}" for row in d["runs"][n][seed]["curve"])]
        for n in names
        for seed in seeds
        if seed in d["runs"].get(n, {})
    ]
    lines += ["Test loss per epoch:", "", *table(["configuration", "seed", *map(str, range(epochs))], curve_rows)]
    return lines + command_block(d, "benchmarks.main_job_seeds", "python -m benchmarks.main_job_seeds")
