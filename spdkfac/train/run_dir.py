"""A run directory's files: one job at a time (an exclusive lock held by rank 0), writes that never follow a symlink.

The lock is ``run.lock`` in the run directory, locked with ``flock`` and
holding the holder's host, PID and start time. The kernel releases it when
the holder exits, however it exits, so the lock of a job that died is taken
over (with a message naming it) and a second live job is refused, naming the
holder. ``flock`` works across the nodes of a cluster on NFS (Linux emulates
it with POSIX locks there); on file systems without locks the lock cannot be
taken and the job says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

__all__ = ["LOCK_NAME", "RunDirLockedError", "RunLock", "append_text", "replace_text"]

LOCK_NAME = "run.lock"


class RunDirLockedError(RuntimeError):
    """The run directory is in use by another job (named in the message), or cannot be locked."""


def _holder_text(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        return f"host {info['host']}, PID {info['pid']}, since {info['started']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "a job that left no readable record"


class RunLock:
    """The exclusive lock on a run directory, held from :meth:`acquire` to :meth:`release` (or the process's end)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._fd: int | None = None
        #: What the lock file said when a dead job's lock was taken over (None when it was free).
        self.taken_over: str | None = None

    def acquire(self) -> RunLock:
        """Lock the directory, or raise :class:`RunDirLockedError` naming the job that holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise RunDirLockedError(f"cannot open the lock file {self.path}: {why}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirLockedError(
                    f"{self.path.parent} is in use by another job ({holder}); wait for it to end, stop it, or choose another --out-dir"
                ) from None
            raise RunDirLockedError(f"cannot lock {self.path}: {exc.strerror} (a file system without locks?)") from None
        previous = os.pread(fd, 4096, 0)
        if previous.strip():
            self.taken_over = _holder_text(previous)  # released by the kernel without release(): that job died
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the record and unlock (the file stays: removing it would race with a job opening it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` anew through a temporary file and a rename: a symlink at ``path`` is replaced, never followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def append_text(path: Path, text: str) -> None:
    """Append to ``path``, refusing (OSError ELOOP) when it has been replaced by a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "a", newline="") as fh:
        fh.write(text)
