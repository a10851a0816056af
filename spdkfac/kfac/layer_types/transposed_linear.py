"""A Linear layer that stores its weight transposed, ``(in, out)``: Hugging Face's ``Conv1D`` (GPT-2, GPT, ImageGPT).

Despite its name that module is ``y = x @ W + b`` on the last dimension, a
Linear layer with ``W`` laid out ``(in features, out features)``. So the
factors are a Linear layer's (``A`` from the input rows with a ones column
for the bias, ``G`` from the output-gradient rows), and only the gradient's
layout differs: the ``g x a`` matrix the K-FAC maths takes is ``weight.grad``
transposed. The module is recognised by its class's import path
(:data:`~spdkfac.kfac.layer_types.TYPES_ELSEWHERE`), so spdkfac does not
import ``transformers``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..factor_shape import FactorShape
from .base import bias_grad_view, split_bias_column, with_bias_column
from .linear import LinearHelper

__all__ = ["TransposedLinearHelper"]


class TransposedLinearHelper(LinearHelper):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in, out)``."""

    kind = "Conv1D (a Linear layer with its weight stored transposed)"

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return "no 2-D weight of shape (in features, out features)"
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[1],)):
            return f"a bias that is not one value per output feature ({weight.shape[1]})"
        return None

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(self.weight.shape[0] + (1 if self.has_bias else 0))

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(self.weight.shape[1])

    def grad(self) -> torch.Tensor | None:
        if self.weight.grad is None:
            return None
        return with_bias_column(self.weight.grad.T, self.bias)

    def write_grad(self, update: torch.Tensor) -> None:
        split_bias_column(update, self.weight, self.bias, as_weight=lambda w: w.T)

    def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.weight.grad is None:
            return None
        return self.weight.grad.T, None if self.bias is None else bias_grad_view(self.bias)
