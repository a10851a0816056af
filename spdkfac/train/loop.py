"""The one training loop of ``spdkfac.train`` and the convergence benchmark: the LR schedule, a step, an epoch, evaluation.

Both must train alike, or the benchmark's time to accuracy says nothing about
the job users run: the same warm-up and decay, micro-batches under autocast,
the loss closure the optimizer asks for (DHO2's Hessian-vector products,
K-FAC's adaptive damping), the same split of where the time goes. What
differs between them (checkpoints and progress in the job; interleaved runs,
divergence and ADMM probes in the benchmark) is the caller's work between
the steps that :func:`train_epoch` yields.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm import CommBackend
from ..dho2 import DHO2Optimizer

__all__ = ["AMP_DTYPES", "Batch", "EpochTotals", "TrainingStep", "autocast", "average_over_workers", "evaluate", "lr_at", "train_epoch"]

#: A batch of inputs and labels.
Batch = tuple[torch.Tensor, torch.Tensor]
#: ``--amp``'s choices.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_CPU = torch.device("cpu")


def lr_at(args: argparse.Namespace, base_lr: float, epoch_float: float, workers: int = 1) -> float:
    """Linear warm-up from the single-worker LR to ``base_lr`` (Goyal et al.), then cosine or step decay.

    Reads ``args.warmup_epochs``, ``args.schedule`` ('cosine' or 'step'),
    ``args.epochs`` and ``args.lr_decay_epochs``. Warming up from the
    single-worker LR rather than from zero matters for K-FAC: a near-zero LR
    disables the KL clip, and the unclipped first preconditioned update would
    stay in the momentum buffer while the LR grows.
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
    """``values`` averaged over every worker (a collective: every worker calls it with as many values)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    backend.allreduce_async(t, name).wait()
    return t.tolist()


def autocast(device: torch.device, amp: str | None) -> torch.autocast:
    """Autocast in ``amp``'s dtype ('bf16', 'fp16'), or a disabled one (``None``: the model's own precision)."""
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(amp or "bf16"), enabled=amp is not None)


def evaluate(
    model: nn.Module, loader: Iterable[Batch], backend: CommBackend, device: torch.device = _CPU, amp: str | None = None
) -> tuple[float, float]:
    """(loss, accuracy) of ``model`` on every worker's share of ``loader``, averaged over the workers; the model ends in training mode."""
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, amp):
                out = model(x)
            loss_sum += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += float((out.argmax(1) == y).sum())
            count += y.numel()  # samples, or a sequence model's positions (out: N x classes x positions)
    loss_sum, correct, count = average_over_workers(backend, [loss_sum, correct, count], "train.eval", device)
    model.train()
    return loss_sum / max(count, 1), correct / max(count, 1)


@dataclass
class EpochTotals:
    """An epoch's running sums on this worker: the training loss and accuracy, and where the seconds went."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0
    fwdbwd_s: float = 0.0  # moving the batch, forward and backward
    step_s: float = 0.0  # the optimizer's step with its communication
    refresh_s: float = 0.0  # DHO2's eigenpair refreshes (part of step_s)
    iter_s: list[float] = field(default_factory=list)  # each step's seconds


class TrainingStep:
    """One optimizer step on a batch: zero the gradients, forward and backward over ``accumulation_steps`` equal
    micro-batches under autocast, then the optimizer's step (through the fp16 loss scaler when there is one).

    ``peak_lr`` is the LR the optimizer was made with: :meth:`set_lr` moves
    every parameter group with it, a group made with another LR (Muon's AdamW
    part) in proportion.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        peak_lr: float,
        device: torch.device = _CPU,
        *,
        amp: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        accumulation_steps: int = 1,
        label_smoothing: float = 0.0,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.amp, self.scaler, self.label_smoothing = amp, scaler, label_smoothing
        self.accumulation_steps = accumulation_steps
        self.peak_lr = peak_lr
        self.lr = peak_lr
        self._group_peaks = [group["lr"] for group in optimizer.param_groups]
        # Optimizers that evaluate the loss themselves say so (DHO2, K-FAC's adaptive damping); torch's do not.
        self._closure = scaler is None and bool(getattr(optimizer, "needs_loss_closure", False))

    def set_lr(self, lr: float) -> None:
        """The LR of the next steps (the schedule's value at this point of training)."""
        self.lr = lr
        for group, peak in zip(self.optimizer.param_groups, self._group_peaks):
            group["lr"] = lr if peak == self.peak_lr else peak * (lr / self.peak_lr)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits) of a batch, under the step's autocast."""
        with autocast(self.device, self.amp):
            out = self.model(x)
            return nn.functional.cross_entropy(out, y, label_smoothing=self.label_smoothing), out

    def __call__(self, x: torch.Tensor, y: torch.Tensor, totals: EpochTotals) -> torch.Tensor:
        """Train on one batch; adds its loss, accuracy and seconds to ``totals``; returns the last micro-batch's loss."""
        t0 = time.perf_counter()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad()
        k = self.accumulation_steps
        loss = torch.zeros(())
        for xm, ym in zip(x.chunk(k), y.chunk(k)):  # k equal micro-batches (k divides the batch size)
            loss, out = self.loss(xm, ym)
            share = loss / k if self.scaler is None else self.scaler.scale(loss / k)
            share.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            totals.loss_sum += float(loss.detach()) * ym.numel()
            totals.correct += float((out.argmax(1) == ym).sum())
            totals.count += ym.numel()
        t1 = time.perf_counter()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self._closure:
            # The whole batch's loss with its graph (torch's stub types the closure's result as a float).
            self.optimizer.step(lambda: self.loss(x, y)[0])  # type: ignore[arg-type,return-value]
        else:
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        totals.fwdbwd_s += t1 - t0
        totals.step_s += t2 - t1
        totals.iter_s.append(t2 - t0)
        if isinstance(self.optimizer, DHO2Optimizer):
            totals.refresh_s += self.optimizer.last_step_times.get("refresh", 0.0)
        return loss


def train_epoch(
    step: TrainingStep, batches: Iterable[Batch], lr_of_step: Callable[[int], float], totals: EpochTotals
) -> Iterator[torch.Tensor]:
    """Train one step per batch at the LR ``lr_of_step(i)`` for the ``i``-th; yields each step's loss.

    The caller's work between steps (progress, mid-epoch checkpoints, probes)
    runs where the generator yields; ``lr_of_step`` is asked just before its
    step, so it may read what that work updated.
    """
    for i, (x, y) in enumerate(batches):
        step.set_lr(lr_of_step(i))
        yield step(x, y, totals)
