"""EKFAC's two updates in its eigenbasis (``ekfac_update``), one strategy each, with the per-layer state each keeps.

:class:`~spdkfac.kfac.methods.ekfac.EKFACMethod` chooses one at construction
(:data:`UPDATES`) and hands it every per-layer question; nothing else asks
which it is. ``'natural'`` (George et al.) divides the projected gradient by
a damped running scaling (:class:`NaturalUpdate`, state
:class:`ScalingState`); ``'adam'`` (SOAP's update with K-FAC's basis) runs
Adam's moments there (:class:`AdamUpdate`, state :class:`AdamState`). The
formulas are in :mod:`spdkfac.kfac.methods.ekfac`'s docstring.

Both stage what a step learns (``pending``) and make it current only in
:meth:`EKFACUpdateRule.commit`, so a skipped step changes nothing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...options import Option
from ..eigenbasis import Eigen, eigen_outer, eigen_project, eigen_unproject
from .base import MethodState

__all__ = ["UPDATES", "AdamState", "AdamUpdate", "EKFACUpdate", "EKFACUpdateRule", "NaturalUpdate", "ScalingState"]


class EKFACUpdate(Option):
    """What ``compute_method='ekfac'`` does in its eigenbasis (``ekfac_update``)."""

    NATURAL = "natural"  # divide by the damped running scaling (George et al.)
    ADAM = "adam"  # Adam's moments in the eigenbasis (SOAP's update); needs base='adamw'


def _restored(saved: dict[str, Any], key: str, device: torch.device) -> torch.Tensor | None:
    t = saved.get(key)
    return None if t is None else t.detach().clone().to(device)


@dataclass
class ScalingState(MethodState):
    """The natural update's layer state: the running scaling ``s`` and the global batch ``B`` it is scaled by."""

    scale: torch.Tensor | None = None  # None until the first step: K-FAC's d_G d_A^T is used
    samples: int = 1
    pending: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.scale, self.pending) if t is not None]


@dataclass
class AdamState(MethodState):
    """The Adam update's layer state: the moments, their step count, and the base's ``betas``/``eps`` in force."""

    exp_avg: torch.Tensor | None = None  # in the layer's coordinates
    exp_avg_sq: torch.Tensor | None = None  # in the eigenbasis
    step: int = 0
    betas: tuple[float, float] | None = None
    eps: float | None = None
    pending: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.exp_avg, self.exp_avg_sq) if t is not None]


class EKFACUpdateRule(abc.ABC):
    """One update in the eigenbasis, with β = ``ekfac_decay`` (the scaling's decay, or Adam's ``β2``)."""

    update: ClassVar[EKFACUpdate]
    #: Whether the update is the step's whole direction (Adam's), which the base must not normalise again.
    gives_direction: ClassVar[bool] = False

    def __init__(self, decay: float) -> None:
        self.decay = decay

    @abc.abstractmethod
    def new_state(self) -> MethodState:
        """A layer's fresh state."""

    @abc.abstractmethod
    def begin_step(self, state: Any, samples: int | None, group: dict[str, Any]) -> None:
        """Take what the step knows before preconditioning (:meth:`DecompositionMethod.begin_step`)."""

    @abc.abstractmethod
    def direction(self, grad: torch.Tensor, a: Eigen, g: Eigen, damping: float, state: Any) -> torch.Tensor:
        """The update of ``grad``, what it learned staged in ``state.pending``."""

    @abc.abstractmethod
    def commit(self, state: Any) -> None:
        """Make the staged state current."""

    @abc.abstractmethod
    def save(self, state: Any) -> dict[str, Any]:
        """Plain values of a layer's state (the checkpoint's ``method_state``)."""

    @abc.abstractmethod
    def load(self, saved: dict[str, Any], device: torch.device) -> MethodState:
        """A layer's state from :meth:`save`'s dict; a ValueError naming the other update if it wrote it."""


class NaturalUpdate(EKFACUpdateRule):
    """``Q_G [(Q_G^T ∇W Q_A) / (s + γ)] Q_A^T``, ``s <- β s + (1 - β) B (Q_G^T ∇W Q_A)²`` from ``d_G d_A^T``."""

    update = EKFACUpdate.NATURAL

    def new_state(self) -> ScalingState:
        return ScalingState()

    def begin_step(self, state: ScalingState, samples: int | None, group: dict[str, Any]) -> None:
        if samples is not None:
            state.samples = samples

    def direction(self, grad: torch.Tensor, a: Eigen, g: Eigen, damping: float, state: ScalingState) -> torch.Tensor:
        v = eigen_project(grad, a, g)
        scale = state.scale
        if scale is None:
            scale = eigen_outer(a, g)
        new = torch.mul(v, v).mul_((1.0 - self.decay) * float(state.samples)).add_(scale.to(v.dtype), alpha=self.decay)
        state.pending = new
        v.div_(new + damping)
        return eigen_unproject(v, a, g)

    def commit(self, state: ScalingState) -> None:
        if state.pending is not None:
            state.scale, state.pending = state.pending, None

    def save(self, state: ScalingState) -> dict[str, Any]:
        return {"scale": state.scale, "samples": int(state.samples)}

    def load(self, saved: dict[str, Any], device: torch.device) -> ScalingState:
        if "scale" not in saved:
            raise ValueError("this checkpoint's EKFAC state is Adam's; resume with ekfac_update='adam'")
        return ScalingState(scale=_restored(saved, "scale", device), samples=int(saved.get("samples", 1)))


class AdamUpdate(EKFACUpdateRule):
    """Adam in the eigenbasis: ``m`` of ``∇W``, ``v`` of ``(Q_G^T ∇W Q_A)²`` (``β2 = β``), bias-corrected,
    ``Q_G [(Q_G^T m̂ Q_A) / (√v̂ + ε)] Q_A^T``; ``β1`` and ``ε`` the AdamW base's."""

    update = EKFACUpdate.ADAM
    gives_direction = True

    def new_state(self) -> AdamState:
        return AdamState()

    def begin_step(self, state: AdamState, samples: int | None, group: dict[str, Any]) -> None:
        if "betas" in group:  # the AdamW base's hyperparameters in force (read every step: they may be scheduled)
            state.betas, state.eps = group["betas"], group["eps"]

    def direction(self, grad: torch.Tensor, a: Eigen, g: Eigen, damping: float, state: AdamState) -> torch.Tensor:
        if state.betas is None or state.eps is None:
            raise ValueError("ekfac_update='adam' takes Adam's betas and eps from the optimizer: it needs base='adamw'")
        beta1, beta2 = state.betas[0], self.decay
        eps = float(state.eps)
        step = int(state.step) + 1
        exp_avg = state.exp_avg
        exp_avg = grad.mul(1.0 - beta1) if exp_avg is None else exp_avg.to(grad.dtype).mul(beta1).add_(grad, alpha=1.0 - beta1)
        projected = eigen_project(grad, a, g)
        square = torch.mul(projected, projected).mul_(1.0 - beta2)
        exp_avg_sq = square if state.exp_avg_sq is None else square.add_(state.exp_avg_sq.to(square.dtype), alpha=beta2)
        state.pending = (exp_avg, exp_avg_sq, step)
        denom = exp_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps)
        direction = eigen_project(exp_avg, a, g).div_(1.0 - beta1**step).div_(denom)
        return eigen_unproject(direction, a, g)

    def commit(self, state: AdamState) -> None:
        if state.pending is not None:
            (state.exp_avg, state.exp_avg_sq, state.step), state.pending = state.pending, None

    def save(self, state: AdamState) -> dict[str, Any]:
        return {"exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq, "step": int(state.step)}

    def load(self, saved: dict[str, Any], device: torch.device) -> AdamState:
        if "exp_avg_sq" not in saved:
            raise ValueError("this checkpoint's EKFAC state is the natural update's; resume with ekfac_update='natural'")
        return AdamState(
            exp_avg=_restored(saved, "exp_avg", device), exp_avg_sq=_restored(saved, "exp_avg_sq", device), step=int(saved.get("step", 0))
        )


#: ``ekfac_update`` -> its strategy (one line per update).
UPDATES: dict[EKFACUpdate, type[EKFACUpdateRule]] = {rule.update: rule for rule in (NaturalUpdate, AdamUpdate)}
