"""Start-up checks that one rank makes and every rank acts on.

A check that fails on one rank only (rank 0 preparing ``--out-dir``: create
it, write there, lock it) must not leave the others waiting in the next
collective: they would stall until the collective timeout (under torchrun,
also on every restart). So the outcome is all-reduced and every rank leaves
with an error at the same point.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ..comm import CommBackend
from .checkpoint import LATEST, PREVIOUS
from .run_dir import RunDirLockedError, RunLock

__all__ = ["RunDirError", "leave_together", "take_run_dir"]


class RunDirError(RuntimeError):
    """Rank 0 cannot use the run directory; the message is the whole error to show."""


def take_run_dir(out_dir: Path, overwrite: bool) -> RunLock:
    """Create ``out_dir``, check it is writable, lock it, clear what a killed job left (and the old run, with ``overwrite``).

    Raises :class:`RunDirError` with the message to show; the lock is not held then.
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out_dir)  # O_EXCL: never follows a planted link
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunDirError(f"cannot write to --out-dir {out_dir}: {exc}") from None
    try:
        lock = RunLock(out_dir).acquire()
    except RunDirLockedError as exc:
        raise RunDirError(str(exc)) from None
    try:
        for stale in [*out_dir.glob(f"{LATEST}.*.tmp"), out_dir / f"{LATEST}.tmp"]:  # left by a killed job
            stale.unlink(missing_ok=True)
        if overwrite:
            for name in (LATEST, PREVIOUS):
                (out_dir / name).unlink(missing_ok=True)
    except OSError as exc:
        lock.release()
        raise RunDirError(f"cannot clear --out-dir {out_dir}: {exc}") from None
    return lock


def leave_together(problem: str, is_root: bool, backend: CommBackend, device: torch.device, others: str) -> None:
    """If rank 0 has a ``problem``, every rank raises SystemExit: rank 0 with it, the others with ``others``."""
    failed = torch.tensor([1.0 if problem else 0.0], device=device)  # NCCL reduces device tensors only
    backend.allreduce_async(failed, "train.rank0_check").wait()
    if float(failed) > 0:
        raise SystemExit(f"error: {problem if is_root else others}")
