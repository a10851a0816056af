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
running average corrects it. It is updated on every step by whoever
preconditions the layer, so every rank must precondition every layer
(``distribute_preconditioning=True`` is refused), and a skipped step leaves
it unchanged (staged, then committed).
"""

from __future__ import annotations

from typing import Any

import torch

from ..decomposition import Eigen, eigen_outer, eigen_project, eigen_unproject
from .base import DecompositionMethod
from .eigen import EigenMethod, EigenRefresh

__all__ = ["EKFACMethod"]


class EKFACMethod(EigenMethod):
    name = "ekfac"
    label = "eigenbases"
    suffix = "_eigen"
    stateful = True

    def __init__(self, refresh: EigenRefresh = "exact", full_every: int = 10, decay: float = 0.95, tolerance: float | None = None) -> None:
        super().__init__(refresh, full_every, tolerance)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"ekfac_decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)

    @classmethod
    def from_options(cls, options: Any = None) -> DecompositionMethod:
        if options is None:
            return cls()
        return cls(options.eigen_refresh, options.eigen_full_every, options.ekfac_decay)

    def __repr__(self) -> str:
        refresh = "" if self.warm is None else f"refresh='warm', full_every={self.warm.full_every}, "
        return f"{type(self).__name__}({refresh}decay={self.decay:g})"

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: dict[str, Any] | None = None) -> torch.Tensor:
        """The update with this step's scaling (staged in ``state['pending']`` until :meth:`commit`)."""
        if state is None:
            raise ValueError("compute_method='ekfac' preconditions with the layer's scaling: pass its state")
        a_eig: Eigen = a
        g_eig: Eigen = g
        v = eigen_project(grad, a_eig, g_eig)
        scale = state.get("scale")
        if scale is None:
            scale = eigen_outer(a_eig, g_eig)
        samples = float(state.get("samples", 1))
        new = torch.mul(v, v).mul_((1.0 - self.decay) * samples).add_(scale.to(v.dtype), alpha=self.decay)
        state["pending"] = new
        v.div_(new + damping)
        return eigen_unproject(v, a_eig, g_eig)

    def commit(self, state: dict[str, Any]) -> None:
        pending = state.pop("pending", None)
        if pending is not None:
            state["scale"] = pending

    def save_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        return {"scale": state.get("scale"), "samples": int(state.get("samples", 1))}

    def load_state(self, saved: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
        if saved is None:
            return {}
        scale = saved.get("scale")
        return {"scale": None if scale is None else scale.detach().clone().to(device), "samples": int(saved.get("samples", 1))}
