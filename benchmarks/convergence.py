"""Time-to-accuracy of SPD-KFAC (and DHO2, AdamW, SOAP, Muon) against SGD on real data (digits, MNIST 5k, and
next-character prediction on Python's library source, ``pycode``, where accuracy is per character).

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.convergence \\
        --data mnist5k digits --batch-sizes 256 32 --optimizers sgd spdkfac --epochs 20
    ... --optimizers sgd spdkfac spdkfac:factor_update_freq=10,inv_update_freq=10 \\
        --lr-grid sgd=0.05,0.1,0.2 spdkfac=0.02,0.05

Also runs under torchrun or as one process (spdkfac.comm.get_backend picks the
engine). For every data set, per-worker batch size and optimizer, each base
learning rate of the optimizer's grid is trained for ``--epochs`` epochs per
seed (LR scaled by the number of workers, warm-up then cosine decay, as
spdkfac.train does); the grid point with the best test accuracy (mean over
seeds) is the optimizer's choice. The target is the reference optimizer's
(the first 'sgd' variant, else the first one) best test accuracy; for each
optimizer the benchmark reports the epochs and training seconds to reach it
and their ratios to the reference's.

Seconds are cumulative training time (forward, backward, optimizer step and
its communication, data batching), excluding model set-up and evaluation,
averaged over the workers, measured alike for every optimizer. Per-epoch
forward+backward and step seconds say where the time goes.

DHO2 (``dho2``, ``dho2-wa``, e.g. ``dho2:refresh_every=20``) gets its loss
closure, and each epoch records the seconds of its eigenpair refreshes (HVPs
and Lanczos, part of the step) and its curvature memory per worker;
``adamw`` and DHO2 use ``--adamw-weight-decay`` and no momentum.

``adamw`` is this package's :class:`~spdkfac.update.adamw.DistributedAdamW`
(``torch.optim.AdamW``'s rule on the averaged gradients). ``soap`` and
``muon`` are HeavyBall's (an optional dependency: ``pip install --no-deps
heavyball``), stepping on every worker on the same averaged gradients
(:mod:`benchmarks.external_optimizers`; ``muon``: Muon on the hidden 2-D+
weights, AdamW on the rest); they and K-FAC with an Adam-type base
(``spdkfac:base=adamw``) use ``--adamw-weight-decay`` (decoupled). A spec
may set its own decay (``adamw:weight_decay=0.05``), so that each optimizer
runs at its best one in the same interleaved run. A second
target is the first ``adamw`` entry's best test accuracy: epochs and seconds
to reach it are reported too. Per-seed best accuracies, final test losses
and epochs to the targets give the median and spread over ``--seeds``.

Writes <out>/convergence.json and one PNG per (data, batch size) with test
accuracy and test loss against epochs and against seconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac.comm import DEVICE_CHOICES, worker_device
from spdkfac.dho2 import DHO2Optimizer
from spdkfac.models import MODELS, get_model
from spdkfac.optimizer import NonFiniteError
from spdkfac.runtime.affinity import add_bind_cores_option
from spdkfac.train.job import make_loaders
from spdkfac.train.loop import EpochTotals, TrainingStep, average_over_workers, evaluate, lr_at, train_epoch
from spdkfac.train.optimizer_options import add_kfac_arguments, optimizer_options
from spdkfac.variants import make_optimizer, optimizer_config, variant_argv

from .common import RESULTS, log, machine, save_json, start
from .external_optimizers import EXTERNAL_OPTIMIZERS, external_options, make_external, require_heavyball

DATA = ("digits", "mnist5k", "pycode", "pycode-words")
DEFAULT_LR_GRID = (0.025, 0.05, 0.1)
#: Optimizer options this benchmark passes itself, so a variant spec cannot set them (and where they come from).
#: A spec may set its own ``weight_decay`` (over --weight-decay / --adamw-weight-decay): each optimizer at its best decay.
SET_BY_BENCHMARK = {"lr": "--lr-grid", "momentum": "--momentum", "backend": "the launcher"}
#: The optimizer a second target (its best test accuracy) comes from, when listed.
SECOND_REFERENCE = "adamw"
CURVE_KEYS = ("train_loss", "test_loss", "test_acc", "epoch_s", "seconds", "fwdbwd_s", "step_s", "refresh_s", "lr")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["mnist5k"], choices=DATA)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[256], help="per-worker batch sizes")
    ap.add_argument(
        "--optimizers",
        nargs="*",
        action="extend",
        default=None,
        help="variant names of spdkfac.variants, or dho2, dho2-wa, adamw, soap, muon (default: sgd spdkfac), or "
        "name:key=value,... (e.g. spdkfac:factor_update_freq=10,inv_update_freq=10, spdkfac:base=adamw, "
        "spdkfac:compute_method=eigen, dho2:refresh_every=20, muon:adamw_lr=0.003)",
    )
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument(
        "--model",
        default=None,
        choices=sorted(n for n in MODELS if "_32" not in n),
        help="model for every data set (default: digits_cnn on digits, mnist_cnn on mnist5k, char_gpt on pycode; "
        "mnist_mobilenet: depthwise convolutions, mnist_vit: nn.MultiheadAttention; both 28x28 only)",
    )
    ap.add_argument(
        "--lr-grid",
        nargs="+",
        default=[],
        help="base LRs per worker (scaled by the number of workers): plain numbers for every optimizer, "
        f"OPT=lr,lr,... for one (OPT: a variant name or an exact --optimizers entry); "
        f"default {','.join(map(str, DEFAULT_LR_GRID))}",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="hold all runs of a (data, batch size) at once and alternate their epochs, so that a shared "
        "machine's changing load slows every optimizer alike (fairer seconds; more memory)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="model-initialisation and shuffling seeds")
    ap.add_argument("--split-seed", type=int, default=42, help="seed of the fixed train/test split")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4, help="SGD and K-FAC (a spec's own weight_decay=... wins)")
    ap.add_argument(
        "--adamw-weight-decay",
        type=float,
        default=0.05,
        help="decoupled weight decay of adamw, dho2, dho2-wa (the DHO2 paper's), soap, muon and K-FAC with base adamw/lamb "
        "(a spec's own weight_decay=... wins)",
    )
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--damping", type=float, default=0.003, help="Tikhonov damping (the paper's and spdkfac.train's default)")
    ap.add_argument(
        "--kl-clip", type=float, default=None, help="KL-clip bound (default as spdkfac.train: 1e-4 on digits, the paper's 1e-3 otherwise)"
    )
    ap.add_argument("--factor-decay", type=float, default=0.95)
    add_kfac_arguments(ap)  # --base, --update-fusion, --compute-method, ... as spdkfac.train spells them
    ap.add_argument("--factor-update-freq", type=int, default=1)
    ap.add_argument("--inv-update-freq", type=int, default=1)
    ap.add_argument(
        "--perf-model",
        default="perfmodels/reference-cpu-gloo-2.json",
        help="fitted performance model for SPD-KFAC's fusion and placement ('none': profile only)",
    )
    ap.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    add_bind_cores_option(ap)
    ap.add_argument("--out", default=str(RESULTS / "convergence"), help="output folder")
    args = ap.parse_args(variant_argv(list(sys.argv[1:] if argv is None else argv), "--optimizers"))
    args.optimizers = args.optimizers or ["sgd", "spdkfac"]

    if args.epochs < 1:
        ap.error("--epochs must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        ap.error("--batch-sizes must be >= 1")
    if len(set(args.optimizers)) != len(args.optimizers):
        ap.error("--optimizers lists an entry twice")
    for spec in args.optimizers:
        try:
            check_spec(spec, args)
        except ValueError as exc:
            ap.error(f"--optimizers: {exc}")
    if any(spec.partition(":")[0] in EXTERNAL_OPTIMIZERS for spec in args.optimizers):
        require_heavyball()  # before any training: a clear message saying how to install it
    try:
        args.grids = lr_grids(args.lr_grid, args.optimizers)
    except ValueError as exc:
        ap.error(f"--lr-grid: {exc}")
    if args.perf_model and args.perf_model.lower() == "none":
        args.perf_model = None
    if args.perf_model and not Path(args.perf_model).is_file():
        ap.error(f"--perf-model {args.perf_model} does not exist")
    for name in ("damping", "kl_clip", "factor_decay"):
        if (getattr(args, name) or 0) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.factor_update_freq < 1 or args.inv_update_freq < 1:
        ap.error("--factor-update-freq and --inv-update-freq must be >= 1")
    try:  # the folder must take files before hours of training, not after
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=args.out):
            pass
    except OSError as exc:
        ap.error(f"--out {args.out} is not a writable folder ({exc})")
    return args


def check_spec(spec: str, args: argparse.Namespace) -> None:
    """A ValueError if ``spec`` (a variant with changes) could not make an optimizer with these arguments.

    Checked while parsing, before any training: unknown options and bad
    values (:func:`~spdkfac.variants.optimizer_config`), options this benchmark sets itself, and
    update frequencies that do not divide once merged with ``--factor-update-freq``/``--inv-update-freq``.
    """
    config = spec_config(spec)
    fixed = sorted(set(config) & set(SET_BY_BENCHMARK))
    if fixed:
        raise ValueError(f"{spec!r} sets {fixed}, which this benchmark sets itself ({', '.join(SET_BY_BENCHMARK[k] for k in fixed)})")
    factor = config.get("factor_update_freq", args.factor_update_freq)
    inverse = config.get("inv_update_freq", args.inv_update_freq)
    if config.get("precondition", True) and factor >= 1 and inverse % factor:  # a bad option is refused on its own below
        raise ValueError(
            f"{spec!r}: inv_update_freq {inverse} is not a multiple of factor_update_freq {factor} (the spec's or the option's)"
        )


def spec_config(spec: str) -> dict[str, Any]:
    """:func:`~spdkfac.variants.optimizer_config` of ``spec``, or the options of an external optimizer (``soap``, ``muon``)."""
    name, _, changes = spec.partition(":")
    if name not in EXTERNAL_OPTIMIZERS:
        return optimizer_config(spec)
    given: dict[str, Any] = {}
    for item in filter(None, (c.strip() for c in changes.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad change {item!r} in {spec!r}; write key=value")
        try:
            given[key.strip()] = float(value) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            raise ValueError(f"bad value in {spec!r}: {value!r} is not a number") from None
    decay = {"weight_decay": given.pop("weight_decay")} if "weight_decay" in given else {}
    return {**external_options(name, given), **decay}


def lr_grids(entries: Sequence[str], optimizers: Sequence[str]) -> dict[str, list[float]]:
    """Each optimizer's base LRs from ``--lr-grid`` entries.

    ``0.05`` applies to every optimizer, ``NAME=0.05,0.1`` to every entry of
    that variant (``spdkfac`` and ``spdkfac:inv_update_freq=10``), and an exact
    ``--optimizers`` entry (``spdkfac:inv_update_freq=10=0.1``) to that one,
    before its variant's grid.
    """
    common: list[float] = []
    exact: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for entry in entries:
        key, eq, values = entry.rpartition("=")  # a spec's own '=' are left of the last one
        try:
            lrs = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"bad learning rate in {entry!r}; write 0.05 or OPT=0.05,0.1") from None
        if not lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
            raise ValueError(f"{entry!r}: learning rates must be positive numbers")
        if not eq:
            common += lrs
        elif key in optimizers and ":" in key:
            exact.setdefault(key, []).extend(lrs)
        elif any(o.partition(":")[0] == key for o in optimizers):
            by_name.setdefault(key, []).extend(lrs)
        else:
            raise ValueError(f"{key!r} is none of the --optimizers {list(optimizers)}")
    grid = common or list(DEFAULT_LR_GRID)
    return {o: sorted(set(exact.get(o) or by_name.get(o.partition(":")[0]) or grid)) for o in optimizers}


def optimizer_kwargs(spec: str, args: argparse.Namespace, data: str) -> dict[str, Any]:
    """Keyword arguments for make_optimizer beyond the variant's own (which a spec's changes override): spdkfac.train's
    mapping (:func:`~spdkfac.train.optimizer_options.optimizer_options`) with ``--adamw-weight-decay`` for the Adam types and
    the KL clip's default by data set; an external optimizer (``soap``, ``muon``) takes only its decay."""
    if spec.partition(":")[0] in EXTERNAL_OPTIMIZERS:  # AdamW-based: its decay, no momentum
        return {} if "weight_decay" in spec_config(spec) else {"weight_decay": args.adamw_weight_decay}
    kl_clip = args.kl_clip if args.kl_clip is not None else (1e-4 if data == "digits" else 1e-3)
    return optimizer_options(spec, argparse.Namespace(**{**vars(args), "kl_clip": kl_clip}), adam_weight_decay=args.adamw_weight_decay)


def schedule(args: argparse.Namespace) -> argparse.Namespace:
    """The fields spdkfac.train.job.lr_at reads: warm-up, then cosine decay over ``--epochs``."""
    return argparse.Namespace(warmup_epochs=args.warmup_epochs, schedule="cosine", epochs=args.epochs, lr_decay_epochs=[])


def train_run(args, backend, device, data: str, loaders, spec: str, base_lr: float, seed: int) -> dict[str, Any]:
    """One training run on ``loaders`` (spdkfac.train.job.make_loaders's answer); per-epoch metrics, identical on every worker.

    Stops early if it diverges (non-finite values or loss).
    """
    last: dict[str, Any] = {}
    for run in train_epochs(args, backend, device, data, loaders, spec, base_lr, seed):
        last = run
    return last


def train_epochs(
    args, backend, device, data: str, loaders, spec: str, base_lr: float, seed: int, label: str = ""
) -> Iterator[dict[str, Any]]:
    """:func:`train_run` one epoch at a time: yields the run's record (updated in place) after each epoch.

    Runs may alternate epochs (``--interleave``): each epoch sets the shared
    loader's seed and epoch itself, and the model and optimizer live in the
    generator.
    """
    rank, size = backend.rank, backend.size
    train_loader, test_loader, num_classes, model_name = loaders
    torch.manual_seed(seed)
    model = get_model(model_name, num_classes=num_classes).to(device)
    peak = base_lr * size
    name = spec.partition(":")[0]
    opt: Any
    if name in EXTERNAL_OPTIMIZERS:
        options = {**spec_config(spec), **optimizer_kwargs(spec, args, data)}
        opt = make_external(name, model, lr=peak, backend=backend, workers=size, **options)
    else:
        opt = make_optimizer(spec, model, lr=peak, backend=backend, **optimizer_kwargs(spec, args, data))
    dho2 = isinstance(opt, DHO2Optimizer)
    training_step = TrainingStep(model, opt, peak, device)
    sched = schedule(args)
    steps = len(train_loader)
    epochs: list[dict[str, Any]] = []
    run: dict[str, Any] = {"seed": seed, "epochs": epochs, "diverged": None, "steps_per_epoch": steps, "model": model_name}
    admm = opt.admm if dho2 else None
    if admm is not None:
        run["outer_steps"] = []  # test loss and accuracy just before and just after each ADMM outer step
    seconds = 0.0
    diverged = None
    for epoch in range(args.epochs):
        train_loader.seed = seed  # the split stays fixed; initialisation and order change with the seed
        train_loader.set_epoch(epoch)
        model.train()
        totals = EpochTotals()
        probe_s = failed = 0.0
        t_epoch = time.perf_counter()
        try:
            for it, _ in enumerate(
                train_epoch(training_step, train_loader, lambda i, e=epoch: lr_at(sched, peak, e + i / steps, size), totals)
            ):
                if admm is not None and opt.last_step_times and opt.steps % opt.config.admm_period == 0:
                    t_probe = time.perf_counter()
                    run["outer_steps"].append(outer_step_probe(model, opt, test_loader, backend, device, epoch + (it + 1) / steps))
                    probe_s += time.perf_counter() - t_probe
        except NonFiniteError as exc:  # raised on every worker alike (averaged gradients and factors)
            diverged = f"epoch {epoch + 1}: {exc}"
            failed = 1.0
        epoch_s = time.perf_counter() - t_epoch - probe_s  # the outer-step probe's evaluations are not training
        loss_sum, count, epoch_s, fwdbwd, step_s, refresh_s, failed = average_over_workers(
            backend,
            [totals.loss_sum, totals.count, epoch_s, totals.fwdbwd_s, totals.step_s, totals.refresh_s, failed],
            "convergence.train",
            device,
        )
        if failed:
            diverged = diverged or f"epoch {epoch + 1}: non-finite values on a worker"
            break
        seconds += epoch_s
        test_loss, test_acc = evaluate(model, test_loader, backend, device)
        row = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / max(count, 1),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "epoch_s": epoch_s,
            "seconds": seconds,
            "fwdbwd_s": fwdbwd,
            "step_s": step_s,
            "refresh_s": refresh_s,
            "lr": training_step.lr,
        }
        epochs.append(row)
        log(
            rank,
            f"    {label}epoch {epoch + 1:3d}/{args.epochs}  train loss {row['train_loss']:.4f}  test loss {test_loss:.4f} "
            f"acc {test_acc:.4f}  {epoch_s:6.2f} s (fwd+bwd {fwdbwd:.2f}, step {step_s:.2f})  total {seconds:7.1f} s",
        )
        if not all(math.isfinite(row[k]) for k in ("train_loss", "test_loss")):
            diverged = f"epoch {epoch + 1}: non-finite loss"
            break
        yield run
    if dho2:
        run["memory"] = opt.memory_usage()  # this worker's curvature memory (rank 0's is saved)
    run["replicas_identical"] = replicas_identical(model, backend, device)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    run["diverged"] = diverged
    if diverged:
        log(rank, f"    {label}diverged: {diverged}")
    yield run


def outer_step_probe(model: nn.Module, opt: DHO2Optimizer, test_loader, backend, device, epoch: float) -> dict[str, Any]:
    """Test loss and accuracy at ``w_a`` (the inner loop's end, just before the ADMM outer step) and at the parameters the
    outer step left (just after; the same point with ``admm_rule='proximal'``). The model ends as the step left it."""
    assert opt.admm is not None
    after_params = torch.nn.utils.parameters_to_vector(opt.params).detach().clone()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(opt.admm.centre().to(after_params.dtype), opt.params)
    before = evaluate(model, test_loader, backend, device)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(after_params, opt.params)
    after = evaluate(model, test_loader, backend, device)
    model.train()
    return {
        "step": opt.steps,
        "epoch": epoch,
        "before": {"test_loss": before[0], "test_acc": before[1]},
        "after": {"test_loss": after[0], "test_acc": after[1]},
    }


def replicas_identical(model: nn.Module, backend, device) -> bool:
    """Whether every worker holds the same parameters (two position-weighted sums, compared with their average)."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    local = [float(flat.sum()), float(flat @ weights)]
    return average_over_workers(backend, local, "convergence.replicas", device) == local


def mean_curve(runs: list[dict[str, Any]], epochs: int) -> list[dict[str, Any]]:
    """Per-epoch means over the seeds' runs; an epoch some run did not reach (diverged) is left out, and all after it."""
    curve = []
    for e in range(epochs):
        rows = [r["epochs"][e] for r in runs if len(r["epochs"]) > e]
        if len(rows) < len(runs):
            break
        curve.append({"epoch": e + 1, **{k: statistics.fmean(row[k] for row in rows) for k in CURVE_KEYS}})
    return curve


def reach(curve: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """(epochs, seconds) until the curve's test accuracy first reaches ``target``, or (None, None)."""
    for row in curve:
        if row["test_acc"] >= target:
            return row["epoch"], row["seconds"]
    return None, None


def score(curve: list[dict[str, Any]]) -> tuple:
    """Ranks grid points: best test accuracy, then lower final test loss (a diverged run with no epochs is last)."""
    if not curve:
        return (-1.0, 0.0)
    final = curve[-1]["test_loss"]
    return (max(r["test_acc"] for r in curve), -final if math.isfinite(final) else -math.inf)


def summarise(setting: dict[str, Any], optimizers: list[str]) -> None:
    """Choose each optimizer's LR, set the target (reference's best accuracy) and the times to reach it."""
    for spec in optimizers:
        res = setting["optimizers"][spec]
        best = max(res["lr_grid"], key=lambda lr: score(res["lr_grid"][lr]["curve"]))
        curve = res["lr_grid"][best]["curve"]
        res.update(
            chosen_lr=float(best),
            curve=curve,
            best_test_acc=max((r["test_acc"] for r in curve), default=None),
            final_test_loss=curve[-1]["test_loss"] if curve else None,
            final_test_acc=curve[-1]["test_acc"] if curve else None,
            diverged=res["lr_grid"][best]["diverged"],
            mean_epoch_s=statistics.fmean(r["epoch_s"] for r in curve) if curve else None,
            mean_fwdbwd_s=statistics.fmean(r["fwdbwd_s"] for r in curve) if curve else None,
            mean_step_s=statistics.fmean(r["step_s"] for r in curve) if curve else None,
            mean_refresh_s=statistics.fmean(r["refresh_s"] for r in curve) if curve else None,
            memory=next((run["memory"] for run in res["lr_grid"][best]["runs"] if "memory" in run), None),
        )
    ref = next((o for o in optimizers if spec_config(o).get("precondition", True) is False), optimizers[0])
    target = setting["optimizers"][ref]["best_test_acc"]
    setting["reference"], setting["target_test_acc"] = ref, target
    ref_res = setting["optimizers"][ref]
    ref_epochs, ref_secs = reach(ref_res["curve"], target) if target is not None else (None, None)
    for spec in optimizers:
        res = setting["optimizers"][spec]
        e, s = reach(res["curve"], target) if target is not None else (None, None)
        res.update(
            epochs_to_target=e,
            seconds_to_target=s,
            epochs_ratio=e / ref_epochs if e is not None and ref_epochs else None,
            seconds_ratio=s / ref_secs if s is not None and ref_secs else None,
            final_test_loss_ratio=(
                res["final_test_loss"] / ref_res["final_test_loss"]
                if res["final_test_loss"] is not None and ref_res["final_test_loss"]
                else None
            ),
        )
    second = next((o for o in optimizers if o.partition(":")[0] == SECOND_REFERENCE), None)
    second_target = setting["optimizers"][second]["best_test_acc"] if second is not None else None
    setting["second_reference"], setting["second_target_test_acc"] = second, second_target
    for spec in optimizers:
        res = setting["optimizers"][spec]
        e2, s2 = reach(res["curve"], second_target) if second_target is not None else (None, None)
        res.update(
            epochs_to_second=e2,
            seconds_to_second=s2,
            per_seed=per_seed(res["lr_grid"][repr(res["chosen_lr"])]["runs"], target, second_target),
        )
    for spec in optimizers:
        mine = setting["optimizers"][spec]["per_seed"]
        setting["optimizers"][spec]["paired_best_test_acc"] = {
            other: paired_difference(mine, setting["optimizers"][other]["per_seed"], "best_test_acc")
            for other in optimizers
            if other != spec
        }


def paired_difference(mine: dict[str, Any], theirs: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``mine[key] - theirs[key]`` seed by seed (the same seed: the same initialisation and data order), their mean,
    its standard error and the wins / ties / losses: what a difference between two optimizers' means is worth
    next to the seeds' noise. None when the two ran on different seeds or no seed has both values."""
    if mine["seeds"] != theirs["seeds"]:
        return None
    diffs = [a - b for a, b in zip(mine[key], theirs[key]) if a is not None and b is not None]
    if not diffs:
        return None
    n = len(diffs)
    return {
        "mean": statistics.fmean(diffs),
        "standard_error": statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None,
        "seeds": n,
        "wins": sum(d > 0 for d in diffs),
        "ties": sum(d == 0 for d in diffs),
        "losses": sum(d < 0 for d in diffs),
    }


def per_seed(runs: list[dict[str, Any]], target: float | None, second: float | None) -> dict[str, Any]:
    """Each seed's best test accuracy, final test loss and epochs/seconds to the targets (None: not reached), with medians."""
    out: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
    for key, values in (
        ("best_test_acc", [max((e["test_acc"] for e in r["epochs"]), default=None) for r in runs]),
        ("final_test_loss", [r["epochs"][-1]["test_loss"] if r["epochs"] else None for r in runs]),
        ("epochs_to_target", [reach(r["epochs"], target)[0] if target is not None else None for r in runs]),
        ("seconds_to_target", [reach(r["epochs"], target)[1] if target is not None else None for r in runs]),
        ("epochs_to_second", [reach(r["epochs"], second)[0] if second is not None else None for r in runs]),
        ("seconds_to_second", [reach(r["epochs"], second)[1] if second is not None else None for r in runs]),
    ):
        out[key] = values
        known = [v for v in values if v is not None]
        out[f"{key}_median"] = statistics.median(known) if len(known) == len(values) and known else None
        out[f"{key}_range"] = [min(known), max(known)] if known else None
    return out


def save_partial(st: dict[str, Any], mine: list[tuple], last: list[dict[str, Any]], record, args, out: Path, size: int) -> None:
    """``convergence.partial.json``: this setting summarised over the epochs every interleaved run has finished so far."""
    import copy

    st["optimizers"] = {}
    for (spec, lr, _), run in zip(mine, last):
        record(st, spec, lr, copy.deepcopy(run))
    if any("curve" not in p for res in st["optimizers"].values() for p in res["lr_grid"].values()):
        return
    summarise(st, args.optimizers)
    epochs = min(len(run.get("epochs", [])) for run in last)
    save_json(
        {
            "partial": True,
            "epochs_done": epochs,
            "world_size": size,
            "machine": machine(),
            "args": dict(vars(args).items()),
            "settings": [st],
        },
        "convergence.partial.json",
        out,
    )
    st["optimizers"] = {}


def plot(setting: dict[str, Any], path: Path, world_size: int) -> Path:
    """Test accuracy and test loss of each optimizer's chosen LR against epochs and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for spec, res in setting["optimizers"].items():
        curve = res["curve"]
        if not curve:
            continue
        label = f"{spec} (lr {res['chosen_lr']:g})"
        for col, xkey in enumerate(("epoch", "seconds")):
            xs = [r[xkey] for r in curve]
            axes[0][col].plot(xs, [100 * r["test_acc"] for r in curve], "o-", ms=3, label=label)
            axes[1][col].semilogy(xs, [r["test_loss"] for r in curve], "o-", ms=3, label=label)
    target = setting.get("target_test_acc")
    for col, xlabel in enumerate(("epoch", "training seconds")):
        if target is not None:
            axes[0][col].axhline(100 * target, color="grey", ls="--", lw=1, label=f"target {100 * target:.1f}%")
        axes[0][col].set(xlabel=xlabel, ylabel="test accuracy (%)")
        axes[1][col].set(xlabel=xlabel, ylabel="test loss")
        for row in range(2):
            axes[row][col].grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend for all four panels, below them
    rows = len(labels)
    fig.legend(handles, labels, loc="lower center", ncol=1 if rows <= 3 else 2, fontsize=8, frameon=False)
    fig.suptitle(
        f"{setting['data']}: batch {setting['batch_size']}/worker x {world_size} workers ({setting['steps_per_epoch']} steps/epoch)"
    )
    legend_rows = rows if rows <= 3 else -(-rows // 2)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * legend_rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_per_seed(setting: dict[str, Any], specs: Sequence[str], path: Path) -> Path:
    """Each seed's curves of ``specs`` at their chosen LR: test accuracy, training loss and test loss against epochs,
    and each seed's best test accuracy side by side.

    The mean curve the benchmark ranks by can hide one seed that ends lower
    (a seed that overfits, or that fit the training set while the LR was
    still high): this figure shows where each seed's training loss reaches
    zero and what its test accuracy and loss do after that; the last panel
    pairs the optimizers' best accuracies seed by seed (the same seed: the
    same initialisation and data order), which :func:`paired_difference` sums up.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unknown = [spec for spec in specs if spec not in setting["optimizers"]]
    if unknown:
        raise ValueError(f"{unknown} not in this run; its optimizers are {list(setting['optimizers'])}")
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    styles = ("-", "--", ":", "-.")
    handles: list[Any] = []  # the colour is the optimizer, the line style the seed (a few seeds) or none (many)
    seeds: list[Any] = []
    for color, spec in enumerate(specs):
        res = setting["optimizers"][spec]
        runs = res["lr_grid"][repr(res["chosen_lr"])]["runs"]
        many = len(runs) > len(styles)
        handles.append(Line2D([], [], color=f"C{color}", label=f"{spec} (lr {res['chosen_lr']:g})"))
        for k, run in enumerate(runs):
            xs = [e["epoch"] for e in run["epochs"]]
            kw = {"color": f"C{color}", "ls": "-" if many else styles[k], "marker": "o", "ms": 2, "lw": 0.8 if many else 1.5}
            axes[0].plot(xs, [100 * e["test_acc"] for e in run["epochs"]], **kw)
            axes[1].semilogy(xs, [max(e["train_loss"], 1e-6) for e in run["epochs"]], **kw)
            axes[2].semilogy(xs, [e["test_loss"] for e in run["epochs"]], **kw)
            if not many and len(seeds) <= k:
                seeds.append(Line2D([], [], color="black", ls=styles[k], label=f"seed {run['seed']}"))
        best = [100 * max((e["test_acc"] for e in run["epochs"]), default=math.nan) for run in runs]
        offset = (color - (len(specs) - 1) / 2) * 0.1  # side by side at each seed
        axes[3].plot([k + offset for k in range(len(runs))], best, "o", color=f"C{color}")
        axes[3].axhline(statistics.fmean(best), color=f"C{color}", ls="--", lw=0.8)
    axes[3].set_xticks(range(len(runs)), [str(run["seed"]) for run in runs])  # every optimizer ran the same seeds
    for ax, xlabel, ylabel in zip(
        axes,
        ("epoch", "epoch", "epoch", "seed (dashed: the mean over seeds)"),
        ("test accuracy (%)", "training loss", "test loss", "best test accuracy (%)"),
    ):
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    fig.legend(handles=handles + seeds, loc="lower center", ncol=1, fontsize=7, frameon=False)
    fig.suptitle(f"{setting['data']}: batch {setting['batch_size']}/worker, each seed")
    fig.tight_layout(rect=(0, 0.03 + 0.028 * (len(handles) + len(seeds)), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or a dash as wide as the number would be."""
    if x is None:
        width = spec.split(".", maxsplit=1)[0].rstrip("df")
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(x, spec)


def table(result: dict[str, Any]) -> str:
    """The results as text: one line per (data, batch size, optimizer), then the target."""
    w = max([len("optimizer")] + [len(spec) for st in result["settings"] for spec in st["optimizers"]])
    head = (
        f"{'data':<8} {'batch':>5} {'optimizer':<{w}} {'lr':>6} {'best acc':>8} {'final loss':>10} {'epochs':>6} "
        f"{'secs':>7} {'x ref ep':>8} {'x ref s':>7} {'ep 2nd':>6} {'s 2nd':>7} {'s/epoch':>7} {'fwd+bwd':>7} {'step':>6} {'refresh':>7}"
    )
    lines = [head]
    for st in result["settings"]:
        for spec, r in st["optimizers"].items():
            lines.append(
                f"{st['data']:<8} {st['batch_size']:>5} {spec:<{w}} {r['chosen_lr']:>6g} "
                f"{_fmt(r['best_test_acc'], '8.4f')} {_fmt(r['final_test_loss'], '10.4f')} "
                f"{_fmt(r['epochs_to_target'], '6d')} {_fmt(r['seconds_to_target'], '7.1f')} "
                f"{_fmt(r['epochs_ratio'], '8.2f')} {_fmt(r['seconds_ratio'], '7.2f')} "
                f"{_fmt(r.get('epochs_to_second'), '6d')} {_fmt(r.get('seconds_to_second'), '7.1f')} "
                f"{_fmt(r['mean_epoch_s'], '7.2f')} {_fmt(r['mean_fwdbwd_s'], '7.2f')} {_fmt(r['mean_step_s'], '6.2f')} {_fmt(r['mean_refresh_s'], '7.2f')}"
                + (f"  diverged ({r['diverged'][:40]})" if r["diverged"] else "")
            )
        lines.append(
            f"  target: {st['reference']}'s best test accuracy {_fmt(st['target_test_acc'], '.4f')} "
            + (
                f"; second target: {st['second_reference']}'s {_fmt(st['second_target_test_acc'], '.4f')} (ep 2nd, s 2nd)"
                if st.get("second_reference")
                else ""
            )
            + " (epochs, secs: to reach it; x ref: ratio to the reference's; s/epoch, fwd+bwd, step: mean training seconds per epoch; "
            "refresh: DHO2's eigenpair refreshes, part of step)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    backend = start(args)
    rank, size = backend.rank, backend.size
    device = worker_device(args.device)
    out = Path(args.out)
    # Every (data, batch size) must give each worker at least one full batch: check all before training any.
    settings: list[dict[str, Any]] = []
    loaders = {}
    for data in args.data:
        for bs in args.batch_sizes:
            try:
                train_loader, test_loader, classes, model_name = make_loaders(
                    argparse.Namespace(data=data, seed=args.split_seed, batch_size=bs), rank, size
                )
                model_name = args.model or model_name
                loaders[data, bs] = train_loader, test_loader, classes, model_name
            except ImportError as exc:
                raise SystemExit(f"error: {exc}") from None
            except ValueError:
                n = len(make_loaders(argparse.Namespace(data=data, seed=args.split_seed, batch_size=1), rank, size)[0].data)
                raise SystemExit(
                    f"error: --batch-sizes {bs}: {size} worker(s) x {bs} = {size * bs} images per step, "
                    f"more than {data}'s {n} training images"
                ) from None
            settings.append(
                {
                    "data": data,
                    "batch_size": bs,
                    "global_batch": bs * size,
                    "model": model_name,
                    "train_size": len(train_loader.data),
                    "test_size": len(test_loader.data),
                    "steps_per_epoch": len(train_loader),
                    "optimizers": {},
                }
            )
    runs = [(st, spec, lr, seed) for st in settings for spec in args.optimizers for lr in args.grids[spec] for seed in args.seeds]
    log(
        rank,
        f"convergence: {size} worker(s) via {backend.name} on {device}, {args.epochs} epochs, {len(runs)} runs: "
        + "; ".join(f"{st['data']} batch {st['batch_size']}/worker ({st['steps_per_epoch']} steps/epoch)" for st in settings),
    )
    t_start = time.perf_counter()

    def record(st: dict[str, Any], spec: str, lr: float, run: dict[str, Any]) -> None:
        res = st["optimizers"].setdefault(spec, {"lr_grid": {}})
        res["config"] = {**spec_config(spec), **optimizer_kwargs(spec, args, st["data"])}  # what the runs used
        point = res["lr_grid"].setdefault(repr(lr), {"lr": lr, "runs": []})
        point["runs"].append(run)
        if len(point["runs"]) == len(args.seeds):
            point["curve"] = mean_curve(point["runs"], args.epochs)
            point["diverged"] = next((r["diverged"] for r in point["runs"] if r["diverged"]), None)
            point["best_test_acc"] = max((r["test_acc"] for r in point["curve"]), default=None)
            point["final_test_loss"] = point["curve"][-1]["test_loss"] if point["curve"] else None

    def describe(st, spec, lr, seed) -> str:
        return f"{st['data']} batch {st['batch_size']}/worker {spec} lr {lr:g} (x{size}) seed {seed}"

    if not args.interleave:
        for i, (st, spec, lr, seed) in enumerate(runs):
            log(rank, f"[{i + 1}/{len(runs)}] {describe(st, spec, lr, seed)}  ({time.perf_counter() - t_start:.0f} s so far)")
            record(st, spec, lr, train_run(args, backend, device, st["data"], loaders[st["data"], st["batch_size"]], spec, lr, seed))
    else:  # the runs of a setting alternate epochs, so the machine's load drifts fall on all of them alike
        for st in settings:
            mine = [(spec, lr, seed) for s_, spec, lr, seed in runs if s_ is st]
            log(
                rank,
                f"{st['data']} batch {st['batch_size']}/worker: {len(mine)} runs, interleaved by epoch: "
                + "; ".join(f"[{i + 1}] {describe(st, *r)}" for i, r in enumerate(mine)),
            )
            gens = [
                train_epochs(args, backend, device, st["data"], loaders[st["data"], st["batch_size"]], *r, label=f"[{i + 1}] ")
                for i, r in enumerate(mine)
            ]
            last: list[dict[str, Any]] = [{} for _ in mine]
            live = list(range(len(mine)))
            while live:
                for i in list(live):
                    try:
                        last[i] = next(gens[i])
                    except StopIteration:
                        live.remove(i)
                if rank == 0 and live:  # what the epochs so far show, in case the run is stopped before the end
                    save_partial(st, mine, last, record, args, out, size)
            st["optimizers"] = {}
            for (spec, lr, _), run in zip(mine, last):
                record(st, spec, lr, run)
    for st in settings:
        summarise(st, args.optimizers)
    result = {
        "args": dict(vars(args).items()),
        "machine": machine(),
        "engine": backend.name,
        "world_size": size,
        "device": str(device),
        "total_s": time.perf_counter() - t_start,
        "seconds": "cumulative training seconds (forward, backward, step with its communication), "
        "evaluation and set-up excluded, mean over workers",
        "settings": settings,
    }
    if rank == 0:
        path = save_json(result, "convergence.json", out)
        (out / "convergence.partial.json").unlink(missing_ok=True)
        pngs = [plot(st, out / f"convergence_{st['data']}_b{st['batch_size']}.png", size) for st in settings]
        print("\n" + table(result))
        for st in settings:
            for spec, r in st["optimizers"].items():
                grid = ", ".join(
                    f"{p['lr']:g}: {_fmt(p['best_test_acc'], '.4f')}" + (" (diverged)" if p["diverged"] else "")
                    for p in r["lr_grid"].values()
                )
                print(f"  {st['data']} b{st['batch_size']} {spec}: LR grid (best test acc) {grid}; chose {r['chosen_lr']:g}")
        print(f"wrote {path} and {', '.join(map(str, pngs))}")
    return result


if __name__ == "__main__":
    main()
