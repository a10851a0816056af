"""The eigendecomposition's maths: ``F = Q diag(d) Q^T`` in one flat buffer, and the update in the Kronecker eigenbasis.

Used by ``compute_method='eigen'`` and ``'ekfac'`` (Pauloski et al. 2020, KAISA): ``F = Q diag(d) Q^T``
from ``torch.linalg.eigh`` (:func:`~spdkfac.kfac.linalg.symmetric_eigh`), eigenvalues below :data:`EIGEN_CLAMP` set to 0,
and the update ``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T``, which is
``(A ⊗ G + γI)^-1 vec(grad)``: the damping is added to the eigenvalues of the
Kronecker product (not to each factor), and only when preconditioning, so a
new damping needs no new decomposition. ``Q`` is not symmetric: it travels
whole, with ``d``, as one flat buffer of ``d*d + d`` elements.

What each method does
with a factor (decomposition, payload, preconditioning, checkpoint form,
cost) is its class in :mod:`spdkfac.kfac.methods`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linalg import symmetric_eigh

__all__ = [
    "EIGEN_CLAMP",
    "Eigen",
    "eigen_outer",
    "eigen_payload",
    "eigen_precondition",
    "eigen_project",
    "eigen_unproject",
    "unpack_eigen",
]

EIGEN_CLAMP = 1e-10  # eigenvalues below this are rounding noise of a PSD factor: set to exactly 0


@dataclass(frozen=True)
class Eigen:
    """One factor's eigendecomposition ``F = Q diag(d) Q^T``: ``Q`` row-major, ``d`` clamped to ``>= 0``.

    ``Q`` is ``(d, d)`` (``(blocks, d, d)`` for a block-diagonal factor, with
    ``d`` ``(blocks, d)``), or None for a diagonal factor, its own
    eigendecomposition. Both are views into one flat buffer (the one broadcast), so every rank,
    whether it computed or received them, holds the same values in the same
    memory layout and its matmuls round the same way.
    """

    Q: torch.Tensor | None  # None for a diagonal factor: Q = I
    d: torch.Tensor
    #: Warm-started refreshes since the last full ``eigh`` (a one-element view into the same buffer), or None
    #: where the basis is always exact (``eigen_refresh='exact'``, :mod:`spdkfac.kfac.methods.warm`).
    age: torch.Tensor | None = None
    #: The previous basis's residual on this factor when the refresh started from it (a one-element view; -1 where
    #: none was measured: a scheduled full ``eigh``), or None where the basis is always exact.
    drift: torch.Tensor | None = None


def eigen_payload(matrix: torch.Tensor) -> torch.Tensor:
    """``[Q row by row, d]`` of a symmetric PSD matrix as one flat buffer (what an owner broadcasts and keeps)."""
    dim = matrix.shape[0]
    d, q = symmetric_eigh(matrix)
    buffer = matrix.new_empty(dim * dim + dim)
    buffer[: dim * dim].view(dim, dim).copy_(q)  # eigh's Q is column-major: this is the row-major copy
    buffer[dim * dim :].copy_(d.masked_fill_(d < EIGEN_CLAMP, 0.0))
    return buffer


def unpack_eigen(buffer: torch.Tensor, dim: int) -> Eigen:
    """Views of ``Q`` and ``d`` in a buffer made by :func:`eigen_payload` (no copy)."""
    if buffer.numel() != dim * dim + dim:
        raise ValueError(f"eigen buffer has {buffer.numel()} elements, expected {dim * dim + dim} for dim={dim}")
    return Eigen(buffer[: dim * dim].view(dim, dim), buffer[dim * dim :])


def eigen_precondition(grad: torch.Tensor, a: Eigen, g: Eigen, damping: float) -> torch.Tensor:
    """``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T`` for a ``g_dim x a_dim`` gradient (per block for stacks).

    A diagonal ``A`` (``Q_A = I``) only scales: its rotations are left out.
    """
    v = eigen_project(grad, a, g)
    v.div_(eigen_outer(a, g).add_(damping))
    return eigen_unproject(v, a, g)


def eigen_project(grad: torch.Tensor, a: Eigen, g: Eigen) -> torch.Tensor:
    """``Q_G^T grad Q_A``: the gradient in the Kronecker eigenbasis (a new tensor; per block for stacks).

    A diagonal factor's ``Q`` is the identity: its side is left as it is.
    """
    if a.Q is not None and g.Q is not None and a.Q.dim() == 2 and g.Q.dim() == 2:
        return g.Q.T @ grad.to(g.Q.dtype) @ a.Q
    v = grad.to(g.d.dtype, copy=True) if g.Q is None else g.Q.transpose(-1, -2) @ grad.to(g.Q.dtype)
    return v if a.Q is None else v @ a.Q


def eigen_unproject(v: torch.Tensor, a: Eigen, g: Eigen) -> torch.Tensor:
    """``Q_G v Q_A^T``: back from the Kronecker eigenbasis (the inverse of :func:`eigen_project`)."""
    if a.Q is not None and g.Q is not None and a.Q.dim() == 2 and g.Q.dim() == 2:
        return g.Q @ v @ a.Q.T
    out = v if g.Q is None else g.Q @ v
    return out if a.Q is None else out @ a.Q.transpose(-1, -2)


def eigen_outer(a: Eigen, g: Eigen) -> torch.Tensor:
    """``d_G d_A^T`` (per block): K-FAC's eigenvalues of ``A ⊗ G``, shaped like the projected gradient."""
    if g.d.dim() == 1 and a.d.dim() == 1:
        return torch.outer(g.d, a.d)
    return g.d.unsqueeze(-1) * a.d.unsqueeze(-2)
