"""The training job: swap SGD for SPD-KFAC in a data-parallel run.

Launch with Horovod (default engine) or torchrun, for example::

    horovodrun -np 2 -H localhost:2 --gloo python -m spdkfac.train --data digits
    torchrun --nproc_per_node 2 -m spdkfac.train --data digits --backend torch

Prints per-epoch loss/accuracy and iteration time on rank 0, writes a CSV log
and a checkpoint every epoch (``--resume`` continues from it exactly).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import os
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Union

import torch
from torch.utils.data import DataLoader

from ..comm import CommBackend, get_backend, leaving_on_error, worker_device
from ..models import get_model
from ..optimizer import SPDKFACOptimizer
from ..runtime.affinity import bind_cores_if_asked
from ..runtime.host_memory import retain_freed_memory
from ..schedules import KFACParamScheduler
from ..variants import make_optimizer
from .args import KFAC_OPTIMIZERS, dho2_options, parse_args
from .checkpoint import LATEST, CheckpointError, save_rotating
from .data import ShardedLoader, load_digits, load_mnist5k, load_pycode, load_pycode_words, synthetic
from .imagefolder import ImageFolder, ImageFolderError, make_loader
from .loop import Batch, EpochTotals, TrainingStep, average_over_workers, evaluate, lr_at, train_epoch
from .optimizer_options import optimizer_options
from .run import Position, prepare_run_dir, restore, start_log
from .run_dir import append_text
from .trace import TraceRecorder

__all__ = ["average_over_workers", "evaluate", "lr_at", "main", "make_loaders", "parse_args"]

#: The in-memory data sets' loader, or a DataLoader over an image directory (``--data DIR``).
Loader = Union[ShardedLoader, DataLoader[tuple[torch.Tensor, int]]]

_CPU = torch.device("cpu")


def make_loaders(args: argparse.Namespace, rank: int, size: int) -> tuple[Loader, Loader, int, str]:
    """(train loader, test loader, number of classes, default model name) for ``--data``."""
    if args.data == "digits":
        train, test = load_digits(seed=args.seed)
        model = "digits_cnn"
    elif args.data == "mnist5k":
        train, test = load_mnist5k(seed=args.seed)
        model = "mnist_cnn"
    elif args.data == "pycode":
        train, test = load_pycode(seed=args.seed)
        model = "char_gpt"
    elif args.data == "pycode-words":
        train, test = load_pycode_words(seed=args.seed)
        model = "tied_llama"
    elif args.data == "synthetic":
        shape = tuple(args.synthetic_shape)
        train = synthetic(args.synthetic_size, shape, 10, seed=args.seed)
        test = synthetic(max(args.synthetic_size // 4, size), shape, 10, seed=args.seed + 1)
        model = "cifar_resnet20"
    else:
        root = Path(args.data)
        try:
            if not root.is_dir():
                raise ImageFolderError(
                    f"--data {args.data!r} is neither 'digits', 'mnist5k', 'pycode', 'pycode-words', 'synthetic' nor an existing directory"
                )
            train_set = ImageFolder(root / "train", args.image_size, train=True)
            val_set = ImageFolder(root / "val", args.image_size, train=False, classes=train_set.classes)
        except ImageFolderError as exc:
            raise SystemExit(f"error: {exc}") from None
        if len(train_set) < args.batch_size * size:
            raise SystemExit(f"error: {root / 'train'} has {len(train_set)} images, fewer than one global batch ({args.batch_size * size})")
        return (
            make_loader(train_set, args.batch_size, rank, size, True, args.workers, args.seed),
            make_loader(val_set, args.batch_size, rank, size, False, args.workers),
            len(train_set.classes),
            "resnet50",
        )
    return (
        ShardedLoader(train, args.batch_size, rank, size, shuffle=True, seed=args.seed),
        ShardedLoader(test, 256, rank, size, shuffle=False),
        train.num_classes,
        model,
    )


def _set_epoch(loader: Loader, epoch: int) -> None:
    if isinstance(loader, ShardedLoader):
        loader.set_epoch(epoch)
        return
    set_sampler_epoch = getattr(loader.sampler, "set_epoch", None)  # a DistributedSampler's
    if set_sampler_epoch is not None:
        set_sampler_epoch(epoch)


def _progress(epoch: int, it: int, total: int, loss: float, width: int = 24) -> None:
    done = int(width * it / total)
    sys.stdout.write(f"\r  epoch {epoch:3d} [{'#' * done}{'.' * (width - done)}] {it}/{total} loss {loss:.4f}")
    sys.stdout.flush()


def _engine_settings(backend: CommBackend) -> str:
    """Horovod's background cycle, which matters on CPU nodes (``HOROVOD_CYCLE_TIME``; launch_horovod.sh's CYCLE_MS)."""
    if backend.name != "horovod":
        return ""
    cycle = os.environ.get("HOROVOD_CYCLE_TIME", "1")
    with contextlib.suppress(ValueError):
        cycle = f"{float(cycle):g}"  # horovodrun --cycle-time-ms 20 exports "20.0"
    return f" (cycle {cycle} ms)"


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the training job; returns the last epoch's metrics. The run directory is locked while it runs.

    On an error, this worker leaves at once instead of waiting for the others at exit (they may never come).
    """
    try:
        with contextlib.ExitStack() as held:
            return _train(argv, held)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (None, 0)):
            leaving_on_error()
        raise


def _train(argv: list[str] | None, held: contextlib.ExitStack) -> dict[str, float]:
    args = parse_args(argv)
    cores = bind_cores_if_asked(args)
    retain_freed_memory()  # CPU activations are reused, not page-faulted in every iteration
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    backend = get_backend(args.backend, collective_timeout=args.collective_timeout)
    rank, size = backend.rank, backend.size
    is_root = rank == 0
    device = worker_device(args.device)
    if not is_root:
        warnings.filterwarnings("ignore")

    train_loader, test_loader, num_classes, default_model = make_loaders(args, rank, size)
    model_name = args.model or default_model
    model = get_model(model_name, num_classes=num_classes).to(device)
    base_lr = args.lr * size
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    optimizer = make_optimizer(
        args.optimizer,
        model,
        lr=base_lr,
        backend=backend,
        grad_scaler=scaler,
        accumulation_steps=args.accumulation_steps,
        skip_nonfinite=args.skip_nonfinite,
        **optimizer_options(args.optimizer, args, dho2=dho2_options(args, len(train_loader))),
    )
    tracer = TraceRecorder(optimizer, args.trace, Path(args.out_dir) / "trace.json", backend) if args.trace else None
    training_step = TrainingStep(
        model,
        optimizer,
        base_lr,
        device,
        amp=args.amp,
        scaler=scaler,
        accumulation_steps=args.accumulation_steps,
        label_smoothing=args.label_smoothing,
    )
    # The per-epoch damping decay / update-frequency scaling of Pauloski et al. (K-FAC optimizers only).
    kfac_scheduler = None
    if args.optimizer in KFAC_OPTIMIZERS:
        kfac_scheduler = KFACParamScheduler(
            optimizer,
            damping_alpha=args.damping_decay,
            damping_schedule=args.damping_decay_epochs,
            update_freq_alpha=args.freq_scale,
            update_freq_schedule=args.freq_scale_epochs,
        )

    out_dir = Path(args.out_dir)
    resume, lock = prepare_run_dir(args, out_dir, is_root, backend, device)
    if lock is not None:
        held.enter_context(lock)
    position = Position()
    if resume is not None:
        ckpt_path, ckpt = resume
        position = restore(ckpt, ckpt_path, args, model, optimizer, scaler, kfac_scheduler, size, is_root)
        if position.samples and ckpt.get("world_size", size) != size and not isinstance(train_loader, ShardedLoader):
            raise SystemExit(
                f"error: {ckpt_path} was written mid-epoch by {ckpt['world_size']} workers; directory data "
                f"resumes mid-epoch only on as many workers (this run has {size})"
            )
    if is_root:
        print(
            f"spdkfac.train: {args.optimizer} on {args.data} ({len(train_loader)} batches/epoch/worker), "
            f"model {model_name}, {size} worker(s) via {backend.name}{_engine_settings(backend)} on {device}"
            f"{f' ({args.amp} autocast)' if args.amp else ''}, "
            f"batch {args.batch_size}/worker, lr {base_lr:g}" + (f", rank 0 bound to cores {cores}" if cores else "")
        )
        if args.optimizer in KFAC_OPTIMIZERS:
            print(
                f"  {len(optimizer.layers)} preconditioned layers, base {optimizer.config.base}, "
                f"damping {optimizer.param_groups[0]['damping']:g}, "
                f"kl_clip {args.kl_clip:g}, factor/inverse update every {optimizer.factor_update_freq}/"
                f"{optimizer.inv_update_freq} steps; placement: {optimizer.work_plan.inversion!r}"
            )
            print("\n".join(f"  {line}" for line in optimizer.kfac_summary().splitlines()))
        if resume is not None:
            print(
                f"  resumed from {resume[0]}: step {position.step}, epoch {position.epoch}, {position.samples} samples of it done",
                flush=True,
            )
    log_path = out_dir / "log.csv"
    fields = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "epoch_s", "iter_ms"]
    if is_root:
        start_log(log_path, fields, keep_before=position.epoch if resume is not None else 0)

    def checkpoint(metrics: list[float]) -> None:
        """Save on rank 0; the partial-epoch metrics are averaged over every worker first, and the decompositions
        split over the workers gathered on rank 0 (collectives: a resume recomputes nothing)."""
        totals = average_over_workers(backend, metrics, "train.checkpoint", device)
        if isinstance(optimizer, SPDKFACOptimizer):
            optimizer.consolidate_state_dict()
        if not is_root:
            return
        try:
            save_rotating(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": position.epoch - 1,
                    "position": asdict(position),
                    "partial_metrics": totals,
                    "world_size": size,
                    "rng": torch.get_rng_state(),
                    "args": vars(args),
                    "grad_scaler": scaler.state_dict() if scaler is not None else None,
                    "kfac_scheduler": kfac_scheduler.state_dict() if kfac_scheduler is not None else None,
                },
                out_dir,
            )
        except CheckpointError as exc:
            raise SystemExit(f"error: {exc}") from None

    steps_per_epoch = len(train_loader)
    samples_per_epoch = steps_per_epoch * args.batch_size * size
    row: dict[str, float] = {}

    def lr_now(_: int) -> float:
        """The schedule's LR at the samples done so far (a resumed run starts mid-epoch)."""
        return lr_at(args, base_lr, position.epoch + position.samples / samples_per_epoch, size)

    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, position.epoch + args.stop_after)
    while position.epoch < last_epoch:
        epoch = position.epoch
        batches = _epoch_batches(train_loader, epoch, position.samples, args.batch_size, size)
        model.train()
        t_epoch = time.perf_counter()
        # A mid-epoch checkpoint's partial sums, averaged over its workers: each worker carries its share on.
        loss_sum, correct, count = position.metrics
        totals = EpochTotals(loss_sum, correct, count)
        position.metrics = (0.0, 0.0, 0.0)
        # Each step sets its own LR (lr_now); this one is the LR logged and checkpointed for an epoch with no
        # step left (a mid-epoch checkpoint resumed on more workers can leave none), not the peak LR.
        training_step.set_lr(lr_at(args, base_lr, epoch, size))
        for loss in train_epoch(training_step, batches, lr_now, totals):
            position.step += 1
            position.samples += args.batch_size * size
            if tracer is not None:
                tracer.stepped()
            if is_root and not args.quiet and sys.stdout.isatty():
                _progress(epoch, position.samples // (args.batch_size * size), steps_per_epoch, float(loss))
            if args.checkpoint_every and position.step % args.checkpoint_every == 0 and position.samples < samples_per_epoch:
                checkpoint([totals.loss_sum, totals.correct, totals.count])
        if is_root and not args.quiet and sys.stdout.isatty():
            sys.stdout.write("\r" + " " * 70 + "\r")
        loss_sum, correct, count = average_over_workers(backend, [totals.loss_sum, totals.correct, totals.count], "train.metrics", device)
        test_loss, test_acc = evaluate(model, test_loader, backend, device, args.amp)
        warm = totals.iter_s[1:] or totals.iter_s or [0.0]
        row = {
            "epoch": epoch,
            "train_loss": loss_sum / max(count, 1),
            "train_acc": correct / max(count, 1),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "lr": training_step.lr,
            "epoch_s": time.perf_counter() - t_epoch,
            "iter_ms": 1e3 * sum(warm) / len(warm),
        }
        position.epoch, position.samples = epoch + 1, 0
        if is_root:
            print(
                f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
                f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  lr {row['lr']:.4g}  "
                f"iter {row['iter_ms']:.1f} ms  epoch {row['epoch_s']:.1f} s",
                flush=True,
            )
            line = io.StringIO()
            csv.writer(line).writerow([row[f] for f in fields])
            append_text(log_path, line.getvalue())
        if kfac_scheduler is not None:  # the next epoch's damping and update frequencies (saved with the checkpoint)
            before = (optimizer.param_groups[0]["damping"], optimizer.factor_update_freq, optimizer.inv_update_freq)
            kfac_scheduler.step()
            after = (optimizer.param_groups[0]["damping"], optimizer.factor_update_freq, optimizer.inv_update_freq)
            if is_root and after != before and epoch + 1 < args.epochs:
                print(f"  from epoch {epoch + 1}: damping {after[0]:g}, factor/inverse update every {after[1]}/{after[2]} steps")
        checkpoint([0.0, 0.0, 0.0])
    if tracer is not None:
        tracer.finish()  # (fewer steps than asked for: what was recorded)
    if is_root:
        print(f"done: log {log_path}, checkpoint {out_dir / LATEST}")
    return row


def _epoch_batches(loader: Loader, epoch: int, samples_done: int, batch_size: int, size: int) -> Iterable[Batch]:
    """The batches of ``epoch`` still to do once ``samples_done`` of it (all workers together) are consumed."""
    if isinstance(loader, ShardedLoader):
        loader.set_epoch(epoch, start=samples_done)
        return loader
    _set_epoch(loader, epoch)
    return itertools.islice(loader, samples_done // (batch_size * size), None)  # same world size: skip those batches
