"""``nn.Linear``: the rows are the inputs and output gradients, one per sample (and sequence position)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..factor_shape import FactorShape
from ..linalg import symmetric_gram
from .base import LayerHelper, bias_grad_view, split_bias_column, with_bias_column
from .shared_input import SharedInputGram

__all__ = ["LinearHelper", "square_sums"]


def square_sums(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The diagonal of the Gram of ``g``'s rows along its last dimension (the squares summed), and the row count."""
    rows = g.reshape(-1, g.shape[-1])
    return rows.square().sum(0), rows.shape[0]


class LinearHelper(LayerHelper):
    module: nn.Linear
    half_rows = True
    #: The optimizer's one cache of the last input's Gram, for layers reading the same input in a row (q, k, v; gate and
    #: up); None: each Gram computed (a helper built outside an optimizer).
    shared: SharedInputGram | None = None

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(self.module.in_features + (1 if self.has_bias else 0))

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(self.module.out_features)

    def unbatched(self, t: torch.Tensor) -> bool:
        return t.dim() == 1

    def samples_first(self, t: torch.Tensor) -> torch.Tensor:
        return t  # (the Grams sum over every row, in any order)

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        if self.shared is None:
            return self._input_gram(x, dtype)
        return self.shared.gram(x, dtype, self.has_bias, lambda: self._input_gram(x, dtype))

    def _input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        rows = x.to(dtype).reshape(-1, x.shape[-1])
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return symmetric_gram(rows), rows.shape[0]

    def input_diagonal(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        squares, count = square_sums(x.to(dtype))
        if self.has_bias:  # (the ones column's entry: the row count)
            squares = torch.cat([squares, squares.new_full((1,), count)])
        return squares, count

    def output_diagonal(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        return square_sums(g)

    def forget(self) -> None:
        if self.shared is not None:
            self.shared.forget()

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = g.reshape(-1, g.shape[-1])
        return symmetric_gram(rows), rows.shape[0]

    def grad(self) -> torch.Tensor | None:
        if self.weight.grad is None:
            return None
        return with_bias_column(self.weight.grad, self.bias)

    def write_grad(self, update: torch.Tensor) -> None:
        split_bias_column(update, self.weight, self.bias)

    def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.weight.grad is None:
            return None
        return self.weight.grad, None if self.bias is None else bias_grad_view(self.bias)
