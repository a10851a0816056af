"""The training job: data errors, an ImageFolder run, exact --resume, and a 2-worker torchrun run."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from launch import ROOT, require_horovod, run_workers

from spdkfac import train
from spdkfac.train.args import parse_args
from spdkfac.train.imagefolder import ImageFolderError, scan_image_folder


def _image_folder(root, classes=("cat", "dog"), per_class=8, size=12):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for ci, name in enumerate(classes):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(per_class):
                arr = (torch.rand(size, size, 3, generator=g) * 80 + 120 * ci).clamp(0, 255).to(torch.uint8)
                Image.fromarray(arr.numpy()).save(d / f"{i}.png")
    return root


def test_image_folder_errors(tmp_path):
    with pytest.raises(ImageFolderError, match="does not exist"):
        scan_image_folder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageFolderError, match="no class sub-directories"):
        scan_image_folder(tmp_path / "empty")
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    (tmp_path / "noimg" / "a" / "notes.txt").write_text("x")
    with pytest.raises(ImageFolderError, match=r"no images .*\['a'\]"):
        scan_image_folder(tmp_path / "noimg")
    root = _image_folder(tmp_path / "data")
    with pytest.raises(ImageFolderError, match="different classes"):
        scan_image_folder(root / "val", classes=["cat", "cow"])


def test_malformed_directory_exits_with_message(tmp_path, capsys):
    root = _image_folder(tmp_path / "data")
    (root / "train" / "cat" / "0.png").write_bytes(b"not a png")
    from spdkfac.train.imagefolder import ImageFolder

    with pytest.raises(ImageFolderError, match="cannot read image"):
        ImageFolder(root / "train", 8)[0]
    with pytest.raises(SystemExit, match="neither 'digits', 'mnist5k', 'pycode', 'pycode-words', 'synthetic' nor an existing directory"):
        train.main(["--data", str(tmp_path / "nope"), "--backend", "single"])


@pytest.mark.slow
def test_image_folder_training_runs(tmp_path):
    root = _image_folder(tmp_path / "data")
    out = tmp_path / "run"
    row = train.main(
        [
            "--data",
            str(root),
            "--model",
            "cifar_resnet20",
            "--image-size",
            "8",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--backend",
            "single",
            "--out-dir",
            str(out),
            "--quiet",
            "--optimizer",
            "spdkfac",
            "--damping",
            "0.03",
        ]
    )
    assert 0.0 <= row["test_acc"] <= 1.0
    assert row["train_loss"] > 0
    rows = list(csv.DictReader((out / "log.csv").read_text().splitlines()))
    assert len(rows) == 1
    assert (out / "checkpoint.pt").is_file()


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    common = ["--data", "digits", "--backend", "single", "--quiet", "--batch-size", "64"]
    full = train.main([*common, "--epochs", "2", "--out-dir", str(tmp_path / "full")])
    # Interrupt after epoch 0 of a 2-epoch run: rerun with the checkpoint of epoch 0 and --resume.
    part = tmp_path / "part"
    train.main([*common, "--epochs", "2", "--out-dir", str(part)])
    ref = torch.load(part / "checkpoint.pt")
    first = train.main([*common, "--epochs", "2", "--out-dir", str(tmp_path / "ep0"), "--stop-after", "1"])
    assert first["epoch"] == 0
    resumed = train.main([*common, "--epochs", "2", "--out-dir", str(tmp_path / "ep0"), "--resume"])
    assert resumed["epoch"] == 1
    assert resumed["test_acc"] == full["test_acc"]
    assert resumed["train_loss"] == full["train_loss"]
    got = torch.load(tmp_path / "ep0" / "checkpoint.pt")
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert len(list(csv.DictReader((tmp_path / "ep0" / "log.csv").read_text().splitlines()))) == 2


@pytest.mark.slow
def test_kfac_schedule_and_accumulation_resume_exactly(tmp_path):
    """--damping-decay / --freq-scale (KFACParamScheduler, checkpointed) and --accumulation-steps: --resume is exact."""
    common = [
        "--data",
        "digits",
        "--backend",
        "single",
        "--quiet",
        "--batch-size",
        "64",
        "--epochs",
        "3",
        "--damping",
        "0.02",
        "--damping-decay",
        "0.5",
        "--damping-decay-epochs",
        "1",
        "--freq-scale",
        "2",
        "--freq-scale-epochs",
        "2",
        "--inv-update-freq",
        "2",
        "--accumulation-steps",
        "2",
    ]
    full = train.main([*common, "--out-dir", str(tmp_path / "full")])
    train.main([*common, "--out-dir", str(tmp_path / "part"), "--stop-after", "1"])
    after_first = torch.load(tmp_path / "part" / "checkpoint.pt")
    assert after_first["kfac_scheduler"]["epoch"] == 1
    assert after_first["optimizer"]["param_groups"][0]["damping"] == 0.01
    resumed = train.main([*common, "--out-dir", str(tmp_path / "part"), "--resume"])
    assert resumed["train_loss"] == full["train_loss"]
    assert resumed["test_acc"] == full["test_acc"]
    ref, got = (torch.load(tmp_path / d / "checkpoint.pt") for d in ("full", "part"))
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["kfac"]["update_freqs"] == [2, 4]
    assert got["kfac_scheduler"] == ref["kfac_scheduler"]


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        train.main(["--data", "digits", "--backend", "single", "--resume", "--out-dir", str(tmp_path / "none")])


@pytest.mark.multiprocess
def test_two_worker_torchrun_training(tmp_path):
    # Two epochs: K-FAC's running averages start from the identity, so its first epoch is SGD-like (45% here).
    out = run_workers(
        "torch",
        2,
        [
            "-m", "spdkfac.train", "--backend", "torch", "--data", "digits", "--epochs", "2", "--quiet",
            "--out-dir", str(tmp_path / "run"), "--trace", "3",
        ],
    )  # fmt: skip
    assert "2 worker(s) via torch" in out
    assert "epoch   1" in out
    rows = list(csv.DictReader((tmp_path / "run" / "log.csv").read_text().splitlines()))
    assert float(rows[-1]["test_acc"]) > 0.5
    # --trace: both ranks' steps in one file, with the fused factor all-reduces between them
    assert "trace of 3 step(s), 2 rank(s)" in out
    events = json.loads((tmp_path / "run" / "trace.json").read_text())["traceEvents"]
    iterations = [(e["pid"], e["name"]) for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert sorted(pid for pid, _ in iterations) == [0, 0, 0, 1, 1, 1]
    assert {pid for pid, _ in iterations} == {e["pid"] for e in events if e.get("cat") == "factor all-reduce"}


def test_trace_records_the_steps_asked_for_once_the_fusion_plan_is_made(tmp_path, capsys):
    """One process: the steps after the profiled factor steps (4 here: one warm-up, three timed), in trace.json; and
    a run resumed with --trace (a run-time option, not one that changes the training)."""
    out = tmp_path / "run"
    common = ["--data", "digits", "--backend", "single", "--batch-size", "128", "--epochs", "2", "--quiet", "--out-dir", str(out)]
    train.main([*common, "--stop-after", "1", "--trace", "3"])  # (11 steps per epoch)
    assert f"trace of 3 step(s), 1 rank(s): {out / 'trace.json'}" in capsys.readouterr().out
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X" and e["tid"] == 0] == ["iteration 5", "iteration 6", "iteration 7"]
    assert {e["name"] for e in events if e["ph"] == "X" and e["tid"] == 3} >= {"precondition", "update"}
    train.main([*common, "--resume", "--trace", "2"])
    assert "trace of 2 step(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "error"), [(["--trace", "0"], "--trace must be >= 1"), (["--optimizer", "dho2", "--trace", "3"], "keeps none")]
)
def test_trace_flags_that_cannot_record_are_an_error(flags, error, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert error in capsys.readouterr().err


@pytest.mark.multiprocess
def test_horovod_launch_script_trains_with_the_chosen_cycle_time(tmp_path):
    """scripts/launch_horovod.sh end to end: 2 Horovod workers, CYCLE_MS reaching Horovod, a bad value refused."""
    require_horovod()
    script = ROOT / "scripts" / "launch_horovod.sh"
    env = dict(
        os.environ,
        NP="2",
        CYCLE_MS="20",
        PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
        HOROVODRUN=shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]),
    )
    args = ["--data", "digits", "--epochs", "2", "--quiet", "--out-dir", str(tmp_path / "run")]
    run = subprocess.run(["bash", str(script), *args], env=env, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 worker(s) via horovod (cycle 20 ms)" in run.stdout
    assert float(list(csv.DictReader((tmp_path / "run" / "log.csv").read_text().splitlines()))[-1]["test_acc"]) > 0.5
    bad = subprocess.run(
        ["bash", str(script), *args], env=dict(env, CYCLE_MS="fast"), check=False, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "CYCLE_MS must be a number" in bad.stderr


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.slow
def test_mixed_precision_training(tmp_path, capsys, amp):
    row = train.main(
        [
            "--data",
            "digits",
            "--backend",
            "single",
            "--quiet",
            "--batch-size",
            "64",
            "--epochs",
            "2",
            "--amp",
            amp,
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path / "amp"),
        ]
    )
    assert f"({amp} autocast)" in capsys.readouterr().out
    assert row["test_acc"] > 0.5
    scaler_state = torch.load(tmp_path / "amp" / "checkpoint.pt")["grad_scaler"]
    assert (scaler_state is not None) == (amp == "fp16")


@pytest.mark.parametrize(
    "flags",
    [
        ["--distribute-preconditioning"],
        ["--damping", "0.01"],
        ["--inv-update-freq", "10"],
        ["--damping-decay", "0.5"],
        ["--freq-scale-epochs", "3"],
        ["--eigen-refresh", "warm"],
        ["--ekfac-update", "adam"],
    ],
)
def test_kfac_flags_with_sgd_are_an_error(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--optimizer", "sgd", *flags])
    assert exc.value.code == 2
    assert f"{flags[0]} only apply to the K-FAC optimizers" in capsys.readouterr().err
    assert parse_args(["--optimizer", "spdkfac", *flags]).optimizer == "spdkfac"


def test_damping_and_kl_clip_defaults_per_data_set():
    """The main job (digits) runs with its measured damping and KL clip; other data with the paper's; a given value wins."""
    from spdkfac.train.args import DIGITS_DAMPING, PAPER_DAMPING

    digits = parse_args(["--data", "digits"])
    assert (digits.damping, digits.kl_clip) == (DIGITS_DAMPING, 1e-4) == (0.1, 1e-4)
    other = parse_args(["--data", "synthetic"])
    assert (other.damping, other.kl_clip) == (PAPER_DAMPING, 0.001) == (0.003, 0.001)
    assert parse_args(["--data", "digits", "--damping", "0.003"]).damping == 0.003
    assert parse_args(["--data", "digits", "--optimizer", "sgd"]).optimizer == "sgd"  # the default is no --damping given


def test_ekfac_with_adam_in_its_eigenbasis_trains_and_resumes_exactly(tmp_path, capsys):
    """--compute-method ekfac --ekfac-update adam (with --base adamw) reaches the optimizer, a resumed run continues it
    bit for bit, and resuming with another --ekfac-update (another state) is refused, naming the flag."""
    common = ["--data", "digits", "--backend", "single", "--quiet", "--batch-size", "64", "--epochs", "2", "--kl-clip", "0"]
    common += ["--compute-method", "ekfac", "--base", "adamw", "--ekfac-update", "adam", "--ekfac-decay", "0.8"]
    common += ["--factor-update-freq", "5", "--inv-update-freq", "5"]
    full = train.main([*common, "--out-dir", str(tmp_path / "full")])
    assert full["test_acc"] > 0.5  # it trains (2 epochs of digits)
    train.main([*common, "--out-dir", str(tmp_path / "part"), "--stop-after", "1"])
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert ckpt["args"]["ekfac_update"] == "adam"
    resumed = train.main([*common, "--out-dir", str(tmp_path / "part"), "--resume"])
    assert (resumed["train_loss"], resumed["test_acc"]) == (full["train_loss"], full["test_acc"])
    changed = [("natural" if prev == "--ekfac-update" else a) for prev, a in zip(["", *common], common)]
    assert changed.count("natural") == 1
    with pytest.raises(SystemExit, match="--ekfac-update cannot change"):
        train.main([*changed, "--out-dir", str(tmp_path / "part"), "--resume", "--allow-changed-args"])
