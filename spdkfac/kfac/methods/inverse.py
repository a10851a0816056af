"""``compute_method='inverse'`` (the paper's): damped inverses ``(F + γI)^-1``, symmetric, sent as upper triangles.

The update is ``(G+γI)^-1 grad (A+γI)^-1``. Blocks of a block-diagonal
factor are inverted in one batched Cholesky; a diagonal factor (an
embedding's ``A``, a factor wider than ``max_factor_dim``) elementwise.

A factor whose damped Cholesky fails (one whose rounding error, ``~ eps *
scale``, exceeds the damping on its null space: a small batch through layers
that scale gradients by 1e8 and more, docs/fault-tolerance.md) is inverted by
the fallback instead, ``(F₊ + γI)^-1`` through an eigendecomposition with the
negative eigenvalues set to 0 (:func:`~spdkfac.kfac.linalg.invert_clamped_eigh`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...perfmodels import PerfModel
from ..factor_shape import FactorShape
from ..linalg import invert_clamped_eigh, invert_spd, mirrored_upper
from .base import DecompositionMethod, MethodState

__all__ = ["InverseMethod", "invert_blocks"]


def invert_blocks(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """``(F_b + γI)^-1`` of every block of a ``(blocks, d, d)`` stack: one batched Cholesky, exactly symmetric."""
    damped = factor.clone()
    damped.diagonal(dim1=-2, dim2=-1).add_(damping)
    return mirrored_upper(torch.cholesky_inverse(torch.linalg.cholesky(damped)))


class InverseMethod(DecompositionMethod):
    name = "inverse"
    label = "inverses"
    suffix = "_inv"

    def payload_size(self, shape: FactorShape) -> int:
        return shape.packed_size  # the inverse is symmetric (diagonal): the factor's own flat form

    def kept_size(self, shape: FactorShape) -> int:
        return math.prod(shape.full_shape)  # kept unpacked: full blocks

    def _invert(self, shape: FactorShape, factor: torch.Tensor, damping: float) -> torch.Tensor:
        if shape.diagonal:
            return 1.0 / (factor + damping)
        if shape.blocks == 1:
            return invert_spd(factor, damping)
        return invert_blocks(factor, damping)

    fallback_label = "inverted through an eigendecomposition with its negative eigenvalues (rounding) set to 0"

    def fallback(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F₊ + γI)^-1`` by :func:`~spdkfac.kfac.linalg.invert_clamped_eigh` (a diagonal factor never fails)."""
        inverse = 1.0 / (factor.clamp_min(0.0) + damping) if shape.diagonal else invert_clamped_eigh(factor, damping)
        payload = shape.pack(inverse)
        return shape.unpack(payload), payload

    def owned(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload = shape.pack(self._invert(shape, factor, damping))
        # Keep what the receivers rebuild: bitwise the same on every rank, in the same layout.
        return shape.unpack(payload), payload

    def local(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> torch.Tensor:
        return self._invert(shape, factor, damping)

    def received(self, payload: torch.Tensor, shape: FactorShape) -> torch.Tensor:
        return shape.unpack(payload)

    def payload(self, kept: Any, shape: FactorShape) -> torch.Tensor:
        return shape.pack(kept)  # (kept exactly symmetric: nothing lost)

    def failure(self, what: str, shape: FactorShape, factor: torch.Tensor, damping: float, step: int, exc: Exception) -> str:
        # The factors were checked finite, so the damping lost to rounding: a factor of lower rank than its
        # dimension (fewer rows, samples x positions, than that) has only the damping on its null space, and
        # Cholesky's rounding error grows with the factor's scale. Say which, with a damping that would do.
        scale = float(factor.diagonal(dim1=-2, dim2=-1).max()) if factor.dim() > 1 else float(factor.max())
        enough = shape.dim * torch.finfo(factor.dtype).eps * scale
        dimension = f"dimension {shape.dim}" if shape.blocks == 1 else f"{shape.describe()}"
        return (
            f"{what} ({dimension}, largest diagonal entry {scale:.3g}) is not "
            f"positive definite even with damping {damping:g} at step {step}. A factor of lower rank than "
            f"its dimension (from fewer rows, samples x positions, than that: a small batch) keeps only the "
            f"damping in its null space, and {factor.dtype} rounding at this scale is about {enough:.2g}: raise "
            f"damping well above that or the batch size; if training had been diverging, lower lr or kl_clip "
            f"instead. ({exc})"
        )

    stackable = True  # two matmuls: with (n, d, d) inverses and (n, g, a) gradients, batched products

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: MethodState | None = None) -> torch.Tensor:
        """``G_inv @ grad @ A_inv`` (per block; a diagonal ``A_inv`` scales the columns, a diagonal ``G_inv`` the rows);
        the damping is in the inverses."""
        g_inv: torch.Tensor = g
        a_inv: torch.Tensor = a
        left = g_inv.unsqueeze(-1) * grad.to(g_inv.dtype) if g_inv.dim() == 1 else g_inv @ grad.to(g_inv.dtype)
        return left * a_inv if a_inv.dim() == 1 else left @ a_inv

    def tensors(self, kept: Any) -> list[torch.Tensor]:
        return [kept]

    def save(self, kept: Any) -> Any:
        return kept

    def load(self, saved: Any, shape: FactorShape, device: torch.device) -> torch.Tensor:
        value = torch.as_tensor(saved).detach().clone().to(device)
        if tuple(value.shape) != shape.full_shape:
            raise ValueError(f"saved inverse is {tuple(value.shape)}, expected {shape.full_shape}")
        return value

    def curve(self, perf: PerfModel) -> Callable[[float], float]:
        return perf.inverse
