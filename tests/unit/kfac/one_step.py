"""One exact K-FAC step on a single layer (lr 1, no momentum, no KL clip), for the per-layer-type reference tests."""

from __future__ import annotations

import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer


def kfac_step(module: nn.Module, x: torch.Tensor, method: str, damping: float, decay: float, **options):
    """One step on a random batch-mean loss; returns the output gradient, the parameter gradients, the change and the
    optimizer (``options``: more of its options)."""
    torch.manual_seed(3)
    opt = SPDKFACOptimizer(
        module, lr=1.0, momentum=0.0, damping=damping, factor_decay=decay, kl_clip=None, backend="single", compute_method=method, **options
    )
    out = module(x)
    out.retain_grad()
    weights = torch.randn(out.shape, dtype=out.dtype)
    ((out * weights).sum() / x.shape[0]).backward()  # a batch-mean loss
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    opt.step()
    change = {name: before[name] - p.detach() for name, p in module.named_parameters()}
    return out.grad, grads, change, opt
