"""benchmarks/drop_in.py: the step-kind arithmetic, and a tiny real run on 2 torchrun workers that renders."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
from launch import run_workers

from benchmarks.drop_in import BASELINE, amortised, memory_split, step_kind

ROOT = Path(__file__).resolve().parents[2]


def test_step_kinds_follow_the_schedule():
    assert [step_kind(s, 2, 4) for s in range(8)] == ["decomposition", "plain", "factor", "plain"] * 2
    assert [step_kind(s, 10, 100) for s in (0, 10, 90, 99, 100)] == ["decomposition", "factor", "factor", "plain", "decomposition"]


def test_amortised_mean_counts_each_kind_by_its_share():
    means = {"decomposition": 100.0, "factor": 10.0, "plain": 1.0}
    # one decomposition step, 9 factor steps and 90 plain ones per 100 steps
    assert amortised(means, 10, 100) == pytest.approx((100.0 + 9 * 10.0 + 90 * 1.0) / 100)
    assert amortised(means, 1, 1) == pytest.approx(100.0)  # every step a decomposition step
    assert amortised(means, 2, 4) == pytest.approx(sum(means[step_kind(s, 2, 4)] for s in range(4)) / 4)


def test_memory_split_reads_either_librarys_names():
    assert memory_split({"A": 4, "G": 6, "A_inv": 8, "G_inv": 12}) == (10, 20)
    assert memory_split({"a_factors": 3, "g_factors": 5, "a_inverses": 7, "g_inverses": 9, "total": 24}) == (8, 16)


@pytest.mark.multiprocess
def test_a_tiny_run_measures_every_system_per_step_kind_and_renders(tmp_path):
    systems = ["sgd-ddp", "spdkfac-ddp", "spdkfac-bare", "spdkfac-pre-ddp"]
    if importlib.util.find_spec("kfac") is not None:
        systems.append("kaisa-ddp")
    fsdp = hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard")
    if fsdp:
        systems += ["sgd-fsdp", "spdkfac-fsdp"]
    out = tmp_path / "drop_in_tiny.json"
    args = ["-m", "benchmarks.drop_in", "--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2"]
    run_workers("torch", 2, [*args, "--iters", "2", "--warmup", "1", "--systems", *systems, "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["kinds"] == ["decomposition", "plain", "factor", "plain"] * 2  # the warm-up cycle left out
    by = {r["system"]: r for r in data["table"]}
    assert list(by) == systems
    sgd = statistics.fmean(data["samples"][BASELINE])
    for name in [name for name in systems if not name.startswith("sgd-")]:
        row, xs = by[name], data["samples"][name]
        script_sgd = statistics.fmean(data["samples"]["sgd-fsdp"]) if name.endswith("-fsdp") else sgd
        assert len(xs) == 8
        assert all(x > 0 for x in xs)
        assert {k: v["n"] for k, v in row["kinds"].items()} == {"decomposition": 2, "factor": 2, "plain": 4}
        assert row["kinds"]["decomposition"]["mean"] == pytest.approx(statistics.fmean([xs[0], xs[4]]))
        assert row["every_step_s"] == row["kinds"]["decomposition"]["mean"]
        assert row["amortised_s"] == pytest.approx(amortised({k: v["mean"] for k, v in row["kinds"].items()}, 10, 100))
        assert row["vs_sgd_amortised"] == pytest.approx(row["amortised_s"] / script_sgd)
        cycles = row["vs_sgd_amortised_cycles"]
        assert cycles["n"] == 2
        assert cycles["min"] <= cycles["median"] <= cycles["max"]
        memory = row["memory"]
        assert memory["factors_mb"]["max"] >= memory["factors_mb"]["min"] > 0
        assert memory["decompositions_mb"]["max"] > 0
    assert set(by[BASELINE]["memory"]) == {"parameters_mb"}
    assert "kinds" not in by[BASELINE]
    # The DDP model and the bare one hold the same K-FAC state.
    assert by["spdkfac-ddp"]["memory"] == by["spdkfac-bare"]["memory"]
    if fsdp:  # each worker holds its rows of the parameters (about half), and K-FAC's state whole
        assert "kinds" not in by["sgd-fsdp"]
        assert by["sgd-fsdp"]["vs_sgd_ddp"] == pytest.approx(statistics.fmean(data["samples"]["sgd-fsdp"]) / sgd)
        whole, rows = by["sgd-ddp"]["memory"]["parameters_mb"]["max"], by["sgd-fsdp"]["memory"]["parameters_mb"]
        assert 0.4 * whole < rows["min"] <= rows["max"] < 0.6 * whole
        assert by["spdkfac-fsdp"]["memory"]["factors_mb"] == by["spdkfac-ddp"]["memory"]["factors_mb"]
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_md

    text = results_md.build(tmp_path, tmp_path / "RESULTS.md")
    assert "## The optimizer in a DDP script: step kinds, every step and amortised, against SGD: tiny" in text
    assert "| `spdkfac-ddp` |" in text
    assert "torchrun --nproc_per_node 2 -m benchmarks.drop_in" in text
