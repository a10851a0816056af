"""First-order update rules on tensors, shared by every optimizer of the project.

Each rule maps a gradient (and its parameter, for weight decay) to the change
the optimizer adds to the parameter, keeping its running statistics in a
plain ``state`` dict. They are pure tensor maths with no knowledge of layers,
preconditioning or communication: K-FAC applies momentum SGD to its
preconditioned gradients (:mod:`spdkfac.sgd`), and DHO2 applies AdamW or
momentum SGD to the gradient's component outside its Newton subspace
(:mod:`spdkfac.dho2`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["adamw_delta", "momentum_direction"]


def momentum_direction(
    grad: torch.Tensor, param: torch.Tensor, state: dict[str, Any], momentum: float, weight_decay: float
) -> torch.Tensor:
    """``torch.optim.SGD``'s direction: ``buf = momentum*buf + (grad + wd*param)`` (the first ``buf`` is that sum).

    The parameter moves by ``-lr`` times the result; ``state["momentum_buffer"]`` is updated in place.
    """
    d_p = grad if weight_decay == 0 else grad.add(param, alpha=weight_decay)
    if momentum == 0:
        return d_p
    buf: torch.Tensor | None = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = d_p.detach().clone()
    else:
        buf.mul_(momentum).add_(d_p)
    return buf


def adamw_delta(
    grad: torch.Tensor,
    param: torch.Tensor,
    state: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """The change AdamW (Loshchilov & Hutter) makes to ``param``: ``-lr*wd*param - lr*m̂/(√v̂ + eps)``.

    ``m`` and ``v`` are the running averages of the gradient and its square
    (``state["exp_avg"]``, ``state["exp_avg_sq"]``, updated in place), ``m̂``
    and ``v̂`` their bias-corrected values after ``state["step"]`` updates;
    the same arithmetic as ``torch.optim.AdamW`` (to rounding). ``param`` is
    not changed.
    """
    beta1, beta2 = betas
    if "exp_avg" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg_sq"] = torch.zeros_like(grad)
    state["step"] += 1
    step = state["step"]
    exp_avg: torch.Tensor = state["exp_avg"]
    exp_avg_sq: torch.Tensor = state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
    delta: torch.Tensor = (exp_avg / denom).mul_(-lr / bias1)
    if weight_decay != 0:
        delta.add_(param.detach(), alpha=-lr * weight_decay)
    return delta
