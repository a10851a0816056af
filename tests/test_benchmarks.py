"""The iteration-time benchmark on real worker processes: variants one after another and interleaved."""
from __future__ import annotations

import json
import re

import pytest

from launch import run_workers


@pytest.mark.parametrize("interleave", [False, True])
def test_iteration_time_measures_every_variant(tmp_path, interleave):
    out = tmp_path / "it.json"
    variants = ["sgd", "spdkfac", "dkfac"]
    args = ["-m", "benchmarks.iteration_time", "--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2",
            "--iters", "4", "--warmup", "1", "--rounds", "2", "--update-freq", "2", "8",
            "--variants", *variants, "--out", str(out)]
    output = run_workers("torch", 2, args + (["--interleave"] if interleave else []))
    data = json.loads(out.read_text())
    assert [row["variant"] for row in data["table"]] == variants
    for row in data["table"]:
        assert len(data["samples"][row["variant"]]) == 4 * 2  # measured iterations x rounds, warm-up left out
        parts = sum(row[p] for p in ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other"))
        assert parts == pytest.approx(row["mean_s"], rel=1e-6)
        kfac = row["variant"] != "sgd"
        # factors every 2 iterations, inverses every 8: no inversion in the window, so 1/8 of one is charged
        assert (row["FactorComp"] > 0) == kfac and (row["InverseComp"] > 0) == kfac
    alternations = re.findall(r"iteration (\d+)/5[^:]*: sgd [\d.]+s, spdkfac [\d.]+s, dkfac [\d.]+s", output)
    assert alternations == (["1", "2", "3", "4", "5"] * 2 if interleave else [])
    rss = [row["rss_mb"] for row in data["table"]]
    assert all(r != r for r in rss) if interleave else all(r > 0 for r in rss)  # NaN: no per-variant RSS when interleaved
