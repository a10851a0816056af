"""A training run's directory: refusing to overwrite, resuming from the newest valid checkpoint, the CSV log.

Every worker takes the same decision from the same directory; one job at a
time holds the directory (:mod:`spdkfac.train.run_dir`). A resumed run must have
been made with the same training arguments, or ``--allow-changed-args``
applies the new ones and says so: a run never trains with values other than
those it reports and records.
"""

from __future__ import annotations

import argparse
import csv
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..comm import CommBackend
from ..schedules import KFACParamScheduler
from .checkpoint import LATEST, PREVIOUS, CheckpointError, changed_arguments, newest_valid
from .run_dir import RunLock, replace_text
from .startup import RunDirError, leave_together, take_run_dir

__all__ = ["FIXED_ARGS", "RUNTIME_ARGS", "Position", "prepare_run_dir", "restore", "start_log"]

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
    "trace",
)

#: Arguments that fix what is trained or the order of its samples: a resumed run refuses to change them,
#: even with --allow-changed-args (a checkpoint of another model, data set or optimizer cannot continue;
#: another seed would draw the rest of the epoch from another permutation, repeating and skipping samples).
#: The value an argument added later had, in effect, in the checkpoints made before it existed.
ARGS_BEFORE_THEY_EXISTED = {"base": "sgd", "eigen_refresh": "exact", "ekfac_decay": 0.95, "ekfac_update": "natural"}

FIXED_ARGS = ("optimizer", "model", "data", "compute_method", "ekfac_update", "base", "seed", "synthetic_size", "synthetic_shape")


def prepare_run_dir(
    args: argparse.Namespace, out_dir: Path, is_root: bool, backend: CommBackend, device: torch.device = _CPU
) -> tuple[tuple[Path, dict[str, Any]] | None, RunLock | None]:
    """Check ``--out-dir`` before any work, lock it, and find the checkpoint to resume from.

    Returns ``(checkpoint or None for a fresh run, the directory's lock on
    rank 0)``; the caller releases the lock when the run ends. Every worker
    takes the same decision from the same directory. A directory that holds a
    run is refused unless the run is resumed or ``--overwrite`` replaces it;
    one that another job holds, or an unwritable one, is refused at once, not
    after the first epoch.
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
    lock, problem = None, ""
    if is_root:
        try:
            lock = take_run_dir(out_dir, args.overwrite)
        except RunDirError as exc:
            problem = str(exc)
    # Every worker leaves if rank 0 cannot use the directory (no worker left waiting in a collective).
    leave_together(problem, is_root, backend, device, f"rank 0 cannot use --out-dir {out_dir} (its error says why)")
    if lock is not None and lock.taken_over is not None:
        print(f"  {lock.path}: took over the lock of a job that ended without releasing it ({lock.taken_over})")
    return found, lock


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
    """Load a checkpoint into the run after checking it was made by the same training (the reason if not).

    With ``--allow-changed-args`` the changed arguments are applied: the
    values the checkpoint restores (momentum, weight decay, damping, KL-clip,
    factor decay, update frequencies and their per-epoch schedules) are
    replaced by this run's, and the message lists what was applied.
    """
    saved_args = {**ARGS_BEFORE_THEY_EXISTED, **ckpt["args"]}
    changed = changed_arguments(saved_args, vars(args), RUNTIME_ARGS)
    listing = "; ".join(f"--{k.replace('_', '-')}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
    fixed = [name for name in changed if name in FIXED_ARGS]
    if fixed:
        raise SystemExit(
            f"error: {path} was written with other training arguments ({listing}); "
            f"{', '.join('--' + n.replace('_', '-') for n in fixed)} cannot change when a run is resumed, "
            "even with --allow-changed-args: resume with the same ones, or start a new run in another --out-dir"
        )
    if changed and not args.allow_changed_args:
        raise SystemExit(
            f"error: {path} was written with other training arguments ({listing}); "
            "resume with the same ones, or pass --allow-changed-args to apply the new ones"
        )
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler is not None and ckpt.get("grad_scaler"):
            scaler.load_state_dict(ckpt["grad_scaler"])
        if kfac_scheduler is not None and ckpt.get("kfac_scheduler"):
            kfac_scheduler.load_state_dict(ckpt["kfac_scheduler"])
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: cannot resume from {path}: {exc}") from None
    if changed:
        _apply_arguments(args, optimizer, kfac_scheduler)
        if is_root:
            print(f"  resuming with changed arguments, applied: {listing}")
    if ckpt.get("rng") is not None:
        torch.set_rng_state(ckpt["rng"])
    saved = ckpt.get("position") or {"epoch": int(ckpt["epoch"]) + 1, "samples": 0, "step": 0}
    written_by = int(ckpt.get("world_size", size))
    # The checkpoint holds the partial sums averaged over its workers; every worker of this run carries its share
    # so that averaging over this run's workers at the end of the epoch gives the sums an uninterrupted run would.
    partial = ckpt.get("partial_metrics") or (0.0, 0.0, 0.0)
    share = written_by / size  # exactly 1.0 on the same worker count
    metrics = (float(partial[0]) * share, float(partial[1]) * share, float(partial[2]) * share)
    position = Position(int(saved["epoch"]), int(saved["samples"]), int(saved["step"]), metrics)
    if written_by != size and is_root:
        print(
            f"  the checkpoint was written by {written_by} worker(s), this run has {size}: fusion and placement are "
            "planned for it and the rest of the epoch's samples re-sharded"
        )
    return position


def _apply_arguments(args: argparse.Namespace, optimizer: torch.optim.Optimizer, kfac_scheduler: KFACParamScheduler | None) -> None:
    """Put this run's hyperparameters in force over the ones a checkpoint restored.

    The learning rate, epochs, warm-up and everything else the training loop
    reads from ``args`` apply by themselves; these are the values that
    ``load_state_dict`` brought back from the checkpoint.
    """
    values = dict(
        momentum=args.momentum, weight_decay=args.weight_decay, damping=args.damping, kl_clip=args.kl_clip, factor_decay=args.factor_decay
    )
    for group in optimizer.param_groups:  # the keys an optimizer keeps there (DHO2 keeps its options in its config)
        group.update({key: value for key, value in values.items() if key in group})
    if kfac_scheduler is None:
        return
    optimizer_freqs = ("factor_update_freq", "inv_update_freq")
    for name, value in zip(optimizer_freqs, (args.factor_update_freq, args.inv_update_freq)):
        setattr(optimizer, name, value)
    # The scheduler's bases and per-epoch rules come from this run's arguments; the epoch it stands at from the checkpoint.
    kfac_scheduler.base_damping = args.damping
    kfac_scheduler.base_factor_update_freq, kfac_scheduler.base_inv_update_freq = args.factor_update_freq, args.inv_update_freq
    kfac_scheduler.damping_alpha, kfac_scheduler.damping_schedule = args.damping_decay, list(args.damping_decay_epochs)
    kfac_scheduler.update_freq_alpha, kfac_scheduler.update_freq_schedule = args.freq_scale, list(args.freq_scale_epochs)
    kfac_scheduler.apply()


def start_log(path: Path, fields: list[str], keep_before: int) -> None:
    """Start the CSV log, keeping the rows of the epochs before ``keep_before`` (those a resumed run does not redo).

    A row that cannot be read (a damaged log) is dropped with a warning naming
    the file and line; the log is written anew through a rename, never
    through a symlink.
    """
    rows: list[list[str]] = []
    if keep_before > 0 and path.exists():
        with open(path, newline="", errors="replace") as fh:
            # A NUL byte is replaced as undecodable bytes are (Python < 3.11's csv raises on it: the resume died).
            for line, row in enumerate(csv.reader(text.replace("\0", "\ufffd") for text in fh), start=1):
                if line == 1 or not row:
                    continue
                try:
                    epoch = int(row[0])
                except ValueError:
                    warnings.warn(f"{path}, line {line}: not a row of the log ({','.join(row)[:60]!r}); dropped", stacklevel=2)
                    continue
                if epoch < keep_before and len(row) == len(fields):
                    rows.append(row)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(fields)
    writer.writerows(rows)
    replace_text(path, out.getvalue())
