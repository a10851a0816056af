"""Lost workers and restarts, as real processes under torchrun and horovodrun (gloo).

* A worker killed with SIGKILL mid-iteration ends the job with a non-zero
  exit and a message naming the lost rank, well within 60 s of its death.
* ``torchrun --max-restarts 1`` with ``spdkfac.train --resume auto``: a worker
  killed mid-epoch makes the job restart and resume by itself; it ends with
  exit 0 and the parameters of an uninterrupted run.
* A checkpoint written by 2 workers resumes on 1 and on 3.
* With the decompositions split over the workers (``--distribute-preconditioning``)
  the checkpoint gathers them on rank 0, and a resume between two refreshes
  ends bitwise as the uninterrupted run.
"""

from __future__ import annotations

import csv
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from launch import ROOT, free_port, launcher_command, require_horovod, run_workers, worker_env

from spdkfac.train.checkpoint import LATEST, PREVIOUS

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

LOST = str(ROOT / "tests" / "workers" / "lost_worker.py")
DETECT_LIMIT_S = 60.0
#: How each launcher names the worker that was lost (rank 1, SIGKILL).
LOST_RANK_NAMED = {
    "torch": re.compile(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", re.S),
    "horovod": re.compile(r"Process 1 exit with status code 137"),
}


def _env() -> dict:
    return worker_env()


@pytest.mark.parametrize("phase", ["forward", "factor", "inversion"])
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_killed_worker_ends_the_job_naming_it(engine, phase):
    if engine == "horovod":
        require_horovod()
    cmd = launcher_command(engine, 2, [LOST, "--backend", engine, "--phase", phase])
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    killed_at: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "killing myself" in line and not killed_at:
                killed_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{engine}: the job hung after a worker was lost in the {phase} phase:\n{''.join(lines)[-4000:]}")
    ended_at = time.monotonic()
    reader.join(timeout=10)
    out = "".join(lines)
    assert killed_at, f"rank 1 was never killed:\n{out[-4000:]}"
    assert proc.returncode != 0, out[-4000:]
    assert "finished all steps" not in out
    assert LOST_RANK_NAMED[engine].search(out), f"the lost rank is not named:\n{out[-4000:]}"
    assert "never waited for" not in out  # the first error is the engine's, not a follow-on of the optimizer's
    detect = ended_at - killed_at[0]
    print(f"{engine}/{phase}: job ended {detect:.1f} s after the worker was killed")
    assert detect < DETECT_LIMIT_S


TRAIN = [
    "-m",
    "spdkfac.train",
    "--backend",
    "torch",
    "--data",
    "digits",
    "--epochs",
    "3",
    "--batch-size",
    "32",
    "--quiet",
    "--checkpoint-every",
    "4",
    "--resume",
    "auto",
]


def _model(out: Path, name: str = LATEST) -> dict:
    return torch.load(out / name, weights_only=False)["model"]


def _kill_rank_once(torchrun: subprocess.Popen, out: Path, deadline: float) -> int | None:
    """Once the first checkpoint exists, SIGKILL the worker with RANK=1 of the first attempt; its pid."""
    while time.monotonic() < deadline and torchrun.poll() is None:
        if (out / LATEST).exists():
            for child in psutil.Process(torchrun.pid).children(recursive=True):
                try:
                    env = child.environ()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if env.get("RANK") == "1" and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    child.send_signal(signal.SIGKILL)
                    return child.pid
        time.sleep(0.02)
    return None


def test_torchrun_restarts_after_a_lost_worker_and_ends_like_an_uninterrupted_run(tmp_path):
    ref = tmp_path / "uninterrupted"
    run_workers("torch", 2, [*TRAIN, "--out-dir", str(ref)])

    out = tmp_path / "elastic"
    # Elastic restarts need a rendezvous that starts each round afresh (c10d), not the static one of --master_port.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        *TRAIN,
        "--out-dir",
        str(out),
    ]
    with open(tmp_path / "elastic.log", "w+") as log:
        torchrun = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        killed = _kill_rank_once(torchrun, out, time.monotonic() + 240)
        try:
            torchrun.wait(timeout=300)
        except subprocess.TimeoutExpired:
            torchrun.kill()
            pytest.fail("the restarted job hung")
        log.seek(0)
        output = log.read()
    assert killed is not None, f"the job ended before its worker could be killed:\n{output[-3000:]}"
    assert torchrun.returncode == 0, output[-5000:]
    resumed = re.search(r"resumed from \S+: step (\d+), epoch (\d+)", output)
    assert resumed, output[-5000:]
    assert int(resumed.group(1)) >= 4  # from a checkpoint, not from scratch
    got, want = _model(out), _model(ref)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    rows = list(csv.DictReader((out / "log.csv").read_text().splitlines()))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]  # each epoch logged once
    # The interrupted epoch's metrics are the uninterrupted run's: the partial sums saved mid-epoch are carried on
    # by every worker once (they were averaged over the workers a second time before).
    ref_rows = list(csv.DictReader((ref / "log.csv").read_text().splitlines()))
    for mine, theirs in zip(rows, ref_rows):
        for field in ("train_loss", "train_acc", "test_loss", "test_acc"):
            assert float(mine[field]) == pytest.approx(float(theirs[field]), rel=1e-9), (mine["epoch"], field)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_two_worker_checkpoint_resumes_on_another_worker_count(tmp_path, workers):
    two = tmp_path / "two"
    run_workers("torch", 2, [*TRAIN, "--epochs", "2", "--out-dir", str(two)])
    # 22 steps per epoch on 2 workers: the previous checkpoint is step 40, mid-epoch 1.
    out = tmp_path / f"on{workers}"
    out.mkdir()
    shutil.copy(two / PREVIOUS, out / LATEST)
    shutil.copy(two / "log.csv", out / "log.csv")
    args = [*TRAIN, "--epochs", "2", "--out-dir", str(out)]
    if workers == 1:
        args[args.index("torch")] = "single"
        output = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=True
        ).stdout
    else:
        output = run_workers("torch", workers, args)
    assert "resumed from" in output
    assert "step 40, epoch 1" in output
    assert f"written by 2 worker(s), this run has {workers}" in output
    rows = list(csv.DictReader((out / "log.csv").read_text().splitlines()))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert float(rows[-1]["test_acc"]) > 0.5
    assert torch.load(out / LATEST, weights_only=False)["world_size"] == workers


@pytest.mark.parametrize(("engine", "method"), [("torch", "inverse"), ("horovod", "inverse"), ("torch", "ekfac"), ("horovod", "ekfac")])
def test_a_checkpoint_of_split_decompositions_resumes_the_uninterrupted_run(tmp_path, engine, method):
    """Each worker holds its own layers' decompositions (and EKFAC's scaling); the checkpoint at the end of epoch 0
    (step 22, refreshes every 5) holds every one, gathered on rank 0, so the resumed epoch 1 uses step 20's, as the
    uninterrupted run."""
    if engine == "horovod":
        require_horovod()
    args = [*TRAIN, "--epochs", "2", "--distribute-preconditioning", "--inv-update-freq", "5", "--checkpoint-every", "100"]
    args[args.index("torch")] = engine
    args += ["--compute-method", method]
    run_workers(engine, 2, [*args, "--out-dir", str(tmp_path / "uninterrupted")])
    out = tmp_path / "resumed"
    run_workers(engine, 2, [*args, "--out-dir", str(out), "--stop-after", "1"])
    saved = torch.load(out / LATEST, weights_only=False)
    assert saved["position"]["step"] % 5 != 0  # (between two refreshes)
    layers = saved["optimizer"]["kfac"]["layers"]
    suffix = "_inv" if method == "inverse" else "_eigen"
    assert all(entry[f"A{suffix}"] is not None and entry[f"G{suffix}"] is not None for entry in layers.values())
    assert method == "inverse" or all(entry["method_state"]["scale"] is not None for entry in layers.values())
    output = run_workers(engine, 2, [*args, "--out-dir", str(out)])
    assert "resumed from" in output
    got, want = _model(out), _model(tmp_path / "uninterrupted")
    for k in want:
        assert torch.equal(got[k], want[k]), k
