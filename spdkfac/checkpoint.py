"""Checkpoints of the training job: atomic, the last two kept, validated on load, found again after a restart.

A run directory holds ``checkpoint.pt`` (the newest) and ``checkpoint.prev.pt``
(the one before). Each is written to a temporary file, flushed to disk and
renamed into place, so a worker killed while saving leaves the previous
checkpoints intact; a checkpoint that cannot be read (truncated, garbage,
empty) is reported by path, and :func:`newest_valid` falls back to the
previous one.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LATEST",
    "PREVIOUS",
    "CheckpointError",
    "changed_arguments",
    "load_checkpoint",
    "newest_valid",
    "save_rotating",
]

LATEST = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
#: What every checkpoint of the training job holds.
REQUIRED_KEYS = ("model", "optimizer", "epoch", "args")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used; the message names the file and why."""


def save_rotating(state: dict[str, Any], directory: Path) -> Path:
    """Write ``state`` as the newest checkpoint of ``directory``, keeping the previous newest as ``checkpoint.prev.pt``."""
    latest, previous = directory / LATEST, directory / PREVIOUS
    tmp = directory / (LATEST + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    if latest.exists():
        os.replace(latest, previous)
    os.replace(tmp, latest)  # between the two renames only the previous checkpoint exists: still a valid one
    return latest


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a training-job checkpoint, or raise :class:`CheckpointError` naming the file and the problem."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: the checkpoint file is empty (a save that was interrupted?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(
            f"{path}: not a readable checkpoint, probably truncated or overwritten ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
        raise CheckpointError(f"{path}: not a checkpoint of spdkfac.train (missing {missing})")
    return state


def newest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint in ``directory`` and its contents, or None when it holds none.

    An unreadable newest checkpoint is skipped with a warning that names it;
    when every checkpoint there is unreadable, the error of the newest is raised
    (starting from scratch beside a damaged run would hide the problem).
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
