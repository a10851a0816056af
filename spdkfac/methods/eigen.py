"""``compute_method='eigen'`` (Pauloski et al. 2020, KAISA): eigendecompositions, the damping applied when preconditioning.

``F = Q diag(d) Q^T`` (:func:`~spdkfac.decomposition.eigen_payload`), the
update ``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T``. A block-diagonal
factor is decomposed in one batched ``eigh`` and sent as ``[every Q, every
d]``; a diagonal factor is its own eigendecomposition (``Q = I``: only ``d``
is kept and sent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..decomposition import EIGEN_CLAMP, Eigen, eigen_payload, eigen_precondition, unpack_eigen
from ..factor_shape import FactorShape
from .base import DecompositionMethod

if TYPE_CHECKING:  # pragma: no cover
    from ..perfmodels import PerfModel

__all__ = ["EigenMethod"]


class EigenMethod(DecompositionMethod):
    name = "eigen"
    label = "eigendecompositions"
    suffix = "_eigen"

    def payload_size(self, shape: FactorShape) -> int:
        if shape.diagonal:
            return shape.dim
        return shape.blocks * (shape.dim * shape.dim + shape.dim)

    def owned(self, shape: FactorShape, factor: torch.Tensor, damping: float) -> tuple[Eigen, torch.Tensor]:
        if shape.diagonal:
            payload = factor.clone().masked_fill_(factor < EIGEN_CLAMP, 0.0)
        elif shape.blocks == 1:
            payload = eigen_payload(factor)
        else:
            d, q = torch.linalg.eigh(factor)
            b, dim = shape.blocks, shape.dim
            payload = factor.new_empty(self.payload_size(shape))
            payload[: b * dim * dim].view(b, dim, dim).copy_(q)
            payload[b * dim * dim :].view(b, dim).copy_(d.masked_fill_(d < EIGEN_CLAMP, 0.0))
        return self.received(payload, shape), payload  # kept as sent: the receivers' layout exactly

    def received(self, payload: torch.Tensor, shape: FactorShape) -> Eigen:
        if payload.numel() != self.payload_size(shape):
            raise ValueError(f"eigen buffer has {payload.numel()} elements, expected {self.payload_size(shape)} ({shape.describe()})")
        if shape.diagonal:
            return Eigen(None, payload)
        if shape.blocks == 1:
            return unpack_eigen(payload, shape.dim)
        b, dim = shape.blocks, shape.dim
        return Eigen(payload[: b * dim * dim].view(b, dim, dim), payload[b * dim * dim :].view(b, dim))

    def failure(self, what: str, shape: FactorShape, factor: torch.Tensor, damping: float, step: int, exc: Exception) -> str:
        dimension = f"dimension {shape.dim}" if shape.blocks == 1 else shape.describe()
        return f"the eigendecomposition of {what} ({dimension}) failed at step {step}; compute_method='inverse' does not need one. ({exc})"

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float) -> torch.Tensor:
        return eigen_precondition(grad, a, g, damping)

    def tensors(self, kept: Any) -> list[torch.Tensor]:
        return [t for t in (kept.Q, kept.d) if t is not None]

    def save(self, kept: Any) -> Any:
        return {"Q": kept.Q, "d": kept.d}

    def load(self, saved: Any, shape: FactorShape, device: torch.device) -> Eigen:
        parts = [saved["d"]] if saved.get("Q") is None else [saved["Q"].reshape(-1), saved["d"].reshape(-1)]
        buffer = torch.cat([p.reshape(-1) for p in parts]).detach().to(device)  # one fresh buffer, as the stage leaves it
        return self.received(buffer, shape)

    def curve(self, perf: PerfModel) -> Callable[[float], float]:
        return perf.eigen_curve()
