"""``compute_method='eigen'`` (Pauloski et al. 2020, KAISA): eigendecompositions, the damping applied when preconditioning.

``F = Q diag(d) Q^T`` (:func:`~spdkfac.kfac.eigenbasis.eigen_payload`), the
update ``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T``. A block-diagonal
factor is decomposed in one batched ``eigh`` and sent as ``[every Q, every
d]``; a diagonal factor is its own eigendecomposition (``Q = I``: only ``d``
is kept and sent).

With ``eigen_refresh='warm'`` (:mod:`spdkfac.kfac.methods.warm`) a dense or
block-diagonal factor's basis is refreshed from the previous one by one
subspace-iteration step, with a full ``eigh`` every ``eigen_full_every``
refreshes or when the residual says the basis drifted; the payload then
ends with two more elements, the refreshes since the last ``eigh`` and the
residual that decided this one (-1 where none was measured), which
:class:`~spdkfac.kfac.methods.warm.RefreshStatistics` counts on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...options import Option
from ...perfmodels.models import BatchedModel, PerfModel
from ..eigenbasis import EIGEN_CLAMP, Eigen, eigen_payload, eigen_precondition, unpack_eigen
from ..factor_shape import FactorShape
from .base import DecompositionMethod, MethodState
from .warm import WarmRefresh, descending_eigh

__all__ = ["EigenMethod", "EigenOptions", "EigenRefresh"]


class EigenRefresh(Option):
    """How ``'eigen'`` and ``'ekfac'`` refresh a basis (``eigen_refresh``)."""

    EXACT = "exact"  # a full eigh every time
    WARM = "warm"  # one subspace-iteration step from the previous basis (spdkfac.kfac.methods.warm)


@dataclass(frozen=True)
class EigenOptions:
    """The eigenbasis methods' options as one value: ``eigen_refresh`` and ``eigen_full_every`` (validated)."""

    refresh: EigenRefresh = EigenRefresh.EXACT
    full_every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "refresh", EigenRefresh.parse("eigen_refresh", self.refresh))
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"eigen_full_every must be a positive integer, got {self.full_every!r}")


class EigenMethod(DecompositionMethod):
    name = "eigen"
    label = "eigendecompositions"
    suffix = "_eigen"
    precondition_products = 2  # Q_G^T grad Q_A, then Q_G (...) Q_A^T

    def __init__(self, refresh: EigenRefresh | str = EigenRefresh.EXACT, full_every: int = 10, tolerance: float | None = None) -> None:
        self.refresh = EigenRefresh.parse("eigen_refresh", refresh)
        self.warm: WarmRefresh | None = None
        if self.refresh is EigenRefresh.WARM:
            self.warm = WarmRefresh(full_every) if tolerance is None else WarmRefresh(full_every, tolerance)

    @classmethod
    def from_options(cls, options: Any = None) -> DecompositionMethod:
        if options is None:
            return cls()
        eigen: EigenOptions = options.eigen
        return cls(eigen.refresh, eigen.full_every)

    def __repr__(self) -> str:
        if self.warm is None:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}(refresh='warm', full_every={self.warm.full_every}, tolerance={self.warm.tolerance:g})"

    @property
    def starts_from_previous(self) -> bool:
        return self.warm is not None

    def _ages(self, shape: FactorShape) -> int:
        """Trailing payload elements of the warm refresh: its age and residual (none for exact or diagonal factors)."""
        return 0 if self.warm is None or shape.diagonal else 2

    def payload_size(self, shape: FactorShape) -> int:
        if shape.diagonal:
            return shape.dim
        return shape.blocks * (shape.dim * shape.dim + shape.dim) + self._ages(shape)

    def owned(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> tuple[Eigen, torch.Tensor]:
        if shape.diagonal:
            payload = factor.clone().masked_fill_(factor < EIGEN_CLAMP, 0.0)
        elif self.warm is not None:
            payload = self._warm_payload(shape, factor, previous)
        elif shape.blocks == 1:
            payload = eigen_payload(factor)
        else:
            d, q = torch.linalg.eigh(factor)
            payload = self._pack(shape, factor, d, q)
        return self.received(payload, shape), payload  # kept as sent: the receivers' layout exactly

    def _pack(
        self, shape: FactorShape, factor: torch.Tensor, d: torch.Tensor, q: torch.Tensor, age: int | None = None, residual: float = -1.0
    ) -> torch.Tensor:
        """``[Q row-major, d clamped (, age, residual)]`` as one flat buffer."""
        b, dim = shape.blocks, shape.dim
        payload = factor.new_empty(self.payload_size(shape))
        payload[: b * dim * dim].view(b, dim, dim).copy_(q.reshape(b, dim, dim))
        payload[b * dim * dim : b * (dim * dim + dim)].view(b, dim).copy_(
            d.reshape(b, dim).masked_fill(d.reshape(b, dim) < EIGEN_CLAMP, 0.0)
        )
        if age is not None:
            payload[-2] = float(age)
            payload[-1] = residual
        return payload

    def _warm_payload(self, shape: FactorShape, factor: torch.Tensor, previous: Eigen | None) -> torch.Tensor:
        """A warm-started refresh from ``previous`` (a full ``eigh`` when due or when the residual says so)."""
        assert self.warm is not None
        age = None if previous is None or previous.age is None or previous.Q is None else int(previous.age.item())
        residual = -1.0
        if previous is not None and previous.Q is not None and age is not None and not self.warm.due_full(age):
            step = self.warm.step(factor, previous.Q.to(factor.dtype))
            if step.refreshed is not None:
                return self._pack(shape, factor, *step.refreshed, age + 1, step.drift)
            residual = step.drift
        d, q = descending_eigh(factor)
        return self._pack(shape, factor, d, q, 0, residual)

    def received(self, payload: torch.Tensor, shape: FactorShape) -> Eigen:
        if payload.numel() != self.payload_size(shape):
            raise ValueError(f"eigen buffer has {payload.numel()} elements, expected {self.payload_size(shape)} ({shape.describe()})")
        if shape.diagonal:
            return Eigen(None, payload)
        b, dim = shape.blocks, shape.dim
        age, residual = (payload[-2:-1], payload[-1:]) if self._ages(shape) else (None, None)
        if shape.blocks == 1:
            eig = unpack_eigen(payload[: dim * dim + dim], dim)
            return Eigen(eig.Q, eig.d, age, residual)
        Q, d = payload[: b * dim * dim].view(b, dim, dim), payload[b * dim * dim : b * (dim * dim + dim)].view(b, dim)
        return Eigen(Q, d, age, residual)

    def failure(self, what: str, shape: FactorShape, factor: torch.Tensor, damping: float, step: int, exc: Exception) -> str:
        dimension = f"dimension {shape.dim}" if shape.blocks == 1 else shape.describe()
        return f"the eigendecomposition of {what} ({dimension}) failed at step {step}; compute_method='inverse' does not need one. ({exc})"

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: MethodState | None = None) -> torch.Tensor:
        return eigen_precondition(grad, a, g, damping)

    def tensors(self, kept: Any) -> list[torch.Tensor]:
        return [t for t in (kept.Q, kept.d, kept.age, kept.drift) if t is not None]  # held too (kept_size counts them)

    def save(self, kept: Any) -> Any:
        saved = {"Q": kept.Q, "d": kept.d}
        if kept.age is not None:
            saved["age"] = int(kept.age.item())
        return saved

    def load(self, saved: Any, shape: FactorShape, device: torch.device) -> Eigen:
        parts = [saved["d"]] if saved.get("Q") is None else [saved["Q"].reshape(-1), saved["d"].reshape(-1)]
        if self._ages(shape):
            # A checkpoint of the exact refresh holds an eigh's basis, ascending: the next refresh is a full one.
            age = saved.get("age")
            age = float(self.warm.full_every if age is None else age)  # type: ignore[union-attr]
            parts.append(torch.tensor([age, -1.0], dtype=saved["d"].dtype))  # the residual is not saved: none measured
        buffer = torch.cat([p.reshape(-1) for p in parts]).detach().to(device)  # one fresh buffer, as the stage leaves it
        return self.received(buffer, shape)

    def refresh_record(self, kept: Any) -> tuple[int, float] | None:
        """``(age, residual)`` of a warm-refreshed decomposition (age 0: a full ``eigh``; residual -1: not measured);
        None for an exact or diagonal one."""
        if kept is None or kept.age is None or kept.drift is None:
            return None
        return int(kept.age.item()), float(kept.drift.item())

    def curve(self, perf: PerfModel) -> Callable[[float], float]:
        if self.warm is None:
            return perf.eigen_curve()
        return perf.warm_eigen_curve(self.warm.full_every)

    def cost(self, perf: PerfModel, shape: FactorShape) -> float:
        if self.warm is None or shape.diagonal or shape.blocks == 1:
            return super().cost(perf, shape)
        return BatchedModel.rule(self.curve(perf), shape.blocks, shape.dim)  # the batched fit measures eigh alone
