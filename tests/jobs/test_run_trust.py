"""Checkpoints and run directories a user can trust (one process, real training on digits).

A file in a run directory is data, never code; damaged data is caught before
use and never replaces the last good checkpoint; a resumed run trains with the
values it reports; one job at a time holds a run directory; writes never
follow a symlink out of it.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch

from spdkfac import train
from spdkfac.train.checkpoint import LATEST, PREVIOUS, CheckpointError, content_digest, load_checkpoint, newest_valid, save_rotating
from spdkfac.train.run_dir import LOCK_NAME, RunLock

COMMON = ["--data", "digits", "--backend", "single", "--quiet", "--batch-size", "128", "--epochs", "2"]


def _run(out: Path, *extra: str) -> dict[str, float]:
    return train.main([*COMMON, "--out-dir", str(out), *extra])


class _Planted:
    """A pickle whose loading runs a command (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, marker: Path) -> None:
    torch.save({"model": {}, "optimizer": {}, "epoch": 0, "args": {}, "payload": _Planted(marker)}, path)


@pytest.mark.slow
def test_a_planted_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    _plant(evil, marker)
    with pytest.raises(CheckpointError, match="refused: the file holds Python objects"):
        load_checkpoint(evil)
    out = tmp_path / "run"
    _run(out, "--stop-after", "1", "--checkpoint-every", "4")
    _plant(out / LATEST, marker)
    with pytest.warns(UserWarning, match=f"{LATEST}: refused"):  # --resume auto: the previous checkpoint is used
        path, _ = newest_valid(out)
    assert path.name == PREVIOUS
    with pytest.warns(UserWarning, match="refused"):
        assert _run(out, "--resume", "auto")["epoch"] == 1
    _plant(out / LATEST, marker)
    _plant(out / PREVIOUS, marker)
    with pytest.warns(UserWarning, match="refused"), pytest.raises(SystemExit, match=r"cannot resume: .*refused"):
        _run(out, "--resume")
    assert not marker.exists()


def _flip_bytes_inside_a_weight(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    weight = next(v for k, v in state["model"].items() if k.endswith("weight") and v.numel() > 64)
    raw = bytearray(path.read_bytes())
    at = raw.find(weight.reshape(-1).numpy().tobytes()[:64])
    assert at > 0
    raw[at + 40 : at + 44] = b"\x7e\xff\x7e\xff"
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_flipped_bytes_are_caught_and_never_replace_the_last_good_checkpoint(tmp_path):
    full = _run(tmp_path / "full")
    out = tmp_path / "run"
    _run(out, "--checkpoint-every", "5", "--stop-after", "1")
    _flip_bytes_inside_a_weight(out / LATEST)
    with pytest.raises(CheckpointError, match=f"{LATEST}: damaged: its contents do not match the checksum"):
        load_checkpoint(out / LATEST)
    good = load_checkpoint(out / PREVIOUS)
    with pytest.warns(UserWarning, match="skipping unusable checkpoint") as seen:
        resumed = _run(out, "--resume", "auto", "--checkpoint-every", "5")
    messages = [str(w.message) for w in seen]
    assert any("skipping unusable checkpoint" in m and LATEST in m for m in messages), messages
    assert any("moved the damaged file" in m for m in messages), messages
    # Rotation kept the verified checkpoint: the damaged file was moved aside, not made the previous one.
    assert len(list(out.glob(f"{LATEST}.damaged-*"))) == 1
    for name in (LATEST, PREVIOUS):
        assert load_checkpoint(out / name)["position"]["step"] > good["position"]["step"]
    assert resumed["train_loss"] == full["train_loss"]  # resumed from the good one: the uninterrupted run's result


def test_random_bytes_are_an_unreadable_checkpoint(tmp_path):
    for seed in range(20):  # random bytes fail the unpickler in many ways: each is a CheckpointError naming the file
        path = tmp_path / f"r{seed}.pt"
        path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).numpy().tobytes())
        with pytest.raises(CheckpointError, match=rf"r{seed}\.pt: (not a readable checkpoint|refused)"):
            load_checkpoint(path)


def test_a_nan_in_a_saved_factor_names_the_file_and_the_tensor(tmp_path):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1")
    state = load_checkpoint(out / LATEST)
    layer = next(iter(state["optimizer"]["kfac"]["layers"]))
    state["optimizer"]["kfac"]["layers"][layer]["A"][0, 0] = float("nan")
    save_rotating(state, out)
    with pytest.raises(CheckpointError, match=rf"{LATEST}: damaged: optimizer\.kfac\.layers\.{layer}\.A holds NaN"):
        load_checkpoint(out / LATEST)


def test_checkpoints_hold_only_data_and_the_digest_sees_every_value():
    with pytest.raises(TypeError, match=r"checkpoint\['x'\] is a pathlib(\._local)?\.PosixPath"):  # (Python 3.13: pathlib._local)
        content_digest({"x": Path("/")})
    base = {"w": torch.arange(6.0).reshape(2, 3), "n": 3, "s": "a"}
    digest = content_digest(base)
    assert digest == content_digest({"s": "a", "n": 3, "w": torch.arange(6.0).reshape(2, 3).t().contiguous().t()})
    for other in (
        {**base, "n": 4},
        {**base, "w": torch.arange(6.0).reshape(3, 2)},
        {**base, "w": torch.arange(6, dtype=torch.float64).reshape(2, 3)},
        {**base, "s": "b"},
        {**base, "n": 3.0},
    ):
        assert content_digest(other) != digest


@pytest.mark.slow
def test_changed_arguments_are_applied_and_recorded(tmp_path, capsys):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1")
    before = load_checkpoint(out / LATEST)["optimizer"]
    assert before["param_groups"][0]["momentum"] == 0.9
    changed = ["--momentum", "0.5", "--weight-decay", "0.001", "--damping", "0.01", "--kl-clip", "0.002", "--factor-decay", "0.9"]
    changed += ["--factor-update-freq", "2", "--inv-update-freq", "4", "--damping-decay", "0.5", "--damping-decay-epochs", "1"]
    with pytest.raises(SystemExit, match="pass --allow-changed-args to apply"):
        _run(out, "--resume", *changed)
    _run(out, "--resume", "--allow-changed-args", *changed)
    printed = capsys.readouterr().out
    assert "resuming with changed arguments, applied: --damping: 0.1 in the checkpoint, 0.01 now" in printed
    assert "damping 0.005" in printed or "damping 0.01" in printed
    after = load_checkpoint(out / LATEST)
    group = after["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"], group["kl_clip"], group["factor_decay"]) == (0.5, 0.001, 0.002, 0.9)
    assert group["damping"] == pytest.approx(0.01 * 0.5)  # epoch 1 is in the new damping schedule
    assert after["optimizer"]["kfac"]["update_freqs"] == [2, 4]
    assert after["kfac_scheduler"]["base_damping"] == 0.01
    assert after["args"]["momentum"] == 0.5  # the record says what was trained
    # The values were in force while training: resuming with the old ones ends elsewhere.
    ref = tmp_path / "ref"
    _run(ref, "--stop-after", "1")
    _run(ref, "--resume")
    theirs = load_checkpoint(ref / LATEST)["model"]
    assert any(not theirs[k].equal(v) for k, v in after["model"].items())


@pytest.mark.slow
def test_fixed_arguments_cannot_change_even_when_allowed(tmp_path):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1")
    with pytest.raises(SystemExit, match=r"--seed cannot change when a run is resumed, even with --allow-changed-args"):
        _run(out, "--resume", "--allow-changed-args", "--seed", "7")


@pytest.mark.slow
def test_a_second_job_on_the_directory_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = RunLock(out).acquire()
    try:
        with pytest.raises(SystemExit, match=rf"in use by another job \(host {socket.gethostname()}, PID {os.getpid()}, since"):
            _run(out)
    finally:
        holder.release()
    assert not (out / "log.csv").exists()
    # A dead job's lock (its record left behind, the kernel's lock released) is taken over, saying so.
    (out / LOCK_NAME).write_text(json.dumps({"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00"}))
    assert _run(out)["epoch"] == 1
    assert "took over the lock of a job that ended without releasing it (host node7, PID 4242" in capsys.readouterr().out
    assert (out / LOCK_NAME).read_text() == ""  # released at the end
    RunLock(out).acquire().release()


@pytest.mark.slow
def test_writes_never_follow_a_symlink_out_of_the_run_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    for name in (f"{LATEST}.tmp", ".write-test", "log.csv", LOCK_NAME):
        (out / name).symlink_to(victim)
    with pytest.raises(SystemExit, match=r"lock file .*run\.lock: it is a symlink"):
        _run(out, "--overwrite")
    (out / LOCK_NAME).unlink()
    assert _run(out, "--overwrite", "--checkpoint-every", "4")["epoch"] == 1
    assert victim.read_text() == "precious"
    assert not (out / "log.csv").is_symlink()
    assert not (out / f"{LATEST}.tmp").exists()  # a stale temporary name (here a planted link) is removed, not written through


def test_a_full_disk_leaves_the_checkpoints_intact_with_a_clear_message(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1", "--checkpoint-every", "4")
    before = {name: (out / name).read_bytes() for name in (LATEST, PREVIOUS)}

    def full_disk(obj, fh, *a, **k):
        fh.write(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1216 vs 1110")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit, match=r"cannot write a checkpoint in .* MiB free\).*unexpected pos.*intact"):
        _run(out, "--resume", "--checkpoint-every", "4")
    assert {name: (out / name).read_bytes() for name in (LATEST, PREVIOUS)} == before
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow
def test_a_damaged_log_row_is_dropped_with_a_warning(tmp_path):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1")
    with open(out / "log.csv", "ab") as fh:
        fh.write(b"garbage,,x\n\xff\xfe\x00binary\n")
    with pytest.warns(UserWarning, match=r"log\.csv, line 3: not a row of the log"):
        _run(out, "--resume")
    rows = list(csv.DictReader((out / "log.csv").read_text().splitlines()))
    assert [r["epoch"] for r in rows] == ["0", "1"]


def test_an_empty_out_dir_is_refused(capsys):
    with pytest.raises(SystemExit):
        train.main([*COMMON, "--out-dir", ""])
    assert "--out-dir must name a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoints_of_older_versions_load_with_a_warning(tmp_path):
    out = tmp_path / "run"
    _run(out, "--stop-after", "1")
    state = torch.load(out / LATEST, weights_only=True)
    del state["checksum"]
    torch.save(state, out / LATEST)
    with pytest.warns(UserWarning, match="written without a checksum"):
        load_checkpoint(out / LATEST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _run(out, "--resume")["epoch"] == 1
