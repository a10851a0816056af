"""Checkpoints of the training job: data only, checksummed, atomic, the last verified one never lost.

A run directory holds ``checkpoint.pt`` (the newest) and ``checkpoint.prev.pt``
(the one before).

* **Data, never code.** A checkpoint may hold only tensors and plain values
  (dicts, lists, tuples, str, int, float, bool, None); :func:`save_rotating`
  refuses anything else, and :func:`load_checkpoint` reads with
  ``torch.load(weights_only=True)``, so a planted pickle cannot run code.
* **Damage is caught.** Each checkpoint carries a SHA-256 digest of its
  contents (every tensor's dtype, shape and bytes, and every plain value),
  checked before the checkpoint is used: flipped bytes inside a weight are
  reported by file, and :func:`newest_valid` falls back to the previous one.
* **Atomic, and the last verified checkpoint survives.** A checkpoint is
  written to a temporary file of its own (never following a symlink), flushed
  to disk and renamed into place. The newest checkpoint becomes the previous
  one only once it is known to verify; a damaged newest one is renamed aside
  instead (``checkpoint.pt.damaged-*``), so rotation never replaces the last
  good checkpoint with a bad one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKSUM_KEY",
    "LATEST",
    "PREVIOUS",
    "CheckpointError",
    "changed_arguments",
    "content_digest",
    "load_checkpoint",
    "newest_valid",
    "save_rotating",
]

LATEST = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
#: What every checkpoint of the training job holds.
REQUIRED_KEYS = ("model", "optimizer", "epoch", "args")
#: The entry that holds the digest of everything else: ``{"sha256": hex}``.
CHECKSUM_KEY = "checksum"

_PLAIN = (str, int, float, bool, type(None))
#: (device, inode, size, mtime) of checkpoint files this process wrote or verified.
_verified: set[tuple[int, int, int, int]] = set()


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used, or cannot be written; the message names the file and why."""


def content_digest(state: Any) -> str:
    """SHA-256 of ``state``'s contents: the same for the same tensors and values, whatever their devices.

    Raises TypeError naming the entry when ``state`` holds anything but tensors
    and plain values (what ``torch.load(weights_only=True)`` could not read back).
    """
    digest = hashlib.sha256()
    _feed(digest, state, "checkpoint")
    return digest.hexdigest()


def _feed(digest: Any, value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            if not isinstance(key, _PLAIN):
                raise TypeError(f"{where}: a key of type {type(key).__name__}; checkpoints hold plain keys only")
            digest.update(f"K{key!r}".encode())
            _feed(digest, value[key], f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__[0]}{len(value)}".encode())
        for i, item in enumerate(value):
            _feed(digest, item, f"{where}[{i}]")
    elif isinstance(value, _PLAIN):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__name__}; checkpoints hold only tensors and plain "
            "values (dict, list, tuple, str, int, float, bool, None), so that loading them can never run code"
        )


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path, follow_symlinks=False)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system syncs directories
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_rotating(state: dict[str, Any], directory: Path) -> Path:
    """Write ``state`` as the newest checkpoint of ``directory``; the newest before it becomes ``checkpoint.prev.pt``.

    ``state`` gets a digest of its contents (:data:`CHECKSUM_KEY`). A failed
    write (a full disk) removes its temporary file and raises
    :class:`CheckpointError` with the existing checkpoints untouched.
    """
    try:
        digest = content_digest({k: v for k, v in state.items() if k != CHECKSUM_KEY})
    except TypeError as exc:
        raise CheckpointError(f"cannot save a checkpoint in {directory}: {exc}") from None
    latest, previous = directory / LATEST, directory / PREVIOUS
    fd, tmp_name = tempfile.mkstemp(prefix=LATEST + ".", suffix=".tmp", dir=directory)  # O_EXCL: never follows a planted link
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            torch.save({**state, CHECKSUM_KEY: {"sha256": digest}}, fh)
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(directory).free
        raise CheckpointError(
            f"cannot write a checkpoint in {directory} ({free / 2**20:.1f} MiB free): {exc}; the checkpoints already there are intact"
        ) from None
    if os.path.lexists(latest):
        _retire_latest(latest, previous)
    os.replace(tmp, latest)  # between the renames only the previous checkpoint exists: still a valid one
    _fsync_dir(directory)
    _verified.add(_stat_key(latest))
    return latest


def _retire_latest(latest: Path, previous: Path) -> None:
    """Make the newest checkpoint the previous one, if it verifies; a damaged one is renamed aside instead."""
    if _stat_key(latest) not in _verified:
        try:
            load_checkpoint(latest)
        except CheckpointError as exc:
            aside = latest.with_name(f"{LATEST}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.replace(latest, aside)
            warnings.warn(
                f"{exc}; kept {previous.name} as the previous checkpoint and moved the damaged file to {aside.name}", stacklevel=3
            )
            return
    os.replace(latest, previous)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify a training-job checkpoint, or raise :class:`CheckpointError` naming the file and the problem.

    Only tensors and plain values are read (``weights_only=True``); the
    digest must match the contents (checkpoints written before digests
    existed are read with a warning that they cannot be verified), and every
    floating-point tensor must be finite.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: the checkpoint file is empty (a save that was interrupted?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "global" in text.lower():  # a class or function to import and call: what a planted pickle needs
            first = next((line.strip() for line in text.splitlines() if "global" in line.lower()), text)
            raise CheckpointError(
                f"{path}: refused: the file holds Python objects other than tensors and plain values, which could run "
                f"code when loaded; spdkfac never writes such a file ({first[:300]})"
            ) from None
        raise CheckpointError(f"{path}: not a readable checkpoint, probably truncated or overwritten ({exc})") from None
    except Exception as exc:  # arbitrary bytes make the unpickler fail in arbitrary ways (none of them runs code)
        raise CheckpointError(
            f"{path}: not a readable checkpoint, probably truncated or overwritten ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
        raise CheckpointError(f"{path}: not a checkpoint of spdkfac.train (missing {missing})")
    _verify(path, state)
    _verified.add(_stat_key(path))
    return state


def _verify(path: Path, state: dict[str, Any]) -> None:
    recorded = state.pop(CHECKSUM_KEY, None)
    if recorded is None:
        warnings.warn(f"{path}: written without a checksum (by an older spdkfac): its contents cannot be verified", stacklevel=3)
    else:
        expected = recorded.get("sha256") if isinstance(recorded, dict) else None
        try:
            actual = content_digest(state)
        except TypeError as exc:
            raise CheckpointError(f"{path}: not a checkpoint of spdkfac.train ({exc})") from None
        if actual != expected:
            raise CheckpointError(
                f"{path}: damaged: its contents do not match the checksum written with it (sha256 {actual[:12]}…, "
                f"recorded {str(expected)[:12]}…); the file was altered or corrupted after it was saved"
            )
    bad = _first_nonfinite(state, "")
    if bad is not None:
        raise CheckpointError(f"{path}: damaged: {bad} holds NaN or Inf values (a checkpoint of a healthy run never does)")


def _first_nonfinite(value: Any, where: str) -> str | None:
    """The path of the first floating-point tensor holding a NaN or Inf, else None."""
    if isinstance(value, torch.Tensor):
        return where.lstrip(".") if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    items: Iterable[tuple[Any, Any]] = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    for key, item in items:
        found = _first_nonfinite(item, f"{where}.{key}")
        if found is not None:
            return found
    return None


def newest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest usable checkpoint in ``directory`` and its contents, or None when it holds none.

    An unusable newest checkpoint (unreadable, damaged, refused) is skipped
    with a warning that names it and says why; when every checkpoint there is
    unusable, the error of the newest is raised (starting from scratch beside
    a damaged run would hide the problem).
    """
    candidates = [directory / name for name in (LATEST, PREVIOUS) if (directory / name).exists()]
    errors: list[CheckpointError] = []
    for path in candidates:
        try:
            return path, load_checkpoint(path)
        except CheckpointError as exc:
            errors.append(exc)
            warnings.warn(f"skipping unusable checkpoint: {exc}", stacklevel=2)
    if errors:
        raise errors[0]
    return None


def changed_arguments(saved: dict[str, Any], current: dict[str, Any], ignore: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """``{name: (saved, current)}`` for every argument that differs, except those in ``ignore``."""
    skip = set(ignore)
    names = (set(saved) | set(current)) - skip
    return {name: (saved.get(name), current.get(name)) for name in sorted(names) if saved.get(name) != current.get(name)}
