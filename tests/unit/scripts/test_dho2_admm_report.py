"""benchmarks/dho2_admm.py and its RESULTS.md section: the ADMM comparison from convergence-benchmark results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.dho2_admm import main as dho2_admm_main

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("results_md", ROOT / "scripts" / "results_md.py")
results_md = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_md)


def _run(seed: int, accs: list[float], losses: list[float], diverged: str | None = None, outer=None) -> dict:
    epochs = [{"epoch": e + 1, "test_acc": a, "test_loss": lo, "seconds": 2.0 * (e + 1)} for e, (a, lo) in enumerate(zip(accs, losses))]
    run = {"seed": seed, "epochs": epochs, "diverged": diverged}
    if outer is not None:
        run["outer_steps"] = outer
    return run


def _entry(lr: float, runs: list[dict], others: dict | None = None) -> dict:
    """A convergence-benchmark optimizer entry whose mean curve is the runs' mean (all runs complete)."""
    grid = {str(lr): {"lr": lr, "runs": runs}, **(others or {})}
    n = len(runs[0]["epochs"])
    curve = [
        {k: sum(r["epochs"][e][k] for r in runs) / len(runs) for k in ("test_acc", "test_loss", "seconds")} | {"epoch": e + 1}
        for e in range(n)
    ]
    return {
        "lr_grid": grid,
        "chosen_lr": lr,
        "curve": curve,
        "best_test_acc": max(row["test_acc"] for row in curve),
        "final_test_loss": curve[-1]["test_loss"],
    }


def _probe(step: int, epoch: float, before: float, after: float) -> dict:
    return {
        "step": step,
        "epoch": epoch,
        "before": {"test_loss": before, "test_acc": 0.9},
        "after": {"test_loss": after, "test_acc": 0.5},
    }


@pytest.fixture
def results(tmp_path: Path) -> Path:
    setting = {"data": "digits", "batch_size": 32, "steps_per_epoch": 22}
    wa = [_run(s, [0.5, 0.8, 0.9], [1.0, 0.5, 0.3 + 0.01 * s]) for s in range(3)]
    dho2 = [
        _run(0, [0.6, 0.85, 0.92], [0.9, 0.4, 0.25], outer=[_probe(44, 2.0, 0.5, 0.6)]),
        _run(1, [0.6, 0.9, 0.91], [0.9, 0.4, 0.27], outer=[_probe(44, 2.0, 0.3, 0.5)]),
        _run(2, [0.4, 0.0, 0.1], [2.0, 9.0, 5.0], diverged="epoch 4: non-finite averaged gradient", outer=[_probe(44, 2.0, 0.4, 0.7)]),
    ]
    sgd = [_run(s, [0.3, 0.6, 0.85], [1.5, 0.9, 0.5]) for s in range(3)]
    dho2_entry = _entry(0.002, dho2[:2]) | {"lr_grid": {"0.002": {"runs": dho2}}}
    new = {"settings": [{**setting, "optimizers": {"dho2:admm_rule=proximal": dho2_entry, "dho2-wa:refresh_every=22": _entry(0.002, wa)}}]}
    old = {"settings": [{**setting, "optimizers": {"sgd": _entry(0.05, sgd)}}]}  # another run: no pairs with dho2-wa
    res = tmp_path / "results"
    for name, obj in (("new", new), ("old", old)):
        (res / "convergence" / name).mkdir(parents=True)
        (res / "convergence" / name / "convergence.json").write_text(json.dumps(obj))
    return res


def test_the_summary_pairs_each_seed_with_dho2_wa_and_averages_the_outer_steps(results: Path):
    files = f"{results}/convergence/new/convergence.json,{results}/convergence/old/convergence.json"
    assert dho2_admm_main(["--set", f"digits_b32={files}", "--out", str(results / "dho2_admm.json")]) == 0
    st = json.loads((results / "dho2_admm.json").read_text())["settings"]["digits_b32"]
    assert st["dho2_wa_best_test_acc"] == pytest.approx(0.9)
    assert st["sgd_best_test_acc"] == pytest.approx(0.85)
    m = st["methods"]["dho2:admm_rule=proximal"]
    assert m["nonfinite_stops"] == 1
    assert m["runs"] == 3
    assert [s["epochs_to_wa_best"] for s in m["per_seed"]] == [3, 2, None]
    paired = m["paired_vs_wa"]["best_test_acc"]  # seeds 0 and 1 (seed 2 stopped): +0.02 and +0.01
    assert paired["n"] == 2
    assert paired["mean"] == pytest.approx(0.015)
    assert paired["se"] == pytest.approx(0.005)
    assert m["paired_vs_wa"]["final_test_loss"]["mean"] == pytest.approx(((0.25 - 0.30) + (0.27 - 0.31)) / 2)
    outer = m["outer_steps"][0]  # over the three seeds' probes
    assert (outer["before_test_loss"], outer["after_test_loss"]) == (pytest.approx(0.4), pytest.approx(0.6))
    assert outer["next_epoch_test_loss"] == pytest.approx((0.25 + 0.27 + 5.0) / 3)  # epoch 3, one epoch after the step
    assert m["epochs_to_sgd_best"] == 2
    assert st["methods"]["sgd"]["paired_vs_wa"]["best_test_acc"]["n"] == 0


def test_the_section_renders_the_comparison(results: Path, tmp_path: Path):
    files = f"{results}/convergence/new/convergence.json,{results}/convergence/old/convergence.json"
    dho2_admm_main(["--set", f"digits_b32={files}", "--out", str(results / "dho2_admm.json")])
    text = results_md.build(results, tmp_path / "RESULTS.md")
    start = text.index("## DHO2: the ADMM outer iteration")
    section = text[start : text.find("\n## ", start + 1)]
    assert "### digits_b32: digits, 32 per worker (22 steps per epoch)" in section
    assert "| `dho2:admm_rule=proximal` | 0.002: 74.3% → 0.002 | 91.5% | 3 | 0.260 | 1 of 3 |" in section  # grid: (92 + 91 + 40) / 3
    assert "| 1 of 3 | +1.50 ± 0.50 (n=2) pts |" in section
    assert "| `dho2:admm_rule=proximal` | 44 (epoch 2) | 0.400 | 0.600 | 90.0% → 50.0% | 1.840 |" in section
