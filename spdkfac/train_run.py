"""A training run's directory: refusing to overwrite, resuming from the newest valid checkpoint, the CSV log.

Every worker takes the same decision from the same directory; a resumed run
must have been made with the same training arguments (or say which changed).
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .checkpoint import LATEST, PREVIOUS, CheckpointError, changed_arguments, newest_valid
from .comm import CommBackend
from .schedules import KFACParamScheduler
from .train_startup import probe_out_dir

__all__ = ["RUNTIME_ARGS", "Position", "prepare_run_dir", "restore", "start_log"]

_CPU = torch.device("cpu")


@dataclass
class Position:
    """Where a run stands: the epoch in progress, the samples of it every worker together has consumed, the step."""

    epoch: int = 0
    samples: int = 0
    step: int = 0
    metrics: tuple[float, float, float] = (0.0, 0.0, 0.0)  # loss sum, correct, count of the epoch so far (all workers)


#: Arguments that may change between a run and its resumption without changing what is trained.
RUNTIME_ARGS = (
    "resume",
    "overwrite",
    "allow_changed_args",
    "stop_after",
    "quiet",
    "threads",
    "bind_cores",
    "workers",
    "out_dir",
    "device",
    "checkpoint_every",
    "backend",
    "perf_model",
    "collective_timeout",
)


def prepare_run_dir(
    args: argparse.Namespace, out_dir: Path, is_root: bool, backend: CommBackend, device: torch.device = _CPU
) -> tuple[Path, dict[str, Any]] | None:
    """Check ``--out-dir`` before any work, and find the checkpoint to resume from (None: a fresh run).

    Every worker takes the same decision from the same directory. A directory
    that holds a run is refused unless the run is resumed or ``--overwrite``
    replaces it; an unwritable one is refused at once, not after the first epoch.
    """
    found = None
    if args.resume is not None:
        try:
            found = newest_valid(out_dir) if out_dir.is_dir() else None
        except CheckpointError as exc:
            raise SystemExit(f"error: cannot resume: {exc}") from None
        if found is None and args.resume == "required":
            raise SystemExit(
                f"error: --resume given but {out_dir} holds no checkpoint ({out_dir / LATEST} does not exist); "
                "'--resume auto' starts afresh when there is none"
            )
    else:
        existing = [name for name in ("log.csv", LATEST, PREVIOUS) if (out_dir / name).exists()]
        if existing and not args.overwrite:
            raise SystemExit(
                f"error: {out_dir} already holds a run ({', '.join(existing)}); continue it with --resume, "
                "replace it with --overwrite, or choose another --out-dir"
            )
    backend.barrier()  # every worker has looked at the directory before rank 0 writes to it
    probe_out_dir(out_dir, is_root, backend, device)  # every worker leaves if rank 0 cannot write there
    if is_root and args.overwrite:
        for name in (LATEST, PREVIOUS):
            (out_dir / name).unlink(missing_ok=True)
    return found


def restore(
    ckpt: dict[str, Any],
    path: Path,
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    kfac_scheduler: KFACParamScheduler | None,
    size: int,
    is_root: bool,
) -> Position:
    """Load a checkpoint into the run after checking it was made by the same training (the reason if not)."""
    changed = changed_arguments(ckpt["args"], vars(args), RUNTIME_ARGS)
    if changed:
        listing = "; ".join(f"--{k.replace('_', '-')}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
        if not args.allow_changed_args:
            raise SystemExit(
                f"error: {path} was written with other training arguments ({listing}); "
                "resume with the same ones, or pass --allow-changed-args"
            )
        if is_root:
            print(f"  resuming with changed arguments: {listing}")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, RuntimeError, KeyError) as exc:
        raise SystemExit(f"error: cannot resume from {path}: {exc}") from None
    if scaler is not None and ckpt.get("grad_scaler"):
        scaler.load_state_dict(ckpt["grad_scaler"])
    if kfac_scheduler is not None and ckpt.get("kfac_scheduler"):
        kfac_scheduler.load_state_dict(ckpt["kfac_scheduler"])
    if ckpt.get("rng") is not None:
        torch.set_rng_state(ckpt["rng"])
    saved = ckpt.get("position") or {"epoch": int(ckpt["epoch"]) + 1, "samples": 0, "step": 0}
    position = Position(
        int(saved["epoch"]), int(saved["samples"]), int(saved["step"]), tuple(ckpt.get("partial_metrics") or (0.0, 0.0, 0.0))
    )
    written_by = int(ckpt.get("world_size", size))
    if written_by != size and is_root:
        print(
            f"  the checkpoint was written by {written_by} worker(s), this run has {size}: fusion and placement are "
            "planned for it and the rest of the epoch's samples re-sharded"
        )
    return position


def start_log(path: Path, fields: list[str], keep_before: int) -> None:
    """Start the CSV log, keeping the rows of the epochs before ``keep_before`` (those a resumed run does not redo)."""
    rows: list[list[str]] = []
    if keep_before > 0 and path.exists():
        with open(path, newline="") as fh:
            rows = [r for r in list(csv.reader(fh))[1:] if r and int(r[0]) < keep_before]
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(fields)
        writer.writerows(rows)
