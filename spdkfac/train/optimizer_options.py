"""The one mapping from a training command line to the optimizer's keyword arguments (``spdkfac.train``, the convergence benchmark).

A benchmark that made its optimizers by other rules than the job would
measure something users do not run; so both parsers define the K-FAC
method flags with :func:`add_kfac_arguments` and both turn their arguments
into :func:`~spdkfac.variants.make_optimizer`'s keyword arguments with
:func:`optimizer_options`. An optimizer spec (``'spdkfac:compute_method=eigen'``)
may set any option itself: the spec wins over the flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..config import BaseOptimizer, ComputeMethod, EigenRefresh, EKFACUpdate, UpdateFusion
from ..variants import OTHER_OPTIMIZERS, optimizer_config

__all__ = ["KFAC_ARGUMENTS", "add_kfac_arguments", "optimizer_options"]

#: The arguments that become K-FAC options (of the optimizers that precondition), by their optimizer keyword.
KFAC_ARGUMENTS = (
    "damping",
    "kl_clip",
    "factor_decay",
    "factor_update_freq",
    "inv_update_freq",
    "perf_model",
    "compute_method",
    "eigen_refresh",
    "ekfac_decay",
    "ekfac_update",
    "distribute_preconditioning",
)


def add_kfac_arguments(p: argparse.ArgumentParser) -> None:
    """``--base``, ``--update-fusion`` and the compute-method flags, as both command lines spell them."""
    p.add_argument(
        "--base",
        default="sgd",
        choices=BaseOptimizer.choices(),
        help="K-FAC optimizers: the update after preconditioning: momentum SGD, AdamW or LAMB (betas 0.9, 0.999; decoupled weight decay)",
    )
    p.add_argument(
        "--update-fusion",
        default="none",
        choices=UpdateFusion.choices(),
        help="where the parameter update runs (SGD and K-FAC optimizers): in step(), in the next forward pass, or in "
        "backward as each gradient is ready (K-FAC: needs --kl-clip 0; not with --amp fp16); same results",
    )
    p.add_argument(
        "--compute-method",
        default="inverse",
        choices=ComputeMethod.choices(),
        help="precondition with damped inverses of each factor, with their eigendecompositions "
        "(damping added to the eigenvalues of A⊗G), or EKFAC (the eigenbasis with a scaling re-estimated every step)",
    )
    p.add_argument(
        "--eigen-refresh",
        default="exact",
        choices=EigenRefresh.choices(),
        help="eigen/ekfac: refresh each eigenbasis with a full eigh, or warm-started from the previous one",
    )
    p.add_argument(
        "--ekfac-decay", type=float, default=0.95, help="ekfac: decay of the running scaling (Adam's beta2 with --ekfac-update adam)"
    )
    p.add_argument(
        "--ekfac-update",
        default="natural",
        choices=EKFACUpdate.choices(),
        help="ekfac: divide by the damped scaling, or run Adam in the eigenbasis (SOAP's update with K-FAC's basis; needs --base adamw)",
    )
    p.add_argument(
        "--distribute-preconditioning",
        action="store_true",
        help="precondition each layer on one worker and broadcast the result (K-FAC optimizers)",
    )


def _base(config: Mapping[str, Any], args: argparse.Namespace) -> str:
    """The base update: the spec's, else ``--base`` for the optimizers that precondition (SGD stays SGD)."""
    return str(config.get("base", args.base if config.get("precondition", True) else BaseOptimizer.SGD))


def optimizer_options(
    spec: str, args: argparse.Namespace, *, adam_weight_decay: float | None = None, dho2: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """:func:`~spdkfac.variants.make_optimizer`'s keyword arguments for ``spec`` beyond the variant's own (which the spec's changes override).

    Reads ``args.momentum``, ``args.weight_decay``, ``args.base``,
    ``args.update_fusion`` and the :data:`KFAC_ARGUMENTS` (``kl_clip`` 0: no
    clip). An Adam-type optimizer (DHO2, AdamW, a K-FAC optimizer with an
    AdamW or LAMB base) takes ``adam_weight_decay`` when given, else
    ``args.weight_decay``, and no momentum; DHO2 takes the ``dho2`` options.
    """
    config = optimizer_config(spec)
    name = spec.partition(":")[0]
    base = _base(config, args)
    adam = name in OTHER_OPTIMIZERS or base != BaseOptimizer.SGD
    options: dict[str, Any] = {}
    if "weight_decay" not in config:
        options["weight_decay"] = adam_weight_decay if adam and adam_weight_decay is not None else args.weight_decay
    if name in OTHER_OPTIMIZERS:  # DHO2 and AdamW: AdamW's rule, no momentum, no K-FAC options
        if name != "adamw":
            options.update({k: v for k, v in (dho2 or {}).items() if k not in config})
        return options
    wanted: dict[str, Any] = {"update_fusion": args.update_fusion}
    if adam:
        wanted["base"] = base
    else:
        wanted["momentum"] = args.momentum
    if config.get("precondition", True):
        wanted.update({key: getattr(args, key) for key in KFAC_ARGUMENTS})
        wanted["kl_clip"] = None if args.kl_clip == 0 else args.kl_clip
    options.update({k: v for k, v in wanted.items() if k not in config})
    return options
