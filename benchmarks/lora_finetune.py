"""LoRA fine-tuning (PEFT): K-FAC on the adapters against AdamW, the optimizer LoRA is usually trained with.

    .venv/bin/python -m benchmarks.lora_finetune          # needs peft (pip install peft): an optional dependency

A transfer task on real data: an MLP (784-256-256-10) is trained on MNIST 5k's digits 0-4 (momentum SGD, the
same for every arm), then PEFT's LoRA adapters (rank ``--rank`` on its three Linear layers, the base frozen) are
fine-tuned on digits 5-9 and tested on the held-out 5-9 digits. The arms, each over its own learning-rate grid
(the best by mean best test accuracy over the seeds), every step's batch the same for every arm:

* ``adamw``: ``torch.optim.AdamW`` on the adapters (what a LoRA script uses);
* ``kfac-adamw``: that AdamW with a :class:`~spdkfac.KFACPreconditioner` attached (the one-line swap: factors
  and decompositions every ``--kfac-freq`` steps);
* ``sgd``: ``torch.optim.SGD`` with momentum 0.9;
* ``kfac-sgd``: :class:`~spdkfac.SPDKFACOptimizer` with its momentum SGD (the same frequencies).

Every run has the same schedule (cosine decay over ``--epochs``, no warm-up), batch ``--batch-size``, one process,
``--threads`` threads. Reported per arm at its best rate: the best test accuracy (mean over seeds), the per-seed
difference against AdamW (mean and standard error), and the epochs and training seconds to AdamW's best mean
accuracy (per seed; seconds are the optimizer's and the passes' alone, the arms timed alike in one run).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.train.data import Dataset, load_mnist5k

from .common import RESULTS, machine, save_json
from .convergence import paired_difference

ARMS = ("adamw", "kfac-adamw", "sgd", "kfac-sgd")
#: Each arm's learning rates, wide enough that every arm's best lies inside (the summary says where one does not).
GRIDS = {
    "adamw": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "kfac-adamw": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "sgd": (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3),
    "kfac-sgd": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
}


class MLP(nn.Module):
    """784-256-256-10 with ReLU: the base the adapters fine-tune."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(784, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x.flatten(1)))
        return self.head(torch.relu(self.fc2(h)))


def _digits(data: Dataset, low: bool) -> Dataset:
    keep = data.y < 5 if low else data.y >= 5
    return Dataset(data.x[keep], data.y[keep], data.num_classes)


def _cosine(step: int, steps: int) -> float:
    """The learning rate's factor at ``step`` of ``steps``: cosine decay from 1 to 0, no warm-up."""
    return 0.5 * (1 + math.cos(math.pi * step / steps))


def _batches(data: Dataset, batch: int, seed: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1000 * seed + epoch))
    return [(data.x[i], data.y[i]) for i in order.split(batch) if len(i) == batch]


def pretrained(train: Dataset, seed: int, epochs: int, batch: int) -> MLP:
    """The base: momentum SGD on digits 0-4 (lr 0.05, cosine), seeded."""
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = epochs * (len(train) // batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps))
    for epoch in range(epochs):
        for x, y in _batches(train, batch, seed, epoch):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    return model


def accuracy(model: nn.Module, test: Dataset) -> float:
    with torch.no_grad():
        return float((model(test.x).argmax(1) == test.y).float().mean())


def _optimizer(arm: str, model: nn.Module, lr: float, freq: int) -> tuple[Any, torch.optim.Optimizer]:
    """(what steps, the optimizer whose groups the schedule scales)."""
    adapters = [p for p in model.parameters() if p.requires_grad]
    if arm == "adamw":
        opt = torch.optim.AdamW(adapters, lr=lr, weight_decay=0.0)
        return opt, opt
    if arm == "kfac-adamw":
        opt = torch.optim.AdamW(adapters, lr=lr, weight_decay=0.0)
        attached = dict(damping=0.003, factor_update_steps=freq, inv_update_steps=freq, backend="single")
        KFACPreconditioner(model, optimizer=opt, **attached)
        return opt, opt
    if arm == "sgd":
        opt = torch.optim.SGD(adapters, lr=lr, momentum=0.9)
        return opt, opt
    if arm == "kfac-sgd":
        kopt = SPDKFACOptimizer(model, lr=lr, momentum=0.9, damping=0.003, factor_update_freq=freq, inv_update_freq=freq, backend="single")
        return kopt, kopt
    raise ValueError(f"unknown arm {arm!r}")


def finetune(base: MLP, arm: str, lr: float, train: Dataset, test: Dataset, args: argparse.Namespace, seed: int) -> dict[str, list[float]]:
    """Per epoch: the test accuracy and the cumulative training seconds of one arm at one rate."""
    import peft  # optional dependency: checked in main()

    torch.manual_seed(seed)
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["fc1", "fc2", "head"])
    )
    stepper, scheduled = _optimizer(arm, model, lr, args.kfac_freq)
    steps = args.epochs * (len(train) // args.batch_size)
    rates = [g["lr"] for g in scheduled.param_groups]
    acc, secs, elapsed, step = [], [], 0.0, 0
    for epoch in range(args.epochs):
        for x, y in _batches(train, args.batch_size, seed, epoch):
            for group, rate in zip(scheduled.param_groups, rates):
                group["lr"] = rate * _cosine(step, steps)
            started = time.perf_counter()
            stepper.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            stepper.step()
            elapsed += time.perf_counter() - started
            step += 1
        acc.append(accuracy(model, test))
        secs.append(elapsed)
    return {"test_acc": acc, "seconds": secs}


def _reached(curve: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose accuracy reaches ``target``."""
    return next((e + 1 for e, a in enumerate(curve) if a >= target - 1e-9), None)


def summarise(runs: dict[str, dict[str, dict[str, dict[str, list[float]]]]], seeds: list[int]) -> dict[str, Any]:
    """Per arm: its best rate, best accuracy (mean over seeds), the per-seed difference against AdamW, and epochs and
    seconds to AdamW's best mean accuracy."""
    best_rate = {
        arm: max(by_rate, key=lambda r: statistics.fmean(max(by_rate[r][str(s)]["test_acc"]) for s in seeds))
        for arm, by_rate in runs.items()
    }
    best = {arm: [max(runs[arm][best_rate[arm]][str(s)]["test_acc"]) for s in seeds] for arm in runs}
    target = statistics.fmean(best["adamw"])
    out: dict[str, Any] = {"target": target}
    for arm, by_rate in runs.items():
        pair = paired_difference({"seeds": seeds, "best": best[arm]}, {"seeds": seeds, "best": best["adamw"]}, "best")
        assert pair is not None
        reach = []
        for s in seeds:
            run = by_rate[best_rate[arm]][str(s)]
            epoch = _reached(run["test_acc"], target)
            reach.append({"epochs": epoch, "seconds": None if epoch is None else run["seconds"][epoch - 1]})
        grid = sorted(float(r) for r in by_rate)
        out[arm] = {
            "lr": float(best_rate[arm]),
            "lr_at_grid_edge": len(grid) > 1 and float(best_rate[arm]) in (grid[0], grid[-1]),
            "best_acc": best[arm],
            "best_acc_mean": statistics.fmean(best[arm]),
            "vs_adamw_mean": pair["mean"],
            "vs_adamw_se": pair["standard_error"] or 0.0,  # (None with one seed)
            "to_target": reach,
        }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--pretrain-epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rank", type=int, default=4, help="LoRA rank")
    ap.add_argument("--kfac-freq", type=int, default=10, help="K-FAC's factor and decomposition steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one rate per arm, one seed, two epochs (tests the benchmark)")
    ap.add_argument("--out", default=str(RESULTS / "lora_finetune.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.pretrain_epochs = args.seeds[:1], 2, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import peft  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks.lora_finetune needs peft, an optional dependency: pip install peft") from None
    torch.set_num_threads(args.threads)
    train, test = load_mnist5k()
    low, high, high_test = _digits(train, True), _digits(train, False), _digits(test, False)
    grids: dict[str, tuple[float, ...]] = {arm: grid[1:2] if args.quick else grid for arm, grid in GRIDS.items()}
    runs: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        base = pretrained(low, seed, args.pretrain_epochs, args.batch_size)
        print(
            f"seed {seed}: base on digits 0-4, {accuracy(base, _digits(test, True)):.3f}; on 5-9 {accuracy(base, high_test):.3f}",
            flush=True,
        )
        for arm in ARMS:  # (every arm and rate on this seed's base before the next seed: alike in time)
            for lr in grids[arm]:
                run = finetune(base, arm, lr, high, high_test, args, seed)
                runs[arm].setdefault(str(lr), {})[str(seed)] = run
                print(f"  {arm} lr {lr:g}: best {max(run['test_acc']):.4f}, {run['seconds'][-1]:.1f} s", flush=True)
    summary = summarise(runs, args.seeds)
    for arm in ARMS:
        row = summary[arm]
        edge = " (at its grid's edge: widen the grid)" if row["lr_at_grid_edge"] else ""
        print(
            f"{arm} (lr {row['lr']:g}{edge}): best {row['best_acc_mean']:.4f}, vs AdamW {row['vs_adamw_mean']:+.4f} ± {row['vs_adamw_se']:.4f}"
        )
    out = save_json(
        {"args": vars(args), "machine": machine(), "runs": runs, "summary": summary}, Path(args.out).name, Path(args.out).parent
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
