"""The training job never loses work: protected run directories, checked resumption, damaged checkpoints.

One process, real training on digits (a few seconds per run).
"""

from __future__ import annotations

import csv

import pytest
import torch

from spdkfac import train
from spdkfac.train.checkpoint import LATEST, PREVIOUS, CheckpointError, load_checkpoint, newest_valid
from spdkfac.train.data import Dataset, ShardedLoader

COMMON = ["--data", "digits", "--backend", "single", "--quiet", "--batch-size", "128", "--epochs", "2"]


def _run(out, *extra):
    return train.main([*COMMON, "--out-dir", str(out), *extra])


@pytest.mark.slow
def test_an_existing_run_is_never_overwritten_without_being_told(tmp_path):
    out = tmp_path / "run"
    _run(out, "--checkpoint-every", "4")
    log_before = (out / "log.csv").read_text()
    ckpt_before = (out / LATEST).read_bytes()
    with pytest.raises(SystemExit, match=r"already holds a run.*--resume.*--overwrite"):
        _run(out)
    assert (out / "log.csv").read_text() == log_before
    assert (out / LATEST).read_bytes() == ckpt_before
    row = _run(out, "--overwrite")
    assert row["epoch"] == 1
    for name in (LATEST, PREVIOUS):  # replaced: no checkpoint of the old run (which had --checkpoint-every) is left
        assert torch.load(out / name, weights_only=False)["args"]["checkpoint_every"] is None
    assert len(list(csv.DictReader((out / "log.csv").read_text().splitlines()))) == 2


def test_an_unwritable_out_dir_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match="cannot write to --out-dir"):
        _run(blocker / "run")
    assert "epoch" not in capsys.readouterr().out  # refused up front, not after an epoch


@pytest.mark.slow
def test_resuming_with_changed_arguments_names_them_and_refuses(tmp_path, capsys):
    out = tmp_path / "run"
    train.main([*COMMON, "--out-dir", str(out), "--stop-after", "1"])
    with pytest.raises(SystemExit, match=r"--epochs: 2 in the checkpoint, 3 now.*--lr: 0.05 in the checkpoint, 0.1 now"):
        train.main([*COMMON[:-1], "3", "--lr", "0.1", "--out-dir", str(out), "--resume"])
    row = train.main([*COMMON[:-1], "3", "--out-dir", str(out), "--resume", "--allow-changed-args"])
    assert row["epoch"] == 2
    assert "resuming with changed arguments, applied: --epochs" in capsys.readouterr().out


def test_a_checkpoint_of_another_optimizer_is_refused_with_the_reason(tmp_path):
    out = tmp_path / "run"
    train.main([*COMMON, "--out-dir", str(out), "--stop-after", "1", "--optimizer", "sgd"])
    with pytest.raises(SystemExit, match=r"--optimizer: 'sgd' in the checkpoint, 'spdkfac' now"):
        _run(out, "--resume")


@pytest.mark.slow
def test_damaged_checkpoints_name_the_file_and_auto_resume_falls_back(tmp_path):
    full = _run(tmp_path / "full")
    out = tmp_path / "run"
    _run(out, "--checkpoint-every", "5")  # 11 steps per epoch: the previous checkpoint is step 20, mid-epoch 1
    data = (out / LATEST).read_bytes()
    (out / LATEST).write_bytes(data[: len(data) // 2])  # truncated, as by a crash while writing without the rename
    with pytest.raises(CheckpointError, match=f"{LATEST}: not a readable checkpoint"):
        load_checkpoint(out / LATEST)
    with pytest.warns(UserWarning, match="skipping unusable checkpoint"):
        path, state = newest_valid(out)
    assert path.name == PREVIOUS
    assert state["position"]["step"] == 20
    assert state["position"]["samples"] > 0
    with pytest.warns(UserWarning, match="skipping unusable checkpoint"):
        resumed = _run(out, "--resume", "auto")
    # Resumed mid-epoch from step 20: the same parameters and the same epoch metrics as the uninterrupted run.
    assert resumed["train_loss"] == full["train_loss"]
    assert resumed["test_acc"] == full["test_acc"]
    got, ref = torch.load(out / LATEST)["model"], torch.load(tmp_path / "full" / LATEST)["model"]
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert [r["epoch"] for r in csv.DictReader((out / "log.csv").read_text().splitlines())] == ["0", "1"]
    # Every checkpoint unusable: an error naming the newest, never a silent fresh start.
    (out / LATEST).write_bytes(b"")
    (out / PREVIOUS).write_bytes(b"garbage")
    with (
        pytest.warns(UserWarning, match="skipping unusable checkpoint"),
        pytest.raises(SystemExit, match=f"cannot resume: .*{LATEST}: the checkpoint file is empty"),
    ):
        _run(out, "--resume", "auto")


@pytest.mark.slow
def test_resume_auto_without_a_checkpoint_starts_afresh_and_plain_resume_refuses(tmp_path):
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        _run(tmp_path / "none", "--resume")
    assert _run(tmp_path / "fresh", "--resume", "auto")["epoch"] == 1


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 3), (3, 2), (1, 4)])
def test_sharded_epoch_resumed_on_another_worker_count_sees_every_sample_once(before, after):
    data = Dataset(torch.arange(103).float()[:, None], torch.arange(103), 103)
    batch = 4
    seen = []
    loaders = [ShardedLoader(data, batch, rank, before, seed=7) for rank in range(before)]
    steps_done = 3
    for loader in loaders:
        loader.set_epoch(5)
        seen += [int(v) for _, (x, y) in zip(range(steps_done), loader) for v in y]
    start = steps_done * batch * before
    for rank in range(after):
        loader = ShardedLoader(data, batch, rank, after, seed=7)
        loader.set_epoch(5, start=start)
        seen += [int(v) for _, y in loader for v in y]
    assert len(seen) == len(set(seen))  # nothing repeated
    order = torch.randperm(103, generator=torch.Generator().manual_seed(12)).tolist()
    assert sorted(seen) == sorted(order[: len(seen)])  # a prefix of the epoch's permutation: nothing skipped
    assert len(seen) > 103 - after * batch - after  # only the tail too short for a full batch on every worker is left
