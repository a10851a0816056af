"""Normalisation layers' affine parameters (``norm_layers='kfac'``): one 2x2 Fisher block per channel.

A BatchNorm, LayerNorm, GroupNorm or RMSNorm (scale only) computes ``y = γ_c x̂ + β_c`` per channel
``c``, so a sample's gradient of channel ``c``'s ``(scale, shift)`` is
``u_c = (Σ_s x̂_s g_s, Σ_s g_s)`` over the positions ``s`` the channel covers
(pixels, sequence positions). Its empirical Fisher is exact per channel and
tiny: ``F_c = n Σ_i u_ic u_icᵀ`` over the local batch of ``n`` samples (the
gradients ``g`` are those of a batch-*mean* loss, as for every factor here,
so ``n u`` is a sample's own gradient and ``F_c`` a per-sample mean that P
workers average into the global batch's). The 2x2 block keeps the
correlation of scale and shift, which a diagonal drops, for the same cost
(``C`` 2x2 blocks: decomposed in one batched call, a few hundred bytes
all-reduced per layer).

To reuse the machinery of every other layer, the blocks are the ``G``
factor (``C`` blocks of 2x2; 1x1 without a shift) and ``A`` is a constant
one-element diagonal ``[1]``, so the curvature is ``A ⊗ G`` and is damped
like every layer's: ``(G_c+γI)^-1 grad_c / (1+γ)`` with the inverse method
(the factored damping of ``(A+γI) ⊗ (G+γI)``), ``(F_c+γI)^-1 grad_c`` with
the eigen method.

``x̂`` is recomputed from the input in the backward pass, with the module's
own statistics (the batch's in training mode, the running ones in eval mode
or without tracking), as its forward computed it; the input is held by
reference between the forward and backward pass (autograd holds it anyway).
The batch is the first dimension. In training mode a BatchNorm's output
depends on the whole batch; as in kfac-jax and ASDL, the per-sample
gradients treat the statistics as constants.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..factor_shape import FactorShape
from .base import LayerHelper

__all__ = ["NORM_TYPES", "NormHelper", "normalised"]

NormModule = Union[nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm]  # (Python 3.9: no X | Y here)
#: The classes this helper reads exactly (a subclass may normalise differently: SyncBatchNorm spans the workers).
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def normalised(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x̂``: what ``module`` multiplies by its scale, computed as its forward does (without the affine part)."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.RMSNorm):
        return F.rms_norm(x, module.normalized_shape, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    assert isinstance(module, nn.modules.batchnorm._BatchNorm)
    batch_stats = module.training or module.running_mean is None
    return F.batch_norm(
        x,
        None if batch_stats else module.running_mean,
        None if batch_stats else module.running_var,
        None,
        None,
        batch_stats,
        0.0,
        module.eps,
    )


class NormHelper(LayerHelper):
    """Scale-and-shift curvature: ``G`` holds a 2x2 Fisher block per channel, ``A`` is ``[1]``."""

    module: NormModule

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.channels = self.weight.numel()
        self._inputs: list[torch.Tensor] = []  # forward inputs awaiting their backward pass (last in, first out)

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(1, diagonal=True)

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(2 if self.has_bias else 1, blocks=self.channels)

    def unbatched(self, t: torch.Tensor) -> bool:
        if isinstance(self.module, (nn.LayerNorm, nn.RMSNorm)):  # (batch norms and GroupNorm need the batch dimension)
            return t.dim() == len(self.module.normalized_shape)
        return False

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        self._inputs.append(x)
        return torch.ones(1, dtype=dtype, device=x.device), 1

    def forget(self) -> None:
        self._inputs = []

    def _channel_last(self, t: torch.Tensor) -> torch.Tensor:
        """``(n, positions, C)``: the batch first, the channels (the parameters' entries) last."""
        if isinstance(self.module, (nn.LayerNorm, nn.RMSNorm)):
            return t.reshape(t.shape[0], -1, self.channels)
        return t.reshape(t.shape[0], self.channels, -1).transpose(1, 2)

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        if not self._inputs:
            raise RuntimeError(f"{type(self.module).__name__}: an output gradient arrived without its forward input")
        x = self._inputs.pop()
        xhat = self._channel_last(normalised(self.module, x.to(g.dtype)))
        grad = self._channel_last(g)
        per_sample = [(xhat * grad).sum(1)] + ([grad.sum(1)] if self.has_bias else [])  # each (n, C)
        u = torch.stack(per_sample, dim=-1)  # (n, C, 1 or 2): scale, shift
        return torch.einsum("ncp,ncq->cpq", u, u), g.shape[0]

    def grad(self) -> torch.Tensor | None:
        if self.weight.grad is None:
            return None
        parts = [self.weight.grad.reshape(-1)]
        if self.bias is not None:
            parts.append(self.bias.grad.reshape(-1) if self.bias.grad is not None else torch.zeros_like(self.weight.grad).reshape(-1))
        return torch.stack(parts, dim=-1).reshape(self.grad_shape)

    def write_grad(self, update: torch.Tensor) -> None:
        flat = update.reshape(self.channels, -1)
        assert self.weight.grad is not None  # the caller preconditioned grad(), which needs it
        self.weight.grad.copy_(flat[:, 0].reshape(self.weight.shape))
        if self.bias is not None:
            if self.bias.grad is None:
                self.bias.grad = torch.zeros_like(self.bias)
            self.bias.grad.copy_(flat[:, 1].reshape(self.bias.shape))

    def describe(self) -> dict[str, str]:
        return {"A": "1 (constant)", "G": self.g_shape.describe()}
