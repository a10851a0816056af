"""The update every parameter gets after preconditioning: ``torch.optim.SGD``'s momentum and weight decay."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["momentum_sgd_update"]


def momentum_sgd_update(param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """``p -= lr * buf`` with ``buf = momentum*buf + (grad + wd*p)`` (the first ``buf`` is the gradient), in place."""
    for group in param_groups:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            d_p = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
            if momentum != 0:
                buf = state[p].get("momentum_buffer")
                if buf is None:
                    buf = state[p]["momentum_buffer"] = d_p.detach().clone()
                else:
                    buf.mul_(momentum).add_(d_p)
                d_p = buf
            p.add_(d_p, alpha=-lr)
