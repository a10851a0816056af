"""Fault matrix of the training job: kills, damaged files, a full disk, two jobs, a frozen worker, start-up failures.

    python -m benchmarks.fault_matrix [--engines torch horovod] [--out benchmarks/results/fault_matrix.json]

Every case runs the real job (``spdkfac.train`` on digits, 2 workers under
torchrun or horovodrun, a checkpoint every 4 steps) and injects one fault.
Each case is judged on three counts:

* **survived**: the job, or its ``--resume auto`` restart, finished with the
  parameters of an uninterrupted run (bit for bit), or, for a fault that
  must stop the job, stopped it;
* **detected**: where the fault must be reported, the job exited non-zero
  (or warned) with a message that names the problem (a regular expression
  per case) within the case's time limit;
* **nothing lost**: no checkpoint that verified before the fault is gone or
  damaged, and no file outside the run directory was touched.

The disk-full case mounts a small tmpfs, which needs root; without it the
case is reported as not tried. Results go to JSON; ``scripts/results_md.py``
puts the table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, machine, save_json
from spdkfac.train.checkpoint import LATEST, PREVIOUS, CheckpointError, load_checkpoint, save_rotating

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["-m", "spdkfac.train", "--data", "digits", "--epochs", "2", "--batch-size", "32", "--quiet", "--checkpoint-every", "4"]
RUN_LIMIT_S = 300
#: Epochs of the job that a second one tries to share the directory with (digits: about 1.5 s each).
LONG_EPOCHS = 20


@dataclass
class Outcome:
    """One case's verdict and what it saw."""

    case: str
    group: str
    engine: str
    survived: bool = False
    detected: bool | None = None  # None: nothing to report for this case
    nothing_lost: bool = False
    seconds: float = 0.0
    message: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.survived and self.detected is not False and self.nothing_lost


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="default")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _launcher(engine: str, nproc: int = 2) -> list[str]:
    if engine == "torch":
        port = str(_free_port())
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", port]  # fmt: skip
    hvd = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
    return [hvd, "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", sys.executable]


def _command(engine: str, out: Path, *extra: str) -> list[str]:
    return [*_launcher(engine), *TRAIN, "--backend", engine, "--out-dir", str(out), *extra]


def _start(cmd: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")  # noqa: SIM115 (closed with the process, in _finish)
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], log: Path, limit: float = RUN_LIMIT_S) -> tuple[int, str, bool]:
    """(exit code, output, hung): waits up to ``limit`` seconds, then kills the whole job."""
    hung = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        hung = True
        _kill_group(proc)
        proc.wait()
    return proc.returncode, log.read_text(errors="replace"), hung


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run(cmd: Sequence[str], log: Path, limit: float = RUN_LIMIT_S) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code, out, hung = _finish(_start(cmd, log), log, limit)
    return (124 if hung else code), out, time.monotonic() - t0


def _workers(proc: subprocess.Popen[bytes]) -> dict[int, Any]:
    """The training processes of a job by rank (torchrun's RANK, horovodrun's HOROVOD_RANK)."""
    import psutil

    found: dict[int, Any] = {}
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            env = child.environ()
            cmdline = child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rank = env.get("RANK", env.get("HOROVOD_RANK"))
        if rank is not None and "spdkfac.train" in cmdline:
            found[int(rank)] = child
    return found


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], limit: float = 120.0, poll: float = 0.01) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(poll)
    return False


def _models_equal(a: Path, b: Path) -> bool:
    try:
        got, want = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    except CheckpointError:
        return False
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _verifying(out: Path) -> dict[str, int]:
    """{checkpoint name: its step} for every checkpoint in ``out`` that verifies now."""
    good: dict[str, int] = {}
    for name in (LATEST, PREVIOUS):
        try:
            good[name] = int(load_checkpoint(out / name)["position"]["step"])
        except (CheckpointError, KeyError, TypeError):
            continue
    return good


class Matrix:
    """Runs the cases of one engine in a scratch folder, against an uninterrupted reference run."""

    def __init__(self, engine: str, scratch: Path) -> None:
        self.engine = engine
        self.scratch = scratch / engine
        self.scratch.mkdir(parents=True)
        self.outcomes: list[Outcome] = []
        self.reference = self.scratch / "reference"
        code, out, _ = _run(_command(engine, self.reference), self.scratch / "reference.log")
        if code != 0:
            raise SystemExit(f"error: the uninterrupted {engine} run failed (exit {code}):\n{out[-3000:]}")
        self.clean = self.scratch / "clean"
        # A finished run to damage: resuming it after the damage must end like the reference.
        code, out, _ = _run(_command(engine, self.clean, "--stop-after", "1"), self.scratch / "clean.log")
        if code != 0:
            raise SystemExit(f"error: the {engine} run stopped after one epoch failed (exit {code}):\n{out[-3000:]}")

    def _dir(self, name: str, from_clean: bool = False) -> Path:
        path = self.scratch / name
        if from_clean:
            shutil.copytree(self.clean, path)
        return path

    def _resume_survives(self, out: Path, name: str, outcome: Outcome) -> tuple[bool, str]:
        code, text, _ = _run(_command(self.engine, out, "--resume", "auto"), self.scratch / f"{name}.resume.log")
        if code != 0:
            outcome.notes.append(f"resume exited {code}: {text.strip().splitlines()[-1:] if text.strip() else ''}")
            return False, text
        return _models_equal(out / LATEST, self.reference / LATEST), text

    def record(self, outcome: Outcome, message: str, pattern: str | None) -> None:
        if pattern is not None and outcome.detected is None:
            found = re.search(pattern, message, re.S)
            outcome.detected = found is not None
            outcome.message = found.group(0)[:200] if found else message.strip()[-300:]
        status = "ok" if outcome.ok else "FAILED"
        print(
            f"[{self.engine}] {outcome.group:11s} {outcome.case:45s} {status:6s} survived={outcome.survived} "
            f"detected={outcome.detected} nothing_lost={outcome.nothing_lost} {outcome.seconds:.1f}s",
            flush=True,
        )
        self.outcomes.append(outcome)

    # ----------------------------------------------------------------- kills
    def kill(self, rank: int, when: str) -> None:
        """SIGKILL one worker after the first checkpoint, or while a checkpoint is being written; then resume."""
        name = f"kill-rank{rank}-{when}"
        outcome = Outcome(f"SIGKILL rank {rank} {when.replace('-', ' ')}", "kill", self.engine)
        out = self._dir(name)
        t0 = time.monotonic()
        proc = _start(_command(self.engine, out), self.scratch / f"{name}.log")

        def ready() -> bool:
            if when == "while-saving":  # a later checkpoint than the first: one that verifies exists
                return (out / LATEST).exists() and any(out.glob(f"{LATEST}.*.tmp"))
            return (out / LATEST).exists()

        landed = _wait_for(ready, proc, poll=0.001)
        victims = _workers(proc)
        if landed and rank in victims:
            victims[rank].send_signal(signal.SIGKILL)
        else:
            outcome.notes.append("the job ended before the kill could land")
        code, text, hung = _finish(proc, self.scratch / f"{name}.log")
        outcome.seconds = time.monotonic() - t0
        before = _verifying(out)
        if list(out.glob("*.tmp")):
            outcome.notes.append("the kill left a temporary file (removed by the restart)")
        survived, _ = self._resume_survives(out, name, outcome)
        outcome.survived = survived and not hung and code != 0
        outcome.nothing_lost = bool(before) and survived
        pattern = rf"rank\s*:?\s*{rank}|Process {rank} exit|exitcode\s*:\s*-9|signal 9|SIGKILL"
        self.record(outcome, text, pattern)

    # -------------------------------------------------------------- damage
    def damage(self, target: str, how: str, expect: str, pattern: str | None, warn_only: bool = False) -> None:
        """Damage one file of a finished first epoch, resume with ``--resume auto``; the outcome per ``expect``.

        ``expect``: 'resume' (the job finishes like the reference, having said
        what it skipped) or 'stop' (the job refuses with a message naming the
        file, and changes nothing).
        """
        name = re.sub(r"[^A-Za-z0-9]+", "-", f"damage-{target}-{how}").strip("-")
        outcome = Outcome(f"{how} {target}", "damage", self.engine)
        out = self._dir(name, from_clean=True)
        _DAMAGE[how](out / target, out)
        files_before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.is_symlink()}
        t0 = time.monotonic()
        code, text, _ = _run(_command(self.engine, out, "--resume", "auto"), self.scratch / f"{name}.log")
        outcome.seconds = time.monotonic() - t0
        if expect == "resume":
            outcome.survived = code == 0 and _models_equal(out / LATEST, self.reference / LATEST)
            outcome.nothing_lost = outcome.survived
        else:
            outcome.survived = code != 0
            after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.is_symlink()}
            outcome.nothing_lost = all(after.get(n) == b for n, b in files_before.items() if n != "run.lock")
        self.record(outcome, text, pattern)

    # ----------------------------------------------------------- disk full
    def disk_full(self) -> None:
        outcome = Outcome("disk fills up during a checkpoint", "disk", self.engine)
        mount = self.scratch / "tiny"
        mount.mkdir()
        size = (self.clean / LATEST).stat().st_size
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(size * 2.6) // 1024 + 8}k", "tmpfs", str(mount)], capture_output=True, check=False
        )
        if mounted.returncode != 0:
            outcome.notes.append("not tried: mounting a small tmpfs needs root")
            outcome.message = mounted.stderr.decode(errors="replace").strip()[:200]
            self.outcomes.append(outcome)
            print(f"[{self.engine}] disk        not tried ({outcome.message})", flush=True)
            return
        try:
            out = mount / "run"
            t0 = time.monotonic()
            code, text, _ = _run(_command(self.engine, out), self.scratch / "disk.log")
            outcome.seconds = time.monotonic() - t0
            good = _verifying(out)
            leftovers = list(out.glob("*.tmp"))
            outcome.survived = code != 0
            outcome.nothing_lost = bool(good) and not leftovers
            if leftovers:
                outcome.notes.append(f"left behind: {[p.name for p in leftovers]}")
            rescued = self.scratch / "disk-rescued"
            shutil.copytree(out, rescued)
        finally:
            subprocess.run(["umount", str(mount)], check=False)
        survived, _ = self._resume_survives(rescued, "disk-rescued", outcome)
        outcome.nothing_lost = outcome.nothing_lost and survived
        self.record(outcome, text, r"cannot write a checkpoint in .*MiB free.*intact")

    # ------------------------------------------------------------ two jobs
    def two_jobs(self) -> None:
        outcome = Outcome("a second job on the same --out-dir", "concurrency", self.engine)
        out = self._dir("two-jobs")
        t0 = time.monotonic()
        # A first job long enough to still hold the directory when the second one has started up.
        first = _start(_command(self.engine, out, "--epochs", str(LONG_EPOCHS)), self.scratch / "two-jobs-first.log")
        _wait_for((out / "log.csv").exists, first)
        code2, text2, _ = _run(_command(self.engine, out, "--resume", "auto"), self.scratch / "two-jobs-second.log", limit=120)
        code1, _, hung = _finish(first, self.scratch / "two-jobs-first.log")
        outcome.seconds = time.monotonic() - t0
        rows = (out / "log.csv").read_text().splitlines()[1:] if (out / "log.csv").exists() else []
        outcome.survived = code2 != 0 and code1 == 0 and not hung
        outcome.nothing_lost = len(rows) == LONG_EPOCHS and bool(_verifying(out))
        if not outcome.nothing_lost:
            outcome.notes.append(f"the first job's log has {len(rows)} rows of {LONG_EPOCHS}")
        self.record(outcome, text2, r"in use by another job \(host \S+, PID \d+")

    # -------------------------------------------------------- frozen worker
    def frozen(self, timeout_s: int) -> None:
        outcome = Outcome(f"SIGSTOP rank 1 (--collective-timeout {timeout_s})", "frozen", self.engine)
        out = self._dir("frozen")
        t0 = time.monotonic()
        proc = _start(_command(self.engine, out, "--collective-timeout", str(timeout_s)), self.scratch / "frozen.log")
        _wait_for((out / LATEST).exists, proc)
        victim = _workers(proc).get(1)
        if victim is not None:
            victim.send_signal(signal.SIGSTOP)
        code, text, hung = _finish(proc, self.scratch / "frozen.log", limit=6 * timeout_s + 60)
        outcome.seconds = time.monotonic() - t0
        if victim is not None:
            with contextlib.suppress(Exception):
                victim.send_signal(signal.SIGKILL)
        survived, _ = self._resume_survives(out, "frozen", outcome)
        outcome.survived = code != 0 and not hung and survived
        outcome.nothing_lost = survived
        if "unrecognized arguments: --collective-timeout" in text:
            outcome.notes.append("this build has no --collective-timeout")
        self.record(outcome, text, r"(rank 1|peer 1|Rank 1)[^\n]*(did not answer|stopped answering|timed out|timeout)|"
                                   r"(did not answer|stopped answering|timed out)[^\n]*rank 1")  # fmt: skip

    # ------------------------------------------------------------ start-up
    def startup(self) -> None:
        outcome = Outcome("rank 0 cannot write --out-dir", "start-up", self.engine)
        blocker = self.scratch / "a-file"
        blocker.write_text("x")
        code, text, seconds = _run(_command(self.engine, blocker / "run"), self.scratch / "startup.log", limit=240)
        outcome.seconds = seconds
        outcome.survived = code not in (0, 124) and seconds < 60
        outcome.nothing_lost = blocker.read_text() == "x"
        if seconds >= 60:
            outcome.notes.append(f"took {seconds:.0f} s to end")
        self.record(outcome, text, r"cannot write to --out-dir")

    def planted_links(self) -> None:
        outcome = Outcome("symlinks to a file outside planted in --out-dir", "damage", self.engine)
        victim = self.scratch / "victim.txt"
        victim.write_text("precious")
        out = self._dir("links", from_clean=True)
        for name in (f"{LATEST}.tmp", ".write-test"):
            (out / name).symlink_to(victim)
        t0 = time.monotonic()
        code, text, _ = _run(_command(self.engine, out, "--resume", "auto"), self.scratch / "links.log")
        outcome.seconds = time.monotonic() - t0
        outcome.survived = code == 0 and _models_equal(out / LATEST, self.reference / LATEST)
        outcome.nothing_lost = victim.read_text() == "precious"
        self.record(outcome, text, None)


def _truncate(path: Path, _out: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path, _out: Path) -> None:
    path.write_bytes(b"")


def _garbage(path: Path, _out: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _flip(path: Path, _out: Path) -> None:
    state = torch.load(path, weights_only=True)
    weight = max((v for v in state["model"].values() if v.is_floating_point()), key=lambda t: t.numel())
    raw = bytearray(path.read_bytes())
    at = raw.find(weight.reshape(-1).numpy().tobytes()[:64])
    raw[at + 40 : at + 44] = b"\x7e\xff\x7e\xff"
    path.write_bytes(bytes(raw))


class _Planted:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/spdkfac-fault-matrix-pwned",))


def _plant(path: Path, _out: Path) -> None:
    torch.save({"model": {}, "optimizer": {}, "epoch": 0, "args": {}, "x": _Planted()}, path)


def _nan(path: Path, out: Path) -> None:
    """A NaN in a saved factor, with a valid checksum (damage before the save, not after)."""
    state = load_checkpoint(path)
    layer = next(iter(state["optimizer"]["kfac"]["layers"].values()))
    layer["A"].view(-1)[0] = float("nan")
    other = out / (PREVIOUS if path.name == LATEST else LATEST)
    keep = other.read_bytes()
    save_rotating(state, out)  # writes LATEST; rename so that the damaged one is where it was meant to be
    if path.name == PREVIOUS:
        os.replace(out / LATEST, path)
    other.write_bytes(keep)


def _log_garbage(path: Path, _out: Path) -> None:
    with open(path, "ab") as fh:
        fh.write(b"garbage,row\n\xff\xfe\x00\n")


def _lock_garbage(path: Path, _out: Path) -> None:
    path.write_bytes(b"\x00\xffnot json")


def _both(how: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def damage(_path: Path, out: Path) -> None:
        how(out / LATEST, out)
        how(out / PREVIOUS, out)

    return damage


_DAMAGE: dict[str, Callable[[Path, Path], None]] = {
    "truncate": _truncate,
    "empty": _empty,
    "garbage": _garbage,
    "flip 4 bytes of a weight in": _flip,
    "plant a code-running pickle as": _plant,
    "NaN in a factor of": _nan,
    "garbage rows in": _log_garbage,
    "garbage in": _lock_garbage,
    "flip 4 bytes in both checkpoints,": _both(_flip),
    "plant pickles as both checkpoints,": _both(_plant),
}


def run_engine(engine: str, scratch: Path, cases: set[str], timeout_s: int) -> list[Outcome]:
    m = Matrix(engine, scratch)
    if "kill" in cases:
        for rank in (0, 1):
            m.kill(rank, "after-the-first-checkpoint")
        m.kill(0, "while-saving")
    if "damage" in cases:
        skipped = r"skipping unusable checkpoint: \S*checkpoint\.pt: "
        for how in ("truncate", "empty", "garbage", "flip 4 bytes of a weight in", "plant a code-running pickle as", "NaN in a factor of"):
            m.damage(LATEST, how, "resume", skipped)
        m.damage(PREVIOUS, "garbage", "resume", None)
        m.damage("log.csv", "garbage rows in", "resume", r"log\.csv, line \d+: not a row of the log")
        m.damage("run.lock", "garbage in", "resume", r"took over the lock")
        m.damage("both", "flip 4 bytes in both checkpoints,", "stop", r"cannot resume: \S*checkpoint\.pt: damaged")
        m.damage("both", "plant pickles as both checkpoints,", "stop", r"cannot resume: \S*checkpoint\.pt: refused")
        m.planted_links()
    if "disk" in cases:
        m.disk_full()
    if "concurrency" in cases:
        m.two_jobs()
    if "frozen" in cases:
        m.frozen(timeout_s)
    if "start-up" in cases:
        m.startup()
    return m.outcomes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["torch", "horovod"], choices=("torch", "horovod"))
    groups = ("kill", "damage", "disk", "concurrency", "frozen", "start-up")
    ap.add_argument("--cases", nargs="+", default=list(groups), choices=groups)
    ap.add_argument("--collective-timeout", type=int, default=20, help="seconds, for the frozen-worker case")
    ap.add_argument("--out", default=str(RESULTS / "fault_matrix.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pwned = Path("/tmp/spdkfac-fault-matrix-pwned")
    pwned.unlink(missing_ok=True)
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spdkfac-faults-") as scratch:
        for engine in args.engines:
            outcomes += run_engine(engine, Path(scratch), set(args.cases), args.collective_timeout)
    if pwned.exists():
        outcomes.append(Outcome("a planted pickle ran code", "damage", "any", message=str(pwned)))
    tried = [o for o in outcomes if not any(n.startswith("not tried") for n in o.notes)]
    summary = {
        "cases": len(outcomes),
        "tried": len(tried),
        "survived": sum(o.survived for o in tried),
        "detected_with_clear_message": sum(o.detected is True for o in tried),
        "to_detect": sum(o.detected is not None for o in tried),
        "nothing_lost": sum(o.nothing_lost for o in tried),
        "all_ok": sum(o.ok for o in tried),
    }
    result = {
        "benchmark": "fault_matrix",
        "command": "python -m benchmarks.fault_matrix " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "engines": args.engines,
        "wall_s": time.monotonic() - t0,
        "summary": summary,
        "outcomes": [{**asdict(o), "ok": o.ok} for o in outcomes],
    }
    save_json(result, out.name, out.parent)
    print(
        f"{summary['tried']} cases tried: {summary['survived']} survived, {summary['detected_with_clear_message']}/"
        f"{summary['to_detect']} detected with a clear message, {summary['nothing_lost']} lost nothing; "
        f"{summary['all_ok']} fully ok. {out}"
    )
    return 0 if summary["all_ok"] == summary["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
