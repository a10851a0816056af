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
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ..comm import CommBackend, get_backend, leaving_on_error, worker_device
from ..config import BaseOptimizer
from ..models import get_model
from ..runtime.affinity import bind_cores_if_asked
from ..runtime.host_memory import retain_freed_memory
from ..schedules import KFACParamScheduler
from ..variants import make_optimizer
from .args import AMP_DTYPES, DHO2_OPTIMIZERS, KFAC_OPTIMIZERS, dho2_options, kl_clip_option, parse_args
from .checkpoint import LATEST, CheckpointError, save_rotating
from .data import ShardedLoader, load_digits, load_mnist5k, synthetic
from .imagefolder import ImageFolder, ImageFolderError, make_loader
from .run import Position, prepare_run_dir, restore, start_log
from .run_dir import append_text

__all__ = ["average_over_workers", "evaluate", "lr_at", "main", "make_loaders", "parse_args"]

#: A batch of inputs and labels.
Batch = tuple[torch.Tensor, torch.Tensor]
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
    elif args.data == "synthetic":
        shape = tuple(args.synthetic_shape)
        train = synthetic(args.synthetic_size, shape, 10, seed=args.seed)
        test = synthetic(max(args.synthetic_size // 4, size), shape, 10, seed=args.seed + 1)
        model = "cifar_resnet20"
    else:
        root = Path(args.data)
        try:
            if not root.is_dir():
                raise ImageFolderError(f"--data {args.data!r} is neither 'digits', 'synthetic' nor an existing directory")
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


def lr_at(args: argparse.Namespace, base_lr: float, epoch_float: float, workers: int = 1) -> float:
    """Linear warm-up from the single-worker LR to ``base_lr`` (Goyal et al.), then cosine or step decay.

    Warming up from the single-worker LR rather than from zero matters for
    K-FAC: a near-zero LR disables the KL clip, and the unclipped first
    preconditioned update would stay in the momentum buffer while the LR grows.
    """
    warmup: float = args.warmup_epochs
    if warmup > 0 and epoch_float < warmup:
        start = base_lr / workers
        return start + (base_lr - start) * epoch_float / warmup
    if args.schedule == "cosine":
        progress = (epoch_float - args.warmup_epochs) / max(args.epochs - args.warmup_epochs, 1e-9)
        return base_lr * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))
    decays: int = sum(epoch_float >= e for e in args.lr_decay_epochs)
    return base_lr * 0.1**decays


def average_over_workers(backend: CommBackend, values: list[float], name: str, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    backend.allreduce_async(t, name).wait()
    return t.tolist()


def _autocast(device: torch.device, amp: str | None) -> torch.autocast:
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(amp or "bf16"), enabled=amp is not None)


def evaluate(
    model: nn.Module, loader: Iterable[Batch], backend: CommBackend, device: torch.device = _CPU, amp: str | None = None
) -> tuple[float, float]:
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with _autocast(device, amp):
                out = model(x)
            loss_sum += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += float((out.argmax(1) == y).sum())
            count += len(y)
    loss_sum, correct, count = average_over_workers(backend, [loss_sum, correct, count], "train.eval", device)
    model.train()
    return loss_sum / max(count, 1), correct / max(count, 1)


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
    optimizer_kwargs: dict[str, Any] = dict(momentum=args.momentum) if args.base == BaseOptimizer.SGD else dict(base=args.base)
    if args.optimizer not in DHO2_OPTIMIZERS:
        optimizer_kwargs["update_fusion"] = args.update_fusion
    if args.optimizer in KFAC_OPTIMIZERS:
        optimizer_kwargs.update(
            damping=args.damping,
            factor_decay=args.factor_decay,
            kl_clip=kl_clip_option(args),
            factor_update_freq=args.factor_update_freq,
            inv_update_freq=args.inv_update_freq,
            perf_model=args.perf_model,
            compute_method=args.compute_method,
            eigen_refresh=args.eigen_refresh,
            ekfac_decay=args.ekfac_decay,
            ekfac_update=args.ekfac_update,
            distribute_preconditioning=args.distribute_preconditioning,
        )
    elif args.optimizer in DHO2_OPTIMIZERS:  # AdamW base (no momentum); its Hessian comes from a closure (below)
        optimizer_kwargs = dict(dho2_options(args, len(train_loader)))
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    optimizer = make_optimizer(
        args.optimizer,
        model,
        lr=base_lr,
        weight_decay=args.weight_decay,
        backend=backend,
        grad_scaler=scaler,
        accumulation_steps=args.accumulation_steps,
        skip_nonfinite=args.skip_nonfinite,
        **optimizer_kwargs,
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
        """Save on rank 0; the partial-epoch metrics are averaged over every worker first (a collective)."""
        totals = average_over_workers(backend, metrics, "train.checkpoint", device)
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
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, position.epoch + args.stop_after)
    while position.epoch < last_epoch:
        epoch = position.epoch
        batches = _epoch_batches(train_loader, epoch, position.samples, args.batch_size, size)
        model.train()
        t_epoch = time.perf_counter()
        # A mid-epoch checkpoint's partial sums, averaged over its workers: each worker carries its share on.
        loss_sum, correct, count = position.metrics
        position.metrics = (0.0, 0.0, 0.0)
        iter_times: list[float] = []
        lr = lr_at(args, base_lr, epoch, size)
        for x, y in batches:
            lr = lr_at(args, base_lr, epoch + position.samples / samples_per_epoch, size)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            k = args.accumulation_steps
            for xm, ym in zip(x.chunk(k), y.chunk(k)):  # k equal micro-batches (k divides the batch size)
                with _autocast(device, args.amp):
                    out = model(xm)
                    loss = nn.functional.cross_entropy(out, ym, label_smoothing=args.label_smoothing)
                (loss / k if scaler is None else scaler.scale(loss / k)).backward()
                loss_sum += float(loss.detach()) * len(ym)
                correct += float((out.argmax(1) == ym).sum())
                count += len(ym)
            if scaler is None:
                optimizer.step(_loss_closure(model, x, y, args, device) if args.optimizer in DHO2_OPTIMIZERS else None)
            else:
                scaler.step(optimizer)
                scaler.update()
            iter_times.append(time.perf_counter() - t0)
            position.step += 1
            position.samples += args.batch_size * size
            if is_root and not args.quiet and sys.stdout.isatty():
                _progress(epoch, position.samples // (args.batch_size * size), steps_per_epoch, float(loss))
            if args.checkpoint_every and position.step % args.checkpoint_every == 0 and position.samples < samples_per_epoch:
                checkpoint([loss_sum, correct, count])
        if is_root and not args.quiet and sys.stdout.isatty():
            sys.stdout.write("\r" + " " * 70 + "\r")
        loss_sum, correct, count = average_over_workers(backend, [loss_sum, correct, count], "train.metrics", device)
        test_loss, test_acc = evaluate(model, test_loader, backend, device, args.amp)
        warm = iter_times[1:] or iter_times or [0.0]
        row = {
            "epoch": epoch,
            "train_loss": loss_sum / max(count, 1),
            "train_acc": correct / max(count, 1),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "lr": lr,
            "epoch_s": time.perf_counter() - t_epoch,
            "iter_ms": 1e3 * sum(warm) / len(warm),
        }
        position.epoch, position.samples = epoch + 1, 0
        if is_root:
            print(
                f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
                f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  lr {lr:.4g}  "
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
    if is_root:
        print(f"done: log {log_path}, checkpoint {out_dir / LATEST}")
    return row


def _loss_closure(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> Callable[[], torch.Tensor]:
    """The batch's loss recomputed with its graph: DHO2 takes Hessian-vector products from it on the steps that refresh its eigenpairs."""

    def closure() -> torch.Tensor:
        with _autocast(device, args.amp):
            return nn.functional.cross_entropy(model(x), y, label_smoothing=args.label_smoothing)

    return closure


def _epoch_batches(loader: Loader, epoch: int, samples_done: int, batch_size: int, size: int) -> Iterable[Batch]:
    """The batches of ``epoch`` still to do once ``samples_done`` of it (all workers together) are consumed."""
    if isinstance(loader, ShardedLoader):
        loader.set_epoch(epoch, start=samples_done)
        return loader
    _set_epoch(loader, epoch)
    return itertools.islice(loader, samples_done // (batch_size * size), None)  # same world size: skip those batches
