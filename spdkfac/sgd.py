"""The update every parameter gets after preconditioning: ``torch.optim.SGD``'s momentum and weight decay."""

from __future__ import annotations

from typing import Any

import torch

from .updates import momentum_direction

__all__ = ["momentum_sgd_update"]


def momentum_sgd_update(param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """``p -= lr * buf`` with ``buf = momentum*buf + (grad + wd*p)`` (the first ``buf`` is the gradient), in place."""
    for group in param_groups:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            p.add_(momentum_direction(p.grad, p, state[p], momentum, wd), alpha=-lr)
