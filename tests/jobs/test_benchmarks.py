"""The iteration-time benchmark on real worker processes: variants one after another and interleaved."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import require_horovod, run_workers

from benchmarks import vs_kaisa
from benchmarks.main_job_seeds import main_job_kfac
from benchmarks.report import build
from spdkfac.step.compiled_hooks import TAPS_AVAILABLE

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, *args: str) -> None:
    """``python -m benchmarks.<module> ARGS`` from the repository root; a failure shows its output."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("interleave", [False, True])
def test_iteration_time_measures_every_variant(tmp_path, interleave):
    out = tmp_path / "it.json"
    variants = ["sgd", "spdkfac", "dkfac", "-pipe+lbp"]  # an ablation name that starts with a dash, too
    args = [
        "-m",
        "benchmarks.iteration_time",
        "--model",
        "cifar_resnet20",
        "--resolution",
        "8",
        "--batch-size",
        "2",
        "--iters",
        "4",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--update-freq",
        "2",
        "8",
        "--variants",
        *variants,
        "--out",
        str(out),
    ]
    output = run_workers("torch", 2, args + (["--interleave"] if interleave else []))
    data = json.loads(out.read_text())
    assert [row["variant"] for row in data["table"]] == variants
    for row in data["table"]:
        assert len(data["samples"][row["variant"]]) == 4 * 2  # measured iterations x rounds, warm-up left out
        parts = sum(row[p] for p in ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other"))
        assert parts == pytest.approx(row["mean_s"], rel=1e-6)
        kfac = row["variant"] != "sgd"
        # factors every 2 iterations, inverses every 8: no inversion in the window, so 1/8 of one is charged
        assert (row["FactorComp"] > 0) == kfac
        assert (row["InverseComp"] > 0) == kfac
        # recorded inside their parts, for the simulator's per-phase check: hooks in FF&BP, the rest in Other
        assert (row["Hooks"] > 0) == kfac
        assert (row["Precondition"] > 0) == kfac
        assert row["Update"] > 0
        assert row["Hooks"] < row["FF&BP"]
        assert row["Precondition"] + row["Update"] <= row["Other"] + 1e-9
        # steps 1-4 of each round, factors on steps 2 and 4: samples 1, 3, 5, 7 are factor-update iterations
        its = data["samples"][row["variant"]]
        assert row["factor_steps_n"] == row["other_steps_n"] == 4
        assert row["factor_steps_s"] == pytest.approx(sum(its[1::2]) / 4)
        assert row["other_steps_s"] == pytest.approx(sum(its[::2]) / 4)
    alternations = re.findall(r"iteration (\d+)/5[^:]*: sgd [\d.]+s, spdkfac [\d.]+s, dkfac [\d.]+s, -pipe\+lbp [\d.]+s", output)
    assert alternations == (["1", "2", "3", "4", "5"] * 2 if interleave else [])
    progress = re.findall(r"round (\d)/2 (\S+) +[\d.]+ ms/iter", output)  # each variant's mean, once per round
    assert progress == [(r, v) for r in ("1", "2") for v in variants]
    samples = data["samples"]
    for row in data["table"]:
        for key, (num, den) in {"SP1": ("dkfac", row["variant"]), "vs_sgd": (row["variant"], "sgd")}.items():
            if row["variant"] in ("dkfac" if key == "SP1" else "sgd"):
                assert f"{key}_lo" not in row  # no interval of a variant against itself
                continue
            point = sum(samples[num]) / sum(samples[den])  # rank 0's ratio, inside its own bootstrap interval
            assert row[f"{key}_lo"] <= point <= row[f"{key}_hi"]
    rss = [row["rss_mb"] for row in data["table"]]
    assert all(r != r for r in rss) if interleave else all(r > 0 for r in rss)  # NaN: no per-variant RSS when interleaved


def test_interleaved_iterations_last_until_their_slowest_rank():
    from benchmarks.iteration_time import slowest_rank
    from spdkfac.comm.inprocess import run_ranks

    own = {0: [1.0, 3.0, 2.0], 1: [2.0, 1.0, 2.5]}
    results = run_ranks(2, lambda backend: slowest_rank(backend, own[backend.rank], "slowest"))
    assert results == [[2.0, 3.0, 2.5]] * 2


def test_split_by_factor_step():
    from benchmarks.common import split_by_factor_step

    # warm-up 1, then steps 1..10 in each of two rounds; factors every 5 iterations: steps 5 and 10
    samples = [1.0] * 4 + [9.0] + [1.0] * 4 + [7.0]
    split = split_by_factor_step(samples * 2, warmup=1, iters=10, factor_freq=5)
    assert split == {"factor_steps": {"mean": 8.0, "n": 4}, "other_steps": {"mean": 1.0, "n": 16}}
    assert split_by_factor_step([2.0, 3.0], warmup=1, iters=2, factor_freq=10) == {"other_steps": {"mean": 2.5, "n": 2}}
    with pytest.raises(ValueError, match="whole rounds"):
        split_by_factor_step([1.0] * 5, warmup=0, iters=2, factor_freq=2)


def test_rank_batch_is_the_same_per_rank_and_differs_between_ranks():
    from benchmarks.common import rank_batch

    state = torch.get_rng_state()
    x, y = rank_batch(1, 16, 8, channels=2, classes=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global random state (models, dropout) is left alone
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((16, 2, 8, 8), torch.float32, (16,), torch.int64)
    assert set(y.tolist()) <= set(range(5))
    again_x, again_y = rank_batch(1, 16, 8, channels=2, classes=5)
    assert torch.equal(again_x, x)
    assert torch.equal(again_y, y)
    other_x, other_y = rank_batch(0, 16, 8, channels=2, classes=5)
    assert not torch.equal(other_x, x)
    assert not torch.equal(other_y, y)
    seen: list[torch.Tensor] = []
    # classes as a function of the inputs (a model's output width): the same draws, the labels after the inputs
    width_x, width_y = rank_batch(1, 16, 8, channels=2, classes=lambda inputs: seen.append(inputs) or 5)
    assert torch.equal(seen[0], x)
    assert torch.equal(width_x, x)
    assert torch.equal(width_y, y)


def test_ratio_interval():
    from benchmarks.common import ratio_interval

    assert ratio_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], paired=True) == (2.0, 2.0)
    # A drift common to both (interleaved rounds) cancels when paired, not when resampled independently.
    drift = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    paired = ratio_interval([1.1 * d for d in drift], drift, paired=True)
    independent = ratio_interval([1.1 * d for d in drift], drift, paired=False)
    assert paired[0] == pytest.approx(1.1)
    assert paired[1] == pytest.approx(1.1)
    assert independent[0] < 1.0 < 1.2 < independent[1]
    # Medians ignore one outlier round that moves the mean ratio.
    outlier = [2.0] * 8 + [50.0]  # a median moves only if 5 of 9 draws hit the outlier (p < 0.3%)
    assert ratio_interval(outlier, [1.0] * 9, paired=True, statistic="median") == (2.0, 2.0)
    assert ratio_interval(outlier, [1.0] * 9, paired=True)[1] > 10
    with pytest.raises(ValueError, match="statistic"):
        ratio_interval([1.0, 2.0], [1.0, 2.0], paired=True, statistic="mode")
    with pytest.raises(ValueError, match="differ in number"):
        ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0], paired=True)
    with pytest.raises(ValueError, match="at least two"):
        ratio_interval([1.0], [1.0, 2.0], paired=False)


@pytest.mark.slow
def test_hook_overhead_times_non_factor_steps(tmp_path):
    """benchmarks/hook_overhead.py for real on a small model: it measures passes on which the hooks compute nothing."""
    out = tmp_path / "hooks.json"
    args = ["--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2", "--iters", "2", "--out", str(out)]
    run_benchmark("hook_overhead", *args)
    result = json.loads(out.read_text())
    assert result["args"]["model"] == "cifar_resnet20"
    assert result["plain"]["median"] > 0
    assert result["ratio"] == pytest.approx(result["hooked"]["median"] / result["plain"]["median"])


@pytest.mark.multiprocess
def test_agreement_cost_times_the_agreement_of_every_step(tmp_path):
    """benchmarks/agreement_cost.py for real (2 workers, a few steps): one agreement per step, its size and share recorded."""
    out = tmp_path / "agreement.json"
    args = ["--model", "mnist_cnn", "--batch-size", "4", "--iters", "3", "--warmup", "2", "--repeats", "2", "--out", str(out)]
    run_workers("torch", 2, ["-m", "benchmarks.agreement_cost", *args])
    result = json.loads(out.read_text())
    assert result["workers"] == 2
    assert result["agreements_per_step"] == 1.0
    assert result["agreement_entries"] > 4  # the presence flags, the two order hashes and their squares, the parts' reports
    assert result["step"]["n"] == 3
    assert result["share"]["min"] <= result["share"]["median"] <= result["share"]["max"]


@pytest.mark.multiprocess
def test_soak_keeps_replicas_identical_with_a_delayed_worker(tmp_path):
    """benchmarks/soak.py for real (2 workers, a short run): bitwise replicas, nothing left pending after step()."""
    out = tmp_path / "soak.json"
    run_workers("torch", 2, ["-m", "benchmarks.soak", "--steps", "200", "--every", "50", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["replicas_bitwise_identical"] is True
    assert result["steps"] == 200
    assert result["delayed_steps_on_last_rank"] > 0
    assert result["max_pending_grad_handles"] == 0
    assert result["max_pending_factor_allreduces"] == 0
    assert len(result["samples"]) == 4


@pytest.mark.multiprocess
def test_kaisa_fraction_measures_every_fraction_and_auto(tmp_path):
    out = tmp_path / "kaisa.json"
    args = ["-m", "benchmarks.kaisa_fraction", "measure", "--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2"]
    run_workers("torch", 2, [*args, "--iters", "2", "--warmup", "1", "--inv-update-freq", "5", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["fraction"] for r in data["measured"]] == ["2/2", "1/2", "auto"]
    assert [r["fraction"] for r in data["modelled"]] == ["1/2", "2/2"]
    full, half = data["measured"][0], data["measured"][1]
    assert half["kfac_mib_max"] < full["kfac_mib_max"] == full["kfac_mib_min"]  # one gradient worker holds less
    for r in data["measured"]:
        assert r["amortised_s"] == pytest.approx(r["step_s"] + r["decomposition_stage_s"] / 5)
    assert data["measured"][2]["auto_predicted_s"] is not None


@pytest.mark.slow
def test_kaisa_fraction_simulate_and_its_results_section(tmp_path):
    out = tmp_path / "kaisa_fraction_simulated.json"
    cmd = [sys.executable, "-m", "benchmarks.kaisa_fraction", "simulate", "--workers", "4", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    data = json.loads(out.read_text())
    for model in ("reference", "gpu-cluster"):
        rows = data["predicted"][f"{model}/4"]
        assert [r["fraction"] for r in rows] == ["1/4", "2/4", "4/4", "auto"]
        assert rows[0]["kfac_mib_mean"] < rows[1]["kfac_mib_mean"] < rows[2]["kfac_mib_mean"]  # memory grows with the fraction
        assert rows[-1]["chose"] in ("1/4", "2/4", "4/4")
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_md

    text = results_md.build(tmp_path, tmp_path / "RESULTS.md")
    assert "KAISA's grad_worker_fraction at scale (simulator)" in text
    assert "**reference, 4 workers** ('auto' chose" in text
    assert "gradient workers the iteration is" in text  # the trend from 1 to all gradient workers, beside KAISA's
    assert (tmp_path / "kaisa_fraction_simulated.png").stat().st_size > 0  # the trade-off plot, linked from the section
    assert "kaisa_fraction_simulated.png" in text


@pytest.mark.slow
def test_batched_decomposition_compares_one_batched_call_with_a_loop(tmp_path):
    """benchmarks/batched_decomposition.py for real: both timings per shape and the model totals add up."""
    args = ["--models", "resnext50_32x4d", "--methods", "inverse", "--repeats", "1", "--out", str(tmp_path)]
    run_benchmark("batched_decomposition", *args)
    result = json.loads((tmp_path / "batched_decomposition.json").read_text())
    shapes = {(r["blocks"], r["dim"]) for r in result["rows"]}
    assert shapes == {(32, d) for d in (4, 8, 16, 32, 36, 72, 144, 288)}  # ResNeXt-50's grouped 3x3 factors
    assert all(r["batched_s"] > 0 and r["per_block_s"] > 0 and "prediction_error" in r for r in result["rows"])
    (total,) = result["totals"]
    counts = {(32, 36): 3, (32, 4): 3, (32, 72): 4, (32, 8): 4, (32, 144): 6, (32, 16): 6, (32, 288): 3, (32, 32): 3}
    by_shape = {(r["blocks"], r["dim"]): r for r in result["rows"]}
    assert total["factors"] == 32
    assert total["batched_s"] == pytest.approx(sum(n * by_shape[s]["batched_s"] for s, n in counts.items()))


@pytest.mark.slow
def test_iteration_time_runs_every_variant_with_each_update_fusion(tmp_path):
    out = tmp_path / "fusion.json"
    args = ["--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2", "--iters", "2", "--warmup", "1"]
    args += ["--update-freq", "2", "4", "--variants", "sgd", "spdkfac", "--update-fusions", "none", "forward", "backward"]
    subprocess.run([sys.executable, "-m", "benchmarks.iteration_time", *args, "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    data = json.loads(out.read_text())
    assert [row["variant"] for row in data["table"]] == [
        "sgd",
        "sgd:update_fusion=forward",
        "sgd:update_fusion=backward",
        "spdkfac",
        "spdkfac:update_fusion=forward",
        "spdkfac:update_fusion=backward",
    ]
    assert data["args"]["variants"] == ["sgd", "spdkfac"]  # as given: the recorded command reruns the same


@pytest.mark.slow
def test_update_cost_times_the_update_pass(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2", "--iters", "2", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "benchmarks.update_cost", *args], cwd=ROOT, check=True, capture_output=True)
    data = json.loads(out.read_text())
    assert data["tensors"] > 0
    assert data["update_s"] > 0
    assert data["fwd_bwd_s"] > 0
    assert data["update_share"] == data["update_s"] / (data["fwd_bwd_s"] + data["update_s"])
    assert len(data["samples"]["update"]) == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_main_job_seeds_runs_the_main_job_per_configuration_and_seed(tmp_path):
    """benchmarks/main_job_seeds.py for real (one epoch, one seed): the main job's log per run and the target against SGD."""
    require_horovod()
    out = tmp_path / "seeds.json"
    args = ["--epochs", "1", "--seeds", "3", "--configs", "sgd", "spdkfac", "--out", str(out)]
    run_benchmark("main_job_seeds", *args)
    result = json.loads(out.read_text())
    assert result["configs"] == {"sgd": ["--optimizer", "sgd"], "spdkfac": main_job_kfac()}
    for name in ("sgd", "spdkfac"):
        run = result["runs"][name]["3"]
        assert [row["epoch"] for row in run["curve"]] == [0]
        assert run["summary"]["final_test_loss"] == run["curve"][0]["test_loss"] > 0
    kfac, sgd = (result["runs"][n]["3"]["summary"]["final_test_loss"] for n in ("spdkfac", "sgd"))
    assert result["targets"]["spdkfac"]["per_seed"]["3"]["final_loss_at_most_sgd"] == (kfac <= sgd)


def test_main_job_kfac_is_run_digits_own_line_and_a_valid_training_job(tmp_path):
    """The main job's K-FAC options come from scripts/run_digits.sh (one source); spdkfac.train takes them on digits."""
    from spdkfac.train.args import parse_args

    options = main_job_kfac()
    assert options[:2] == ["--compute-method", "ekfac"]
    args = parse_args(["--data", "digits", *options])
    assert (args.compute_method, args.base, args.ekfac_update, args.kl_clip, args.lr) == ("ekfac", "adamw", "adam", 0, 0.002)
    script = tmp_path / "run.sh"
    script.write_text("echo\nMAIN_JOB_KFAC=(--lr '0.5' --base adamw)\n")
    assert main_job_kfac(script) == ["--lr", "0.5", "--base", "adamw"]
    script.write_text("KFAC=(--lr 0.5)\n")
    with pytest.raises(ValueError, match="no MAIN_JOB_KFAC"):
        main_job_kfac(script)


@pytest.mark.parametrize(
    ("extra", "kept"), [([], True), (["--epochs", "3"], True), (["--optimizer", "sgd"], False), (["--optimizer=dho2"], False)]
)
def test_run_digits_adds_the_kfac_options_unless_an_optimizer_is_chosen(tmp_path, extra, kept):
    """scripts/run_digits.sh passes MAIN_JOB_KFAC before the user's arguments, and none with --optimizer (they are K-FAC's)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "scripts" / "run_digits.sh").write_text((ROOT / "scripts" / "run_digits.sh").read_text())
    (root / "scripts" / "setup.sh").write_text("true\n")  # no installer here
    fake = root / ".venv" / "bin" / "horovodrun"  # records its arguments instead of training
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(root / "scripts" / "run_digits.sh"), *extra], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (root / ".venv" / "bin" / "argv").read_text().splitlines()
    if extra:
        assert argv[-len(extra) :] == extra
    options = main_job_kfac()
    tail = argv[len(argv) - len(extra) - len(options) : len(argv) - len(extra)]
    assert (tail == options) is kept
    assert ("ekfac" in argv) is kept


def _kaisa_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("kfac") is not None


def _vs_kaisa(tmp_path, systems, rounds=2):
    """A tiny benchmarks.vs_kaisa run on 2 torchrun workers; its JSON."""
    out = tmp_path / "vs_kaisa.json"
    args = ["-m", "benchmarks.vs_kaisa", "--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "2"]
    args += ["--iters", "2", "--warmup", "1", "--rounds", str(rounds), "--eigen-full-every", "2", "--systems", *systems]
    run_workers("torch", 2, [*args, "--out", str(out)])
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vs_kaisa_alternates_this_projects_systems_and_renders(tmp_path):
    systems = ["spdkfac-eigen", "spdkfac-eigen-warm", "spdkfac-inverse"]
    data = _vs_kaisa(tmp_path, systems)
    assert [r["system"] for r in data["table"]] == systems
    assert [r["order"] for r in data["rounds"]] == [systems, systems[1:] + systems[:1]]  # the order rotates
    for r in data["table"]:
        its = data["samples"][r["system"]]
        assert len(its) == 2 * 2  # measured iterations x rounds, warm-up left out
        assert r["median"] == pytest.approx(sorted(its)[1] / 2 + sorted(its)[2] / 2)
        assert "vs_kaisa-eigen_mean" not in r  # no KAISA in this run: no ratio against it
    assert data["kaisa"] is None
    assert (
        data["specs"]["spdkfac-eigen-warm"]
        == "spdkfac:compute_method=eigen,eigen_refresh=warm,eigen_full_every=2,grad_worker_fraction=auto"
    )
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_md

    text = results_md.build(tmp_path, tmp_path / "RESULTS.md")
    assert "## Eigen and inverse methods beside KAISA's, in one run" in text
    assert "| `spdkfac-eigen-warm` |" in text
    assert "torchrun --nproc_per_node 2 -m benchmarks.vs_kaisa" in text
    warm = next(r for r in data["table"] if r["system"] == "spdkfac-eigen-warm")["refreshes"]  # counted per iteration
    assert warm["iterations"] == 4
    assert warm["warm"] + warm["full_scheduled"] + warm["full_drift"] == warm["refreshes"] > 0
    assert f"{100 * warm['warm_share']:.0f}% warm; full `eigh` in {warm['iterations_with_full']} of 4 iterations" in text
    assert "SGD learning rate 0.1 (momentum 0.9)" in text


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not _kaisa_installed(), reason="KAISA (kfac-pytorch) not installed: pip install --no-deps kfac-pytorch")
def test_vs_kaisa_measures_kaisa_beside_spdkfac(tmp_path):
    from benchmarks.common import stats

    data = _vs_kaisa(tmp_path, ["kaisa-eigen", "kaisa-inverse", "spdkfac-eigen-warm"], rounds=1)
    by = {r["system"]: r for r in data["table"]}
    base = stats(data["samples"]["kaisa-eigen"])
    for name in ("kaisa-inverse", "spdkfac-eigen-warm"):
        row = by[name]
        assert row["vs_kaisa-eigen_mean"] == pytest.approx(base["mean"] / row["mean"])
        assert row["vs_kaisa-eigen_median"] == pytest.approx(base["median"] / row["median"])
        lo, hi = row["vs_kaisa-eigen_mean_interval"]
        assert lo <= hi
    assert data["kaisa"]["version"]


def test_vs_kaisa_warms_up_on_its_own_schedule_and_measures_on_the_given_one():
    from types import SimpleNamespace

    from benchmarks.vs_kaisa import update_freq

    args = SimpleNamespace(update_freq=[1, 1], warmup_update_freq=None, warmup=101)
    assert update_freq(args, 0) == update_freq(args, 1) == 1
    args.warmup_update_freq = [10, 100]
    factor, decomposition = update_freq(args, 0), update_freq(args, 1)
    assert callable(factor)
    assert callable(decomposition)
    assert [factor(s) for s in (0, 99, 100, 101, 500)] == [10, 10, 1, 1, 1]  # the last warm-up step (100) is measured's
    assert [decomposition(s) for s in (0, 99, 100, 101)] == [100, 100, 1, 1]


def test_vs_kaisa_amortises_each_kind_of_iteration_over_the_schedule():
    from benchmarks.vs_kaisa import amortised, iteration_kind

    kinds = [iteration_kind(step, [10, 100], None) for step in range(200)]
    assert (kinds.count("decomposition"), kinds.count("factor"), kinds.count("plain")) == (2, 18, 180)
    assert (kinds[0], kinds[100], kinds[10], kinds[11]) == ("decomposition", "decomposition", "factor", "plain")
    counts = {"warm": 5, "full_scheduled": 0, "full_drift": 1}
    assert iteration_kind(100, [10, 100], counts) == "decomposition_warm"  # a fallback on the check is still a warm try
    assert iteration_kind(100, [10, 100], {**counts, "full_scheduled": 3}) == "decomposition_full"
    # per 100 iterations: 1 decomposition, 9 factor, 90 plain
    exact = {"decomposition": {"mean": 50.0}, "factor": {"mean": 5.0}, "plain": {"mean": 1.0}}
    assert amortised(exact, [10, 100], 10) == pytest.approx((50 + 9 * 5 + 90 * 1) / 100)
    warm = {"decomposition_full": {"mean": 50.0}, "decomposition_warm": {"mean": 20.0}, "factor": {"mean": 5.0}, "plain": {"mean": 1.0}}
    assert amortised(warm, [10, 100], 10) == pytest.approx(((50 + 9 * 20) / 10 + 9 * 5 + 90) / 100)
    assert amortised({"plain": {"mean": 1.0}, "factor": {"mean": 5.0}}, [10, 100], 10) is None  # no decomposition measured
    assert amortised({"decomposition": {"mean": 1.0}}, [1, 1], 10) == 1.0  # every iteration: the decomposition's


@pytest.mark.skipif(_kaisa_installed(), reason="KAISA is installed: the missing-dependency message cannot be shown")
def test_vs_kaisa_says_how_to_install_kaisa_when_missing(tmp_path):
    """(In this process: the refusal comes before any worker starts, from the arguments alone.)"""
    if importlib.util.find_spec("kfac") is not None:
        pytest.skip("KAISA (kfac-pytorch) is installed here")
    with pytest.raises(SystemExit, match="pip install --no-deps kfac-pytorch"):
        vs_kaisa.main(["--systems", "kaisa-eigen", "--out", str(tmp_path / "vs_kaisa.json")])


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh --device cpu --quick: every stage runs and records what the GPU run will."""
    out = tmp_path / "gpu_check.json"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out", str(out), "--tests-k", "cupy or bf16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["argv"] == ["--device", "cpu", "--quick", "--tests-k", "cupy or bf16"]  # the run's own output path left out
    stages = report["stages"]
    assert set(stages) == {"tests", "decompositions", "timing", "perfmodel", "simulate", "compiled"}
    assert not [s for s, v in stages.items() if "error" in v]
    # On the CPU the cupy comparison skips and the bf16 test runs: both outcomes read from pytest's report.
    outcomes = {t["name"]: t["outcome"] for t in stages["tests"]["tests"]}
    assert outcomes == {
        "test_cupy_and_torch_inverses_agree[dtype0]": "skipped",
        "test_cupy_and_torch_inverses_agree[dtype1]": "skipped",
        "test_bf16_autocast[small_net]": "passed",
        "test_bf16_autocast[mixed_net]": "passed",
    }
    dec = stages["decompositions"]
    assert dec["dims_measured"] == dec["dims"]
    assert set(dec["stage_s"]) == {"inverse/torch.linalg", "eigh/torch.linalg"}
    first, second = (stages["timing"]["batches"][str(b)] for b in (8, 16))
    assert {"sgd", "adamw", "kfac-inverse-amortised", "kfac-eigen", "kfac-eigen-warm"} <= set(first)
    assert set(second) >= {"sgd", "spdkfac-sgd", "kfac-inverse-amortised", "sgd-tf32", "kfac-inverse-amortised-tf32"}
    tf32, base = second["kfac-inverse-amortised-tf32"], second["sgd-tf32"]  # a TF32 row is relative to SGD under TF32
    assert tf32["vs_sgd_median"] == pytest.approx(tf32["median"] / base["median"])
    for name in ("kfac-inverse", "kfac-eigen", "kfac-eigen-warm"):
        row = first[name]
        assert row["n"] == 2
        assert row["vs_sgd_median"] > 0
        phases = row["phases_s"]
        assert phases["decompositions"] > 0
        assert phases["factors"] > 0
        assert phases["iteration"] >= sum(v for k, v in phases.items() if k != "iteration") - 1e-9
    vit = stages["timing"]["models"]["vit_s16_32"]  # the transformer, with K-FAC on an AdamW base beside
    assert vit["resolution"] == 32
    rows = vit["batches"]["8"]
    assert set(rows) >= {
        "sgd",
        "adamw",
        "kfac-inverse-amortised",
        "kfac-adamw-amortised",
        "spdkfac-sgd",
        "kfac-inverse-amortised-per-layer",
    }
    assert all(rows[n]["n"] == 4 and rows[n]["vs_sgd_median"] > 0 for n in ("adamw", "kfac-adamw-amortised"))
    compiled = stages["compiled"]  # compiled SGD to eager SGD's time, compiled K-FAC to compiled SGD's
    assert compiled["graph_breaks"] == {}
    assert compiled["unique_graphs"] == 2
    rows = compiled["rows"]
    assert rows["sgd-compiled"]["vs_sgd_median"] == pytest.approx(rows["sgd-compiled"]["median"] / rows["sgd"]["median"])
    assert rows["kfac-inverse-amortised"]["vs_sgd_median"] == pytest.approx(
        rows["kfac-inverse-amortised"]["median"] / rows["sgd"]["median"]
    )
    kfac = rows["kfac-inverse-amortised-compiled"]
    assert kfac["n"] == 4
    assert kfac["vs_sgd_median"] == pytest.approx(kfac["median"] / rows["sgd-compiled"]["median"])
    predictions = stages["simulate"]["predictions"]
    assert set(predictions) == {f"{w}:{v}" for w in (8, 16) for v in ("sgd", "dkfac", "mpdkfac", "spdkfac")}
    assert all(p["iteration"] > 0 for p in predictions.values())
    model = stages["perfmodel"]["model"]
    assert "inverse" in model
    assert "eigen" in model
    # each every-step configuration's phase iterations, drawn for Perfetto beside the JSON
    for name in ("kfac-inverse", "kfac-eigen", "kfac-eigen-warm"):
        trace = json.loads((tmp_path / first[name]["trace_file"]).read_text())
        assert sum(e["name"].startswith("iteration") for e in trace["traceEvents"] if e["ph"] == "X") == 2
    # the report renders what the card's run will write (RESULTS.md's section for it)
    results = tmp_path / "results"
    results.mkdir()
    (results / "gpu_check_cpu.json").write_text(out.read_text())
    text = build(results, tmp_path / "RESULTS.md")
    assert "compiled" in text


@pytest.mark.slow
def test_warm_accuracy_compares_each_warm_step_with_eigh_along_the_exact_run(tmp_path):
    """benchmarks/warm_accuracy.py for real: rounding only before the first refresh, more after, the steps with
    Rayleigh–Ritz (the block step and 'ritz') the lower."""
    out = tmp_path / "warm_accuracy.json"
    args = ["--model", "cifar_resnet20", "--resolution", "8", "--batch-size", "8", "--iters", "4", "--out", str(out)]
    run_benchmark("warm_accuracy", *args)
    rows = json.loads(out.read_text())["rows"]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    # all start from eigh (reordered)
    assert rows[0]["subspace"]["relative_error"] == rows[0]["ritz"]["relative_error"] == rows[0]["block"]["relative_error"] < 1e-5
    for r in rows[1:]:
        assert 0.0 < r["ritz"]["relative_error"] < r["subspace"]["relative_error"]
        assert 0.0 < r["block"]["relative_error"] < r["subspace"]["relative_error"]
        assert r["ritz"]["worst_layer"]
        assert r["block"]["worst_layer"]


@pytest.mark.slow
@pytest.mark.skipif(not TAPS_AVAILABLE, reason="this torch has no custom ops with effects (the hooks break the graph)")
def test_compile_cost_compiles_each_arm_once(tmp_path):
    """benchmarks/compile_cost.py for real on the digits CNN: the compiled K-FAC arm is one graph, compiled once."""
    out = tmp_path / "compile.json"
    args = ["--models", "digits_cnn", "--batch-size", "4", "--iters", "2", "--out", str(out)]
    run_benchmark("compile_cost", *args)
    model = json.loads(out.read_text())["models"]["digits_cnn"]
    assert model["kfac-compiled"]["graph_breaks"] == 0
    assert model["kfac-compiled"]["graphs"] == 1
    assert model["graphs_compiled_while_measuring"] == 0
    assert model["kfac-compiled-plain-hooks"]["graph_breaks"] > 0


@pytest.mark.slow
def test_conv_factor_times_both_routes_and_says_which_the_rule_takes(tmp_path):
    """benchmarks/conv_factor.py for real (small inputs): both routes timed per layer, the rule's route, the rows in
    parts against at once, equal to rounding."""
    out = tmp_path / "cf.json"
    run_benchmark("conv_factor", "--quick", "--iters", "2", "--threads", "1", "--out", str(out))
    layers = json.loads(out.read_text())["layers"]
    assert len(layers) == 11
    for row in layers.values():
        assert row["shared"]["n"] == row["im2col"]["n"] == 2
        assert row["shared_over_im2col"] == pytest.approx(row["shared"]["median"] / row["im2col"]["median"])
        assert row["rule_takes"] == ("shared" if row["shared_cost"] < row["im2col_multiply_adds"] else "im2col")
        assert row["max_relative_difference"] < 1e-5
    in_parts = json.loads(out.read_text())["in_parts"]
    assert len(in_parts) == 3
    for row in in_parts.values():
        assert row["parts"] > 1
        assert row["rows_bytes_per_part"] < row["rows_bytes_at_once"]
        assert row["in_parts"]["n"] == row["at_once"]["n"] == 2
        assert row["max_relative_difference"] < 1e-5
    grid = json.loads(out.read_text())["grid"]
    assert len(grid["cases"]) == 3
    assert grid["rule_takes_the_faster"] == sum(row["rule_takes_the_faster"] for row in grid["cases"].values())
    assert grid["log_time_lost"]["rule"] <= grid["log_time_lost"]["always_shared"] + grid["log_time_lost"]["always_im2col"]


@pytest.mark.slow
def test_transposed_conv_factor_times_both_grams_and_they_agree(tmp_path):
    """benchmarks/transposed_conv_factor.py for real (small inputs): both Grams timed per layer, equal to rounding."""
    out = tmp_path / "tcf.json"
    run_benchmark("transposed_conv_factor", "--quick", "--iters", "2", "--threads", "1", "--out", str(out))
    layers = json.loads(out.read_text())["layers"]
    assert len(layers) == 7
    for row in layers.values():
        assert row["classes"]["n"] == row["zero_filled"]["n"] == 2
        assert row["speedup"] == pytest.approx(row["zero_filled"]["median"] / row["classes"]["median"])
        assert row["max_relative_difference"] < 1e-5


@pytest.mark.slow
def test_stacked_preconditioning_times_both_arms_on_plain_steps(tmp_path):
    """benchmarks/stacked_preconditioning.py for real (a small model): both arms timed on the same plain steps."""
    out = tmp_path / "sp.json"
    run_benchmark("stacked_preconditioning", "--quick", "--steps", "6", "--threads", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["models"].values()
    assert row["per_layer"]["n"] == row["stacked"]["n"] == 4  # rounds 2-5 (the factor step is round 0)
    assert row["groups"] >= 2
    assert row["stacked_layers"] > row["groups"]
    assert row["ratio"] == pytest.approx(row["stacked"]["median"] / row["per_layer"]["median"])


@pytest.mark.slow
def test_shared_input_gram_times_both_arms_and_they_step_alike(tmp_path):
    """benchmarks/shared_input_gram.py for real (a tiny model): fewer Grams with the cache, bitwise the same steps."""
    out = tmp_path / "sig.json"
    run_benchmark("shared_input_gram", "--quick", "--steps", "2", "--threads", "1", "--out", str(out))
    models = json.loads(out.read_text())["models"]
    assert len(models) == 2
    for row in models.values():
        assert row["shared"]["n"] == row["apart"]["n"] == 2
        # Per block: q/k/v one Gram, o, gate/up one, down (against 7); the head's.
        assert row["grams_per_step"] == {"shared": 2 * 4 + 1, "apart": 2 * 7 + 1}
        assert row["parameters_bitwise_equal"] is True


@pytest.mark.slow
def test_wide_factors_times_both_arms_and_the_diagonal_holds_less(tmp_path):
    """benchmarks/wide_factors.py for real (a tiny model): only the vocabulary-wide factors are diagonal, and they hold less."""
    out = tmp_path / "wide.json"
    run_benchmark("wide_factors", "--quick", "--rounds", "2", "--threads", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["vocabularies"].values()
    dense, diagonal = row["dense"], row["diagonal"]
    assert {kind: s["n"] for kind, s in dense["seconds"].items()} == {"plain": 2, "factors": 2, "decompositions": 2}
    # The head's G (48 wide) and nothing else (the embedding's A is diagonal in both arms).
    assert sum("wider than max_factor_dim" in line for line in diagonal["summary"]) == 1
    assert not any("wider than max_factor_dim" in line for line in dense["summary"])
    assert row["memory_ratio"] > 1.0
    assert set(row["speedup"]) == {"plain", "factors", "decompositions", "amortised_10_100"}


def test_lora_finetune_summary_picks_each_arms_best_rate_and_the_epochs_to_adamws_best():
    """benchmarks/lora_finetune.summarise on made-up curves (no peft needed): the best rate by mean best accuracy
    (flagged at its grid's edge), the per-seed difference against AdamW with its standard error, and per seed the
    first epoch (and its seconds) reaching AdamW's best mean accuracy, None where never."""
    from benchmarks.lora_finetune import summarise

    def run(*acc: float) -> dict[str, list[float]]:
        return {"test_acc": list(acc), "seconds": [0.5 * (e + 1) for e in range(len(acc))]}

    runs = {
        "adamw": {"0.01": {"0": run(0.5, 0.8), "1": run(0.6, 0.7)}, "0.03": {"0": run(0.1, 0.2), "1": run(0.1, 0.2)}},
        "kfac-sgd": {
            "0.1": {"0": run(0.9, 0.95), "1": run(0.5, 0.6)},
            "0.3": {"0": run(0.7, 0.9), "1": run(0.76, 0.74)},
            "1.0": {"0": run(0.2, 0.3), "1": run(0.2, 0.3)},
        },
    }
    summary = summarise(runs, [0, 1])
    assert summary["target"] == pytest.approx(0.75)
    adamw, kfac = summary["adamw"], summary["kfac-sgd"]
    assert adamw["lr"] == 0.01
    assert adamw["lr_at_grid_edge"]
    assert kfac["lr"] == 0.3
    assert not kfac["lr_at_grid_edge"]
    assert kfac["best_acc"] == [0.9, 0.76]
    assert kfac["vs_adamw_mean"] == pytest.approx(((0.9 - 0.8) + (0.76 - 0.7)) / 2)
    assert kfac["vs_adamw_se"] == pytest.approx(abs(0.1 - 0.06) / 2)  # stdev of two values / sqrt(2)
    assert kfac["to_target"] == [{"epochs": 2, "seconds": 1.0}, {"epochs": 1, "seconds": 0.5}]
    assert adamw["to_target"] == [{"epochs": 2, "seconds": 1.0}, {"epochs": None, "seconds": None}]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (an optional dependency) is not installed")
def test_lora_finetune_runs_every_arm_and_renders(tmp_path):
    """benchmarks/lora_finetune.py --quick for real: every arm fine-tunes PEFT adapters, and RESULTS.md renders it."""
    out = tmp_path / "results" / "lora_finetune.json"
    run_benchmark("lora_finetune", "--quick", "--out", str(out))
    d = json.loads(out.read_text())
    assert set(d["summary"]) == {"target", "adamw", "kfac-adamw", "sgd", "kfac-sgd"}
    for arm in ("adamw", "kfac-adamw", "sgd", "kfac-sgd"):
        (run,) = next(iter(d["runs"][arm].values())).values()
        assert len(run["test_acc"]) == 2
        assert 0.0 <= min(run["test_acc"]) <= max(run["test_acc"]) <= 1.0
        assert 0.0 < run["seconds"][0] <= run["seconds"][1]
    assert "LoRA fine-tuning (PEFT)" in build(tmp_path / "results", tmp_path / "RESULTS.md")
