"""The update every parameter gets after preconditioning: ``torch.optim.SGD``'s momentum and weight decay."""

from __future__ import annotations

from typing import Any

import torch

from .updates import momentum_direction

__all__ = ["momentum_sgd_update", "sgd_param_update"]


def sgd_param_update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], lr: float, momentum: float, weight_decay: float) -> None:
    """One parameter's step, in place: the same operations wherever and whenever it runs (update fusion relies on it)."""
    p.add_(momentum_direction(grad, p, state, momentum, weight_decay), alpha=-lr)


def momentum_sgd_update(param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """``p -= lr * buf`` with ``buf = momentum*buf + (grad + wd*p)`` (the first ``buf`` is the gradient), in place."""
    for group in param_groups:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            sgd_param_update(p, p.grad, state[p], lr, momentum, wd)
