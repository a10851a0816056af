"""A worker that stops answering, and a failure on one rank at start-up, as real processes (torchrun, horovodrun).

* ``spdkfac.train --collective-timeout 10`` with rank 1 frozen (SIGSTOP)
  mid-training: rank 0 fails with a message naming rank 1 within 3× the
  timeout, and the job ends with a non-zero exit (torchrun then needs its
  30 s grace to SIGKILL the frozen process, which cannot act on SIGTERM).
* Rank 0 alone cannot write ``--out-dir``: every rank says so and the job
  ends within seconds of the error, not the 120 s it stalled before (the
  exit barrier).
* A rank that leaves with an error does not wait for the others at exit.
* A worker alive but stuck outside the collectives ends the job too, and the
  message says every worker is alive (torch: the group's timeout; Horovod,
  which only notices frozen workers: the wait watchdog).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time

import psutil
import pytest
from launch import ROOT, launcher_command, require_horovod, worker_env

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 10
#: Until the error names the frozen rank: the timeout, then ~3 s of heartbeat reading; 3× leaves room for a loaded machine.
NAMED_WITHIN_S = 3 * TIMEOUT_S
#: Until the launcher has stopped every process: torchrun waits 30 s after SIGTERM before SIGKILL, horovodrun 10 s.
ENDED_WITHIN_S = TIMEOUT_S + 30 + 35
#: From a rank's start-up error to the job's end: it stalled 120 s per attempt under torchrun (the exit barrier).
AFTER_ERROR_LIMIT_S = 60.0
RANK_VAR = {"torch": "RANK", "horovod": "HOROVOD_RANK"}
#: The error that names the frozen rank, per engine.
NAMED = {
    "torch": re.compile(
        rf"CollectiveTimeoutError: collective '[^']+' timed out on rank 0 after {TIMEOUT_S} s \(collective_timeout\): rank 1 stopped"
    ),
    # Horovod's own timeout (WorkerLostError) or the wait watchdog (CollectiveTimeoutError), whichever fires first.
    "horovod": re.compile(
        rf"Error: collective '[^']+' (?:failed on rank 0|timed out on rank 0 after {TIMEOUT_S} s \(collective_timeout\)): rank 1 stopped answering"
    ),
}


def _env() -> dict:
    return worker_env()


class _Job:
    """A launcher in its own process group, its output collected line by line with arrival times."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, pattern: re.Pattern[str]) -> float | None:
        """When the first line matching ``pattern`` arrived."""
        return next((t for t, line in list(self.lines) if pattern.search(line)), None)

    def output(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def wait(self, timeout: float) -> float | None:
        """When the launcher exited; None if it did not within ``timeout`` (then it and its workers are killed)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        ended = time.monotonic()
        self._reader.join(timeout=10)
        return ended

    def kill(self) -> None:
        """SIGKILL every process of the job (a frozen worker included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _freeze_rank(job: _Job, engine: str, rank: str, deadline: float) -> float | None:
    """SIGSTOP the training worker with that rank once rank 0 has finished an epoch; when it was stopped."""
    epoch_done = re.compile(r"epoch\s+0\s+train loss")
    while time.monotonic() < deadline and job.proc.poll() is None:
        if job.first(epoch_done) is not None:
            for child in psutil.Process(job.proc.pid).children(recursive=True):
                try:
                    if child.environ().get(RANK_VAR[engine]) == rank and "spdkfac.train" in " ".join(child.cmdline()):
                        child.send_signal(signal.SIGSTOP)
                        return time.monotonic()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_frozen_worker_ends_the_job_with_a_message_naming_it(engine, tmp_path):
    if engine == "horovod":
        require_horovod()
    train = ["-m", "spdkfac.train", "--backend", engine, "--data", "digits", "--epochs", "100", "--quiet"]
    cmd = launcher_command(engine, 2, [*train, "--collective-timeout", str(TIMEOUT_S), "--out-dir", str(tmp_path / "run")])
    job = _Job(cmd)
    try:
        stopped = _freeze_rank(job, engine, "1", time.monotonic() + 180)
        ended = job.wait(timeout=240)
    finally:
        if job.proc.poll() is None:
            job.kill()
    out = job.output()
    assert stopped is not None, f"rank 1 was never frozen:\n{out[-4000:]}"
    assert ended is not None, f"{engine}: the job hung with a frozen worker:\n{out[-4000:]}"
    assert job.proc.returncode != 0, out[-4000:]
    named = job.first(NAMED[engine])
    assert named is not None, f"the frozen rank is not named:\n{out[-4000:]}"
    print(f"{engine}: rank 1 named {named - stopped:.1f} s and the job ended {ended - stopped:.1f} s after it froze")
    assert named - stopped < NAMED_WITHIN_S
    assert ended - stopped < ENDED_WITHIN_S


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_rank_0_failing_at_start_up_ends_every_rank_promptly(engine, tmp_path):
    if engine == "horovod":
        require_horovod()
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # rank 0 cannot create a directory under a file; the other ranks never try
    out_dir = blocker / "run"
    cmd = launcher_command(engine, 2, ["-m", "spdkfac.train", "--backend", engine, "--quiet", "--out-dir", str(out_dir)])
    job = _Job(cmd)
    ended = job.wait(timeout=240)
    out = job.output()
    assert ended is not None, f"{engine}: the job hung after rank 0 failed at start-up:\n{out[-4000:]}"
    assert job.proc.returncode != 0, out[-4000:]
    failed = job.first(re.compile(rf"error: cannot write to --out-dir {re.escape(str(out_dir))}: .*Not a directory"))
    assert failed is not None, out[-4000:]
    assert f"error: rank 0 cannot use --out-dir {out_dir} (its error says why)" in out, out[-4000:]
    print(f"{engine}: the job ended {ended - failed:.1f} s after rank 0's error")
    assert ended - failed < AFTER_ERROR_LIMIT_S


def test_a_rank_leaving_on_an_error_does_not_wait_for_the_others_at_exit():
    """Rank 0 raises SystemExit while rank 1 waits in a barrier (timeout 300 s): the job ends at once, not after 120 s."""
    cmd = launcher_command("torch", 2, [str(ROOT / "tests" / "workers" / "one_rank_exits.py"), "--backend", "torch", "--tell-engine"])
    job = _Job(cmd)
    ended = job.wait(timeout=240)
    out = job.output()
    assert ended is not None, f"the job hung after rank 0 left:\n{out[-4000:]}"
    assert job.proc.returncode != 0, out[-4000:]
    failed = job.first(re.compile("error: rank 0 leaves alone"))
    assert failed is not None, out[-4000:]
    assert "passed a barrier rank 0 never reached" not in out
    print(f"the job ended {ended - failed:.1f} s after rank 0's error")
    assert ended - failed < AFTER_ERROR_LIMIT_S


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_worker_alive_but_stuck_ends_the_job_and_is_not_called_frozen(engine):
    if engine == "horovod":
        require_horovod()
    timeout = 5
    cmd = launcher_command(engine, 2, [str(ROOT / "tests" / "workers" / "stuck_worker.py"), "--backend", engine, "--timeout", str(timeout)])
    job = _Job(cmd)
    ended = job.wait(timeout=240)
    out = job.output()
    assert ended is not None, f"{engine}: the job hung with a stuck worker:\n{out[-4000:]}"
    assert job.proc.returncode != 0, out[-4000:]
    stuck = job.first(re.compile("rank 1: stuck at step"))
    named = job.first(
        re.compile(rf"CollectiveTimeoutError: collective 'stuck.step3' timed out on rank 0 after {timeout} s .*every other worker is alive")
    )
    assert stuck is not None, out[-4000:]
    assert named is not None, f"no error saying every worker is alive:\n{out[-4000:]}"
    assert "finished all steps" not in out
    print(f"{engine}: rank 0 gave up {named - stuck:.1f} s and the job ended {ended - stuck:.1f} s after rank 1 got stuck")
    assert named - stuck < 3 * timeout + 10
    assert ended - stuck < 3 * timeout + 30
