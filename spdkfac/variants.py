"""The paper's baselines and ablations as configurations of the one optimizer; beside them, DHO2 and AdamW by name."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch.nn as nn

from .config import HYPERPARAMETER_CHECKS, SCHEDULE_CHECKS, KFACConfig
from .dho2 import DHO2Optimizer
from .optimizer import SPDKFACOptimizer
from .step.adaptive_damping import ADAPTIVE
from .update.adamw import DistributedAdamW

__all__ = ["OTHER_OPTIMIZERS", "VARIANTS", "make_optimizer", "optimizer_config", "variant_argv", "variant_config", "variant_keys"]

#: name -> keyword arguments of :class:`~spdkfac.SPDKFACOptimizer`
VARIANTS: dict[str, dict[str, Any]] = {
    # S-SGD: same gradient all-reduce, no K-FAC.
    "sgd": dict(precondition=False),
    # SPD-KFAC: pipelined factor all-reduce with optimal fusion + load-balancing placement.
    "spdkfac": dict(pipelining=True, fusion="optimal", placement="lbp"),
    # D-KFAC: factors all-reduced after backward, every worker inverts everything.
    "dkfac": dict(pipelining=False, fusion="threshold", placement="local", overlap_preconditioning=False),
    # MPD-KFAC: factors all-reduced after backward, round-robin inversion, all inverses broadcast.
    "mpdkfac": dict(pipelining=False, fusion="threshold", placement="seq", overlap_preconditioning=False),
    # The baselines precondition after every gradient has arrived, as in the paper; SPD-KFAC and the
    # ablations overlap the preconditioning with the gradient all-reduce on steps that keep the inverses
    # (never in the paper's every-iteration setting, so the ablations differ only in Pipe and LBP).
    # Ablations of Section VI (Pipe = pipelined factor communication, LBP = placement).
    "-pipe-lbp": dict(pipelining=False, fusion="threshold", placement="seq"),
    "+pipe-lbp": dict(pipelining=True, fusion="optimal", placement="seq"),
    "-pipe+lbp": dict(pipelining=False, fusion="threshold", placement="lbp"),
    "+pipe+lbp": dict(pipelining=True, fusion="optimal", placement="lbp"),
    # Beyond the paper: SPD-KFAC with each layer preconditioned on one worker and the result broadcast (KAISA's MEM-OPT).
    "spdkfac-dp": dict(pipelining=True, fusion="optimal", placement="lbp", distribute_preconditioning=True),
}


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


@functools.cache
def variant_keys() -> tuple[str, ...]:
    """The optimizer keyword arguments a variant spec may change: all but the model and the GradScaler object."""
    names = inspect.signature(SPDKFACOptimizer.__init__).parameters
    return tuple(sorted(n for n in names if n not in ("self", "model", "grad_scaler")))


def _check_value(key: str, value: Any) -> Any:
    """The value a spec gives ``key``, checked by the optimizer's own rule (TypeError/ValueError naming ``key``)."""
    if key in HYPERPARAMETER_CHECKS:
        return HYPERPARAMETER_CHECKS[key](key, value)
    if key == "damping" and value == ADAPTIVE:  # the Levenberg-Marquardt rule (its loss closure is the caller's)
        return value
    if key in SCHEDULE_CHECKS:
        return SCHEDULE_CHECKS[key](key, value)
    if key == "skip_layers":  # one module or class name (a list would need the ',' that separates changes)
        if not isinstance(value, str):
            raise TypeError(f"skip_layers in a variant spec must be one module or class name, got {value!r}")
        return (value,)
    if key == "backend" and not isinstance(value, str):
        raise TypeError(f"backend must be a name, got {value!r}")
    if key == "perf_model" and value is not None and not isinstance(value, str):
        raise TypeError(f"perf_model must be a file path or none, got {value!r}")
    return value


def variant_config(spec: str) -> dict[str, Any]:
    """Optimizer keyword arguments of ``'name'`` or ``'name:key=value,key=value'`` (a variant with changes).

    The second form lets a benchmark run a variant with one switch flipped
    next to the original in the same launch, e.g.
    ``'spdkfac:overlap_preconditioning=false'``. An unknown key or a value the
    optimizer would refuse is a ValueError here, when a command line is
    parsed, not a traceback when the optimizer is made.
    """
    name, _, changes = spec.partition(":")
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose one of {sorted(VARIANTS)}")
    config = dict(VARIANTS[name])
    for item in filter(None, (c.strip() for c in changes.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"bad change {item!r} in variant {spec!r}; write key=value")
        if key not in variant_keys():
            raise ValueError(f"unknown option {key!r} in variant {spec!r}; the options are {', '.join(variant_keys())}")
        try:
            config[key] = _check_value(key, _parse_value(value))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad value in variant {spec!r}: {exc}") from None
    try:
        KFACConfig.from_options(config)  # the options of KFACConfig (choices, flags, integers), as the optimizer checks them
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad value in variant {spec!r}: {exc}") from None
    freqs = config.get("factor_update_freq"), config.get("inv_update_freq")
    if isinstance(freqs[0], int) and isinstance(freqs[1], int) and freqs[1] % freqs[0]:
        raise ValueError(
            f"bad value in variant {spec!r}: inv_update_freq ({freqs[1]}) must be a multiple of factor_update_freq ({freqs[0]})"
        )
    return config


#: The optimizers beside the K-FAC configurations: DHO2 with and without ADMM, and its base AdamW.
OTHER_OPTIMIZERS: dict[str, dict[str, Any]] = {"dho2": dict(admm=True), "dho2-wa": dict(admm=False), "adamw": {}}


def optimizer_config(spec: str) -> dict[str, Any]:
    """:func:`variant_config` of any name :func:`make_optimizer` takes: the K-FAC variants and :data:`OTHER_OPTIMIZERS`."""
    name, _, changes = spec.partition(":")
    if name in VARIANTS:
        return variant_config(spec)
    if name not in OTHER_OPTIMIZERS:
        raise ValueError(f"unknown variant {name!r}; choose one of {sorted(VARIANTS) + sorted(OTHER_OPTIMIZERS)}")
    return _other_changes(name, dict(OTHER_OPTIMIZERS[name]), changes, spec)


def _other_changes(name: str, config: dict[str, Any], changes: str, spec: str) -> dict[str, Any]:
    """``config`` with a spec's ``key=value`` changes; the keys checked against the optimizer's constructor (its values there)."""
    cls = DistributedAdamW if name == "adamw" else DHO2Optimizer
    keys = sorted(n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "model", "grad_scaler"))
    for item in filter(None, (c.strip() for c in changes.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"bad change {item!r} in variant {spec!r}; write key=value")
        if key not in keys:
            raise ValueError(f"unknown option {key!r} in variant {spec!r}; the options of {name} are {', '.join(keys)}")
        config[key] = _parse_value(value)
    return config


@overload
def make_optimizer(variant: Literal["dho2", "dho2-wa"], model: nn.Module, **kwargs: Any) -> DHO2Optimizer: ...


@overload
def make_optimizer(variant: Literal["adamw"], model: nn.Module, **kwargs: Any) -> DistributedAdamW: ...


@overload
def make_optimizer(variant: str, model: nn.Module, **kwargs: Any) -> SPDKFACOptimizer: ...


def make_optimizer(variant: str, model: nn.Module, **kwargs: Any) -> SPDKFACOptimizer | DHO2Optimizer | DistributedAdamW:
    """Build the optimizer ``variant`` names (see :func:`optimizer_config`): ``SPDKFACOptimizer`` configured as
    one of :data:`VARIANTS`, the DHO2 optimizer (``'dho2'``, ``'dho2-wa'``) or its base, distributed AdamW (``'adamw'``)."""
    config = optimizer_config(variant)
    overlap = sorted(set(config) & set(kwargs))
    if overlap:
        raise ValueError(f"variant {variant!r} fixes {overlap}; do not pass them")
    config.update(kwargs)
    name = variant.partition(":")[0]
    if name == "adamw":
        return DistributedAdamW(model, **config)
    if name in OTHER_OPTIMIZERS:
        return DHO2Optimizer(model, **config)
    return SPDKFACOptimizer(model, **config)


def variant_argv(argv: Sequence[str], flag: str = "--variants") -> list[str]:
    """``argv`` with each ablation name after ``flag`` (``-pipe+lbp``...) rewritten as ``flag=NAME``.

    argparse reads a list value that starts with a dash as an unknown
    option, so ``--variants sgd -pipe+lbp`` would fail; the option must use
    ``action="extend"`` for the rewritten pieces to add up.
    """
    out: list[str] = []
    listing = False  # inside the list of values that follows the flag
    for token in argv:
        if listing and token.startswith("-") and not token.startswith("--") and token.partition(":")[0] in VARIANTS:
            out.append(f"{flag}={token}")
            continue
        if listing and not token.startswith("-") and out[-1].startswith(f"{flag}="):
            out.append(flag)  # the list goes on after a rewritten name: open it again
        listing = token == flag or (listing and not token.startswith("-"))
        out.append(token)
    return out
