"""DHO2's ADMM outer iteration against DHO2-WA, and the DHO2 paper's comparison (``dho2_admm.json``, benchmarks/dho2_admm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import need, renders, table


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _paired(p: dict[str, Any], scale: float, fmt: str) -> str:
    """A paired per-seed difference as ``mean ± SE (n)``."""
    if p.get("mean") is None:
        return "–"
    se = "" if p.get("se") is None else f" ± {scale * p['se']:{fmt}}"
    return f"{scale * p['mean']:+{fmt}}{se} (n={p['n']})"


def _epochs(x: int | None) -> str:
    return "not reached" if x is None else str(x)


@renders("dho2_admm.json", "DHO2: the ADMM outer iteration against DHO2-WA (and the paper's comparison)", order=175, optional=True)
def dho2_admm(path: Path, d: dict[str, Any]) -> list[str]:
    """Per setting: each optimizer at its chosen LR against DHO2-WA (paired per seed), the test loss around each ADMM
    outer step, and epochs / seconds to SGD's best test accuracy."""
    need(d, path, "command", "settings")
    lines = [
        "Each optimizer at the best learning rate of its grid (mean best test accuracy over the seeds). Paired "
        "differences are per seed (same initialisation, split and batch order) against `dho2-wa`, mean ± standard "
        "error; a seed that stopped on a non-finite value is left out of the pairs. Epochs and seconds to a target "
        "are read off the mean curve over the seeds; seconds come from the result file named in the last column "
        "(a shared 2-core machine: compare seconds within one file). Story: [docs/dho2.md](../docs/dho2.md).",
        "",
        "```bash",
        d["command"],
        "```",
        "",
    ]
    for name, st in d["settings"].items():
        lines += [
            f"### {name}: {st['data']}, {st['batch_size']} per worker ({st['steps_per_epoch']} steps per epoch)",
            "",
            f"`dho2-wa`'s best test accuracy (the target of the fourth column): {_pct(st['dho2_wa_best_test_acc'])}; "
            f"SGD's: {_pct(st['sgd_best_test_acc'])}.",
            "",
        ]
        rows = []
        for spec, m in st["methods"].items():
            rows.append(
                [
                    f"`{spec}`",
                    ", ".join(f"{lr}: {_pct(acc)}" for lr, acc in m["grid"].items()) + f" → {m['chosen_lr']}",
                    _pct(m["best_test_acc"]),
                    _epochs(m["epochs_to_wa_best"]),
                    _num(m["final_test_loss"]),
                    f"{m['nonfinite_stops']} of {m['runs']}",
                    _paired(m["paired_vs_wa"]["best_test_acc"], 100, ".2f") + " pts",
                    _paired(m["paired_vs_wa"]["final_test_loss"], 1, ".3f"),
                    "–"
                    if st["sgd_best_test_acc"] is None
                    else f"{_epochs(m['epochs_to_sgd_best'])} / {_num(m['seconds_to_sgd_best'], '.1f')} s",
                    f"`{Path(m['source']).parent.name}`",
                ]
            )
        lines += table(
            [
                "optimizer",
                "LR grid (mean best acc) → chosen",
                "best test acc",
                "epochs to dho2-wa's best",
                "final test loss",
                "non-finite stops",
                "Δ best acc vs dho2-wa",
                "Δ final loss vs dho2-wa",
                "epochs / s to SGD's best",
                "file",
            ],
            rows,
        )
        outer = [(spec, m) for spec, m in st["methods"].items() if m["outer_steps"]]
        if outer:
            lines += [
                "Test loss around each ADMM outer step (mean over the seeds): just before (the inner loop's end "
                "w_a), just after (where the parameters continue from), and one epoch later.",
                "",
            ]
            rows = [
                [
                    f"`{spec}`",
                    f"{o['step']} (epoch {o['epoch']:g})",
                    _num(o["before_test_loss"]),
                    _num(o["after_test_loss"]),
                    f"{_pct(o['before_test_acc'])} → {_pct(o['after_test_acc'])}",
                    _num(o["next_epoch_test_loss"]),
                ]
                for spec, m in outer
                for o in m["outer_steps"]
            ]
            lines += table(["optimizer", "outer step at step", "before", "after", "test acc", "one epoch later"], rows)
    return lines
