"""``nn.Embedding``: a Linear layer on one-hot rows, so ``A`` is diagonal (token counts), kept as a vector.

With ``T`` indices per sample the rows are the ``n*T`` one-hot vectors:
``A = diag(counts) / (n*T)`` (no bias), ``G`` the Gram of the output
gradients (``n g^T g``, as a Linear layer on sequences). The gradient is
``weight.grad`` transposed (``embedding_dim x num_embeddings``); a diagonal
``A`` only scales its columns, so rows never seen keep a zero update.
With a ``padding_idx`` the padding positions still count in ``G`` and in
the row count (their output gradients exist, though the padding row gets no
gradient); the padding row's update stays zero.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..factor_shape import FactorShape
from ..linalg import symmetric_gram
from .base import LayerHelper
from .linear import square_sums

__all__ = ["EmbeddingHelper"]


class EmbeddingHelper(LayerHelper):
    module: nn.Embedding

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        if getattr(module, "sparse", False):
            return "sparse gradients (sparse=True)"
        return None

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(self.module.num_embeddings, diagonal=True)

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(self.module.embedding_dim)

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        indices = x.reshape(-1)
        counts = torch.bincount(indices, minlength=self.module.num_embeddings).to(dtype)
        return counts, indices.numel()

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = g.reshape(-1, g.shape[-1])
        return symmetric_gram(rows), rows.shape[0]

    def output_diagonal(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        return square_sums(g)

    def grad(self) -> torch.Tensor | None:
        grad = self.weight.grad
        return None if grad is None else grad.T

    def write_grad(self, update: torch.Tensor) -> None:
        assert self.weight.grad is not None  # the caller preconditioned grad()
        self.weight.grad.copy_(update.T)
