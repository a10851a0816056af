"""The shape of one Kronecker factor: a dense matrix, a block-diagonal stack of them, or a diagonal.

Every factor travels and is averaged as one flat buffer (:attr:`FactorShape.packed_size`
elements): a dense ``d x d`` factor as its upper triangle, a block-diagonal one
(a grouped convolution: one ``d x d`` block per group) as the blocks' upper
triangles one after the other, a diagonal one (an embedding's ``A``: token
counts) as its diagonal. The "full" form a layer hands out is ``(d, d)``,
``(blocks, d, d)`` or ``(d,)``. A layer has two factors, of the
:class:`FactorKind` ``A`` and ``G``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import Option
from .linalg import pack_upper, triangle_size, unpack_upper

__all__ = ["FactorKind", "FactorShape"]


class FactorKind(Option):
    """A layer's two Kronecker factors: ``A`` of its inputs (ready in the forward pass), ``G`` of its output
    gradients (ready in the backward pass)."""

    A = "A"
    G = "G"


@dataclass(frozen=True)
class FactorShape:
    """``blocks`` dense ``dim x dim`` blocks on the diagonal (1: a plain matrix), or a diagonal of ``dim`` entries."""

    dim: int
    blocks: int = 1
    diagonal: bool = False

    def __post_init__(self) -> None:
        if self.dim < 1 or self.blocks < 1:
            raise ValueError(f"a factor needs dim >= 1 and blocks >= 1, got {self}")
        if self.diagonal and self.blocks != 1:
            raise ValueError("a diagonal factor is one block")

    @property
    def packed_size(self) -> int:
        """Elements of the flat form that is averaged, stored and (for the factor itself) checkpointed packed."""
        return self.dim if self.diagonal else self.blocks * triangle_size(self.dim)

    @property
    def full_shape(self) -> tuple[int, ...]:
        if self.diagonal:
            return (self.dim,)
        return (self.dim, self.dim) if self.blocks == 1 else (self.blocks, self.dim, self.dim)

    def describe(self) -> str:
        if self.diagonal:
            return f"diagonal {self.dim}"
        square = f"{self.dim}x{self.dim}"
        return square if self.blocks == 1 else f"{self.blocks} blocks of {square}"

    def identity(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The packed identity (where running averages start)."""
        if self.diagonal:
            return torch.ones(self.dim, dtype=dtype, device=device)
        one = pack_upper(torch.eye(self.dim, dtype=dtype, device=device))
        return one if self.blocks == 1 else one.repeat(self.blocks)

    def pack(self, full: torch.Tensor) -> torch.Tensor:
        """The flat form of a full factor (``full_shape``); only the blocks' upper triangles are read."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"factor is {tuple(full.shape)}, expected {self.full_shape} ({self.describe()})")
        if self.diagonal:
            return full
        if self.blocks == 1:
            return pack_upper(full)
        rows, cols = torch.triu_indices(self.dim, self.dim, device=full.device)
        return full[:, rows, cols].reshape(-1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The full factor (exactly symmetric blocks) of its flat form."""
        if packed.numel() != self.packed_size:
            raise ValueError(f"packed factor has {packed.numel()} elements, expected {self.packed_size} ({self.describe()})")
        if self.diagonal:
            return packed
        if self.blocks == 1:
            return unpack_upper(packed, self.dim)
        rows, cols = torch.triu_indices(self.dim, self.dim, device=packed.device)
        out = packed.new_zeros(self.blocks, self.dim, self.dim)
        upper = packed.view(self.blocks, -1)
        out[:, rows, cols] = upper
        out[:, cols, rows] = upper
        return out

    def as_packed(self, factor: torch.Tensor) -> torch.Tensor:
        """``factor`` in flat form, given full or already flat (checked for size)."""
        if factor.dim() == 1:
            if factor.numel() != self.packed_size:
                raise ValueError(f"packed factor has {factor.numel()} elements, expected {self.packed_size} ({self.describe()})")
            return factor
        return self.pack(factor)
