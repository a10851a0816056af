"""The training job: swap SGD for SPD-KFAC in a data-parallel run.

Launch with Horovod (default engine) or torchrun, for example::

    horovodrun -np 2 -H localhost:2 --gloo python -m spdkfac.train --data digits
    torchrun --nproc_per_node 2 -m spdkfac.train --data digits --backend torch

Prints per-epoch loss/accuracy and iteration time on rank 0, writes a CSV log
and a checkpoint every epoch (``--resume`` continues from it exactly).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from .affinity import add_bind_cores_option, bind_cores_if_asked
from .checkpoint import LATEST, PREVIOUS, CheckpointError, changed_arguments, newest_valid, save_rotating
from .comm import DEVICE_CHOICES, CommBackend, get_backend, worker_device
from .data import ShardedLoader, load_digits, load_mnist5k, synthetic
from .host_memory import retain_freed_memory
from .models import MODELS, get_model
from .schedules import KFACParamScheduler
from .variants import make_optimizer

__all__ = ["main", "parse_args"]

OPTIMIZERS = ("sgd", "spdkfac", "dkfac", "mpdkfac")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="digits",
                   help="'digits' (bundled with scikit-learn), 'synthetic', or an ImageNet-style directory with train/ and val/")
    p.add_argument("--image-size", type=int, default=224, help="crop size for directory data")
    p.add_argument("--workers", type=int, default=2, help="data-loading processes per worker (directory data)")
    p.add_argument("--model", default=None, help=f"model name, one of {sorted(MODELS)} (default: per data set)")
    p.add_argument("--optimizer", default="spdkfac", choices=OPTIMIZERS)
    p.add_argument("--backend", default="auto", choices=("auto", "horovod", "torch", "single"))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.05, help="base learning rate (scaled by the number of workers)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--schedule", default="cosine", choices=("cosine", "step"))
    p.add_argument("--lr-decay-epochs", type=int, nargs="*", default=[], help="epochs where --schedule step divides the LR by 10")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--damping", type=float, default=None, help="Tikhonov damping (default: the paper's 0.003)")
    p.add_argument("--factor-decay", type=float, default=0.95)
    p.add_argument("--kl-clip", type=float, default=None,
                   help="KL-clip bound (default: the paper's 0.001; 1e-4 for --data digits, whose tiny CNN "
                        "overfits with the ImageNet value: final test loss 0.14 against 0.055)")
    p.add_argument("--factor-update-freq", type=int, default=1)
    p.add_argument("--inv-update-freq", type=int, default=1)
    p.add_argument("--damping-decay", type=float, default=1.0,
                   help="multiply the damping by this at each epoch of --damping-decay-epochs (e.g. 0.5)")
    p.add_argument("--damping-decay-epochs", type=int, nargs="*", default=[], help="epochs where the damping decays")
    p.add_argument("--freq-scale", type=float, default=1.0,
                   help="multiply both update frequencies by this at each epoch of --freq-scale-epochs (e.g. 10: "
                        "update factors and inverses less often once the Fisher is stable)")
    p.add_argument("--freq-scale-epochs", type=int, nargs="*", default=[], help="epochs where the update frequencies scale")
    p.add_argument("--accumulation-steps", type=int, default=1,
                   help="split each per-worker batch into this many micro-batches (gradient accumulation: one step, "
                        "the memory of one micro-batch)")
    p.add_argument("--compute-method", default="inverse", choices=("inverse", "eigen"),
                   help="precondition with damped inverses of each factor, or with their eigendecompositions "
                        "(damping added to the eigenvalues of A⊗G)")
    p.add_argument("--skip-nonfinite", type=int, default=10,
                   help="skip up to this many consecutive steps that meet NaN/Inf (on every worker alike) before "
                        "stopping with an error; 0 stops at the first")
    p.add_argument("--perf-model", default=None, help="fitted performance-model JSON (perfmodels/*.json)")
    p.add_argument("--distribute-preconditioning", action="store_true",
                   help="precondition each layer on one worker and broadcast the result (K-FAC optimizers)")
    p.add_argument("--synthetic-size", type=int, default=512)
    p.add_argument("--synthetic-shape", type=int, nargs="+", default=[3, 32, 32])
    p.add_argument("--out-dir", default="runs/latest",
                   help="checkpoints and CSV log go here; a directory that holds a run is never overwritten unless "
                        "--overwrite is given")
    p.add_argument("--resume", nargs="?", const="required", default=None, metavar="auto",
                   help="continue the run in --out-dir from its newest valid checkpoint; '--resume auto' starts afresh "
                        "when there is none (what a restarted elastic job needs)")
    p.add_argument("--overwrite", action="store_true", help="replace the run that --out-dir holds")
    p.add_argument("--allow-changed-args", action="store_true",
                   help="resume even though training arguments differ from the checkpoint's (they are listed)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="also checkpoint every K optimizer steps (mid-epoch; the last two checkpoints are kept)")
    p.add_argument("--stop-after", type=int, default=None, help="leave after this many epochs of this run (resume later)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    add_bind_cores_option(p)
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="auto: the worker's own GPU (local rank) when CUDA is available, else the CPU")
    p.add_argument("--amp", nargs="?", const="bf16", default=None, choices=tuple(AMP_DTYPES),
                   help="autocast forward/backward in bfloat16 (--amp, --amp bf16) or float16 with loss scaling "
                        "(--amp fp16); K-FAC factors stay float32")
    p.add_argument("--quiet", action="store_true", help="no per-iteration progress line")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.skip_nonfinite < 0:
        p.error("--skip-nonfinite must be >= 0")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    if args.resume not in (None, "required", "auto"):
        p.error(f"--resume takes no value or 'auto', got {args.resume!r}")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite contradict each other: continue the run, or replace it")
    if args.accumulation_steps < 1 or args.batch_size % args.accumulation_steps:
        p.error(f"--accumulation-steps must be >= 1 and divide --batch-size ({args.batch_size}), got {args.accumulation_steps}")
    for flag, value in (("--damping-decay", args.damping_decay), ("--freq-scale", args.freq_scale)):
        if not (math.isfinite(value) and value > 0):
            p.error(f"{flag} must be a positive number, got {value}")
    for flag, epochs in (("--damping-decay-epochs", args.damping_decay_epochs), ("--freq-scale-epochs", args.freq_scale_epochs)):
        if any(e < 0 for e in epochs):
            p.error(f"{flag} must be non-negative epochs, got {epochs}")
    if args.optimizer == "sgd":
        kfac_only = {
            "--damping": args.damping is not None, "--kl-clip": args.kl_clip is not None,
            "--factor-decay": args.factor_decay != 0.95, "--factor-update-freq": args.factor_update_freq != 1,
            "--inv-update-freq": args.inv_update_freq != 1, "--distribute-preconditioning": args.distribute_preconditioning,
            "--compute-method": args.compute_method != "inverse",
            "--damping-decay": args.damping_decay != 1.0, "--damping-decay-epochs": bool(args.damping_decay_epochs),
            "--freq-scale": args.freq_scale != 1.0, "--freq-scale-epochs": bool(args.freq_scale_epochs),
        }
        given = [flag for flag, set_ in kfac_only.items() if set_]
        if given:
            p.error(f"{', '.join(given)} only apply to the K-FAC optimizers, not --optimizer sgd")
    if args.damping is None:
        args.damping = 0.003
    if args.kl_clip is None:
        args.kl_clip = 1e-4 if args.data == "digits" else 0.001
    return args


def _loaders(args: argparse.Namespace, rank: int, size: int):
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
        from .imagefolder import ImageFolder, ImageFolderError, make_loader

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
        return (make_loader(train_set, args.batch_size, rank, size, True, args.workers, args.seed),
                make_loader(val_set, args.batch_size, rank, size, False, args.workers), len(train_set.classes), "resnet50")
    return (ShardedLoader(train, args.batch_size, rank, size, shuffle=True, seed=args.seed),
            ShardedLoader(test, 256, rank, size, shuffle=False), train.num_classes, model)


def _set_epoch(loader, epoch: int) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)


def lr_at(args: argparse.Namespace, base_lr: float, epoch_float: float, workers: int = 1) -> float:
    """Linear warm-up from the single-worker LR to ``base_lr`` (Goyal et al.), then cosine or step decay.

    Warming up from the single-worker LR rather than from zero matters for
    K-FAC: a near-zero LR disables the KL clip, and the unclipped first
    preconditioned update would stay in the momentum buffer while the LR grows.
    """
    if args.warmup_epochs > 0 and epoch_float < args.warmup_epochs:
        start = base_lr / workers
        return start + (base_lr - start) * epoch_float / args.warmup_epochs
    if args.schedule == "cosine":
        progress = (epoch_float - args.warmup_epochs) / max(args.epochs - args.warmup_epochs, 1e-9)
        return base_lr * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))
    return base_lr * 0.1 ** sum(epoch_float >= e for e in args.lr_decay_epochs)


def _average(backend: CommBackend, values: List[float], name: str, device: torch.device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    backend.allreduce_async(t, name).wait()
    return t.tolist()


def _autocast(device: torch.device, amp: Optional[str]) -> torch.autocast:
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(amp or "bf16"), enabled=amp is not None)


def evaluate(model: nn.Module, loader: ShardedLoader, backend: CommBackend, device: torch.device = torch.device("cpu"),
             amp: Optional[str] = None) -> tuple[float, float]:
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
    loss_sum, correct, count = _average(backend, [loss_sum, correct, count], "train.eval", device)
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
    try:
        cycle = f"{float(cycle):g}"  # horovodrun --cycle-time-ms 20 exports "20.0"
    except ValueError:
        pass
    return f" (cycle {cycle} ms)"


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    cores = bind_cores_if_asked(args)
    retain_freed_memory()  # CPU activations are reused, not page-faulted in every iteration
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    backend = get_backend(args.backend)
    rank, size = backend.rank, backend.size
    is_root = rank == 0
    device = worker_device(args.device)
    if not is_root:
        warnings.filterwarnings("ignore")

    train_loader, test_loader, num_classes, default_model = _loaders(args, rank, size)
    model_name = args.model or default_model
    model = get_model(model_name, num_classes=num_classes).to(device)
    base_lr = args.lr * size
    kfac_kwargs = {}
    if args.optimizer != "sgd":
        kfac_kwargs = dict(
            damping=args.damping, factor_decay=args.factor_decay, kl_clip=args.kl_clip,
            factor_update_freq=args.factor_update_freq, inv_update_freq=args.inv_update_freq, perf_model=args.perf_model,
            compute_method=args.compute_method,
            distribute_preconditioning=args.distribute_preconditioning,
        )
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    optimizer = make_optimizer(
        args.optimizer, model, lr=base_lr, momentum=args.momentum, weight_decay=args.weight_decay, backend=backend,
        grad_scaler=scaler, accumulation_steps=args.accumulation_steps, skip_nonfinite=args.skip_nonfinite, **kfac_kwargs
    )
    # The per-epoch damping decay / update-frequency scaling of Pauloski et al. (K-FAC optimizers only).
    kfac_scheduler = None
    if args.optimizer != "sgd":
        kfac_scheduler = KFACParamScheduler(
            optimizer, damping_alpha=args.damping_decay, damping_schedule=args.damping_decay_epochs,
            update_freq_alpha=args.freq_scale, update_freq_schedule=args.freq_scale_epochs,
        )

    out_dir = Path(args.out_dir)
    resume = _prepare_run_dir(args, out_dir, is_root, backend)
    position = Position()
    if resume is not None:
        ckpt_path, ckpt = resume
        position = _restore(ckpt, ckpt_path, args, model, optimizer, scaler, kfac_scheduler, size, is_root)
        if position.samples and ckpt.get("world_size", size) != size and not isinstance(train_loader, ShardedLoader):
            raise SystemExit(f"error: {ckpt_path} was written mid-epoch by {ckpt['world_size']} workers; directory data "
                             f"resumes mid-epoch only on as many workers (this run has {size})")
    if is_root:
        print(f"spdkfac.train: {args.optimizer} on {args.data} ({len(train_loader)} batches/epoch/worker), "
              f"model {model_name}, {size} worker(s) via {backend.name}{_engine_settings(backend)} on {device}"
              f"{f' ({args.amp} autocast)' if args.amp else ''}, "
              f"batch {args.batch_size}/worker, lr {base_lr:g}" + (f", rank 0 bound to cores {cores}" if cores else ""))
        if args.optimizer != "sgd":
            print(f"  {len(optimizer.layers)} preconditioned layers, damping {optimizer.param_groups[0]['damping']:g}, "
                  f"kl_clip {args.kl_clip:g}, factor/inverse update every {optimizer.factor_update_freq}/"
                  f"{optimizer.inv_update_freq} steps; placement: {optimizer.work_plan.inversion!r}")
        if resume is not None:
            print(f"  resumed from {resume[0]}: step {position.step}, epoch {position.epoch}, "
                  f"{position.samples} samples of it done", flush=True)
    log_path = out_dir / "log.csv"
    fields = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "epoch_s", "iter_ms"]
    if is_root:
        _start_log(log_path, fields, keep_before=position.epoch if resume is not None else 0)

    def checkpoint(metrics: List[float]) -> None:
        """Save on rank 0; the partial-epoch metrics are summed over every worker first (a collective)."""
        totals = _average(backend, metrics, "train.checkpoint", device)
        if is_root:
            save_rotating({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": position.epoch - 1,
                           "position": asdict(position), "partial_metrics": totals, "world_size": size,
                           "rng": torch.get_rng_state(), "args": vars(args),
                           "grad_scaler": scaler.state_dict() if scaler is not None else None,
                           "kfac_scheduler": kfac_scheduler.state_dict() if kfac_scheduler is not None else None}, out_dir)

    steps_per_epoch = len(train_loader)
    samples_per_epoch = steps_per_epoch * args.batch_size * size
    row: Dict[str, float] = {}
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, position.epoch + args.stop_after)
    while position.epoch < last_epoch:
        epoch = position.epoch
        batches = _epoch_batches(train_loader, epoch, position.samples, args.batch_size, size)
        model.train()
        t_epoch = time.perf_counter()
        # The partial sums a mid-epoch checkpoint saved are every worker's: rank 0 carries them on.
        loss_sum, correct, count = position.metrics if is_root else (0.0, 0.0, 0.0)
        position.metrics = (0.0, 0.0, 0.0)
        iter_times: List[float] = []
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
                optimizer.step()
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
        loss_sum, correct, count = _average(backend, [loss_sum, correct, count], "train.metrics", device)
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
            print(f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
                  f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  lr {lr:.4g}  "
                  f"iter {row['iter_ms']:.1f} ms  epoch {row['epoch_s']:.1f} s", flush=True)
            with open(log_path, "a", newline="") as fh:
                csv.writer(fh).writerow([row[f] for f in fields])
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


@dataclass
class Position:
    """Where a run stands: the epoch in progress, the samples of it every worker together has consumed, the step."""

    epoch: int = 0
    samples: int = 0
    step: int = 0
    metrics: Tuple[float, float, float] = (0.0, 0.0, 0.0)  # loss sum, correct, count of the epoch so far (all workers)


#: Arguments that may change between a run and its resumption without changing what is trained.
RUNTIME_ARGS = ("resume", "overwrite", "allow_changed_args", "stop_after", "quiet", "threads", "bind_cores", "workers",
                "out_dir", "device", "checkpoint_every", "backend", "perf_model")


def _prepare_run_dir(args: argparse.Namespace, out_dir: Path, is_root: bool, backend: CommBackend) -> Optional[Tuple[Path, Dict]]:
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
            raise SystemExit(f"error: --resume given but {out_dir} holds no checkpoint ({out_dir / LATEST} does not exist); "
                             "'--resume auto' starts afresh when there is none")
    else:
        existing = [name for name in ("log.csv", LATEST, PREVIOUS) if (out_dir / name).exists()]
        if existing and not args.overwrite:
            raise SystemExit(f"error: {out_dir} already holds a run ({', '.join(existing)}); continue it with --resume, "
                             "replace it with --overwrite, or choose another --out-dir")
    backend.barrier()  # every worker has looked at the directory before rank 0 writes to it
    if is_root:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            probe = out_dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise SystemExit(f"error: cannot write to --out-dir {out_dir}: {exc}") from None
        if args.overwrite:
            for name in (LATEST, PREVIOUS):
                (out_dir / name).unlink(missing_ok=True)
    return found


def _restore(ckpt: Dict, path: Path, args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: Optional[torch.amp.GradScaler], kfac_scheduler: Optional[KFACParamScheduler], size: int,
             is_root: bool) -> Position:
    """Load a checkpoint into the run after checking it was made by the same training (the reason if not)."""
    changed = changed_arguments(ckpt["args"], vars(args), RUNTIME_ARGS)
    if changed:
        listing = "; ".join(f"--{k.replace('_', '-')}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
        if not args.allow_changed_args:
            raise SystemExit(f"error: {path} was written with other training arguments ({listing}); "
                             "resume with the same ones, or pass --allow-changed-args")
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
    position = Position(int(saved["epoch"]), int(saved["samples"]), int(saved["step"]),
                        tuple(ckpt.get("partial_metrics") or (0.0, 0.0, 0.0)))  # type: ignore[arg-type]
    written_by = int(ckpt.get("world_size", size))
    if written_by != size and is_root:
        print(f"  the checkpoint was written by {written_by} worker(s), this run has {size}: fusion and placement are "
              "planned for it and the rest of the epoch's samples re-sharded")
    return position


def _start_log(path: Path, fields: List[str], keep_before: int) -> None:
    """Start the CSV log, keeping the rows of the epochs before ``keep_before`` (those a resumed run does not redo)."""
    rows: List[List[str]] = []
    if keep_before > 0 and path.exists():
        with open(path, newline="") as fh:
            rows = [r for r in list(csv.reader(fh))[1:] if r and int(r[0]) < keep_before]
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(fields)
        writer.writerows(rows)


def _epoch_batches(loader, epoch: int, samples_done: int, batch_size: int, size: int) -> Iterable:
    """The batches of ``epoch`` still to do once ``samples_done`` of it (all workers together) are consumed."""
    if isinstance(loader, ShardedLoader):
        loader.set_epoch(epoch, start=samples_done)
        return loader
    _set_epoch(loader, epoch)
    return itertools.islice(loader, samples_done // (batch_size * size), None)  # same world size: skip those batches

if __name__ == "__main__":
    main()
