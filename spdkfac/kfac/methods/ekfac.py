"""``compute_method='ekfac'`` (George et al. 2018): K-FAC's eigenbasis, its scaling re-estimated from every gradient.

The eigenbases ``Q_A``, ``Q_G`` are the eigen method's decompositions (the
same payload, placement and broadcast, refreshed at ``inv_update_freq``, and
warm-started with ``eigen_refresh='warm'``). K-FAC's scaling of the
projected gradient, ``d_G d_A^T``, is replaced by a per-coordinate running
average kept per layer,

    s <- β s + (1 - β) B (Q_G^T ∇W Q_A)²      (β = ``ekfac_decay``, elementwise)

started from ``d_G d_A^T`` (so the first steps are K-FAC's), and the update is
``Q_G [(Q_G^T ∇W Q_A) / (s + γ)] Q_A^T``.

The statistic is the **averaged batch gradient** ``∇W`` of the global batch of
``B`` samples, multiplied by ``B``: for a batch of independent samples
``B E[(Q^T ∇W Q)²]`` is the per-example second moment EKFAC defines, plus
``B`` times the squared mean, which is small where the noise dominates. The
per-example form would need each worker's per-sample gradients in the
eigenbasis (for a convolution, one ``g x a`` product per sample) and an
all-reduce of a gradient-sized buffer per layer per step; the batch form
needs no communication at all (every rank holds the averaged gradient) and
no work in the hooks, at the price of that bias (SOAP's second moment is
the same batch estimate). ``B`` is the global batch: the local batch seen
by the factor hooks times the workers (and accumulation steps).

The scaling is kept across a basis refresh (as SOAP keeps its second
moment): in a basis that moved little it is still nearly right, and the
running average corrects it. It is updated on every step where the layer
is preconditioned, and kept there only (with ``grad_worker_fraction`` below
1: the layer's gradient workers; a checkpoint gathers it with
``consolidate_state_dict()``), and a skipped step leaves it unchanged
(staged, then committed).

``ekfac_update='adam'`` runs Adam in the same eigenbasis instead (SOAP's
update, Vyas et al. 2024, with K-FAC's basis in place of Shampoo's): the
first moment ``m`` of the averaged gradient is kept in the layer's own
coordinates, the second moment ``v`` of the projected gradient in the
eigenbasis (from zero, not from K-FAC's eigenvalues, and without ``B``:
Adam's second moment of the batch gradient), both bias-corrected, and

    m <- β1 m + (1 - β1) ∇W,   v <- β2 v + (1 - β2) (Q_G^T ∇W Q_A)²
    update = Q_G [(Q_G^T m̂ Q_A) / (√v̂ + ε)] Q_A^T

with ``β2 = ekfac_decay`` (the decay of the scaling, as in the natural
update; its default 0.95 is SOAP's), ``β1`` and ``ε`` the AdamW base's
``betas[0]`` and ``eps`` (``param_groups[0]``, read every step), so it needs
``base='adamw'``, which then takes this update as the step's direction: ``w
<- w - lr·update - lr·wd·w`` (decoupled decay), its other parameters getting
AdamW as usual (with ``betas[1]``). ``damping`` is not used by this update.
``v`` is kept across a basis refresh (as SOAP keeps it) and ``m``, in the
layer's coordinates, needs no change.

The two updates are strategies chosen once at construction, each with its
own typed per-layer state (:mod:`spdkfac.kfac.methods.ekfac_updates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..eigenbasis import Eigen
from .base import DecompositionMethod, MethodState
from .eigen import EigenMethod, EigenRefresh
from .ekfac_updates import UPDATES, EKFACUpdate

__all__ = ["EKFACMethod", "EKFACOptions", "EKFACUpdate"]


@dataclass(frozen=True)
class EKFACOptions:
    """EKFAC's own options as one value: ``ekfac_decay`` (β) and ``ekfac_update`` (validated)."""

    decay: float = 0.95
    update: EKFACUpdate = EKFACUpdate.NATURAL

    def __post_init__(self) -> None:
        decay = self.decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"ekfac_decay must be in [0, 1), got {decay!r}")
        object.__setattr__(self, "decay", float(decay))
        object.__setattr__(self, "update", EKFACUpdate.parse("ekfac_update", self.update))


class EKFACMethod(EigenMethod):
    name = "ekfac"
    label = "eigenbases"
    suffix = "_eigen"
    stateful = True

    def __init__(
        self,
        refresh: EigenRefresh | str = EigenRefresh.EXACT,
        full_every: int = 10,
        decay: float = 0.95,
        tolerance: float | None = None,
        update: EKFACUpdate | str = EKFACUpdate.NATURAL,
    ) -> None:
        super().__init__(refresh, full_every, tolerance)
        options = EKFACOptions(decay, update)  # type: ignore[arg-type]  # a string is parsed
        self.decay = options.decay
        self.update = options.update
        self.rule = UPDATES[options.update](options.decay)  # the update's strategy, chosen once

    @classmethod
    def from_options(cls, options: Any = None) -> DecompositionMethod:
        if options is None:
            return cls()
        eigen, ekfac = options.eigen, options.ekfac
        return cls(eigen.refresh, eigen.full_every, ekfac.decay, update=ekfac.update)

    def __repr__(self) -> str:
        refresh = "" if self.warm is None else f"refresh='warm', full_every={self.warm.full_every}, "
        update = "" if self.update is EKFACUpdate.NATURAL else f", update={self.update!r}"
        return f"{type(self).__name__}({refresh}decay={self.decay:g}{update})"

    @property
    def gives_direction(self) -> bool:
        """Whether the update is the step's whole direction (Adam's), which the base must not normalise again."""
        return self.rule.gives_direction

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: MethodState | None = None) -> torch.Tensor:
        """The update with this step's scaling (staged in ``state.pending`` until :meth:`commit`)."""
        if state is None:
            raise ValueError("compute_method='ekfac' preconditions with the layer's scaling: pass its state")
        a_eig: Eigen = a
        g_eig: Eigen = g
        return self.rule.direction(grad, a_eig, g_eig, damping, state)

    def new_state(self) -> MethodState:
        return self.rule.new_state()

    def begin_step(self, state: MethodState, samples: int | None, group: dict[str, Any]) -> None:
        self.rule.begin_step(state, samples, group)

    def commit(self, state: MethodState) -> None:
        self.rule.commit(state)

    def save_state(self, state: MethodState) -> dict[str, Any] | None:
        return self.rule.save(state)

    def load_state(self, saved: dict[str, Any] | None, device: torch.device) -> MethodState:
        return self.new_state() if saved is None else self.rule.load(saved, device)
