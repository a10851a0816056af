"""The paper's baselines and ablations as configurations of the one optimizer."""
from __future__ import annotations

from typing import Any, Dict

import torch.nn as nn

__all__ = ["VARIANTS", "make_optimizer"]

#: name -> keyword arguments of :class:`~spdkfac.SPDKFACOptimizer`
VARIANTS: Dict[str, Dict[str, Any]] = {
    # S-SGD: same gradient all-reduce, no K-FAC.
    "sgd": dict(precondition=False),
    # SPD-KFAC: pipelined factor all-reduce with optimal fusion + load-balancing placement.
    "spdkfac": dict(pipelining=True, fusion="optimal", placement="lbp"),
    # D-KFAC: factors all-reduced after backward, every worker inverts everything.
    "dkfac": dict(pipelining=False, fusion="threshold", placement="local"),
    # MPD-KFAC: factors all-reduced after backward, round-robin inversion, all inverses broadcast.
    "mpdkfac": dict(pipelining=False, fusion="threshold", placement="seq"),
    # Ablations of Section VI (Pipe = pipelined factor communication, LBP = placement).
    "-pipe-lbp": dict(pipelining=False, fusion="threshold", placement="seq"),
    "+pipe-lbp": dict(pipelining=True, fusion="optimal", placement="seq"),
    "-pipe+lbp": dict(pipelining=False, fusion="threshold", placement="lbp"),
    "+pipe+lbp": dict(pipelining=True, fusion="optimal", placement="lbp"),
    # Beyond the paper: SPD-KFAC with each layer preconditioned on one worker and the result broadcast (KAISA's MEM-OPT).
    "spdkfac-dp": dict(pipelining=True, fusion="optimal", placement="lbp", distribute_preconditioning=True),
}


def make_optimizer(variant: str, model: nn.Module, **kwargs: Any):
    """Build ``SPDKFACOptimizer`` configured as ``variant`` (see :data:`VARIANTS`)."""
    from .optimizer import SPDKFACOptimizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {sorted(VARIANTS)}")
    config = dict(VARIANTS[variant])
    overlap = sorted(set(config) & set(kwargs))
    if overlap:
        raise ValueError(f"variant {variant!r} fixes {overlap}; do not pass them")
    config.update(kwargs)
    return SPDKFACOptimizer(model, **config)
