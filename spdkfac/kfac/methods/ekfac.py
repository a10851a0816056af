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
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

from ..eigenbasis import Eigen, eigen_outer, eigen_project, eigen_unproject
from .base import DecompositionMethod
from .eigen import EigenMethod, EigenRefresh

__all__ = ["EKFAC_UPDATES", "EKFACMethod", "EKFACUpdate"]

EKFACUpdate = Literal["natural", "adam"]
EKFAC_UPDATES: tuple[str, ...] = get_args(EKFACUpdate)


class EKFACMethod(EigenMethod):
    name = "ekfac"
    label = "eigenbases"
    suffix = "_eigen"
    stateful = True

    def __init__(
        self,
        refresh: EigenRefresh = "exact",
        full_every: int = 10,
        decay: float = 0.95,
        tolerance: float | None = None,
        update: EKFACUpdate = "natural",
    ) -> None:
        super().__init__(refresh, full_every, tolerance)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"ekfac_decay must be in [0, 1), got {decay!r}")
        if update not in EKFAC_UPDATES:
            raise ValueError(f"ekfac_update must be one of {EKFAC_UPDATES}, got {update!r}")
        self.decay = float(decay)
        self.update = update

    @classmethod
    def from_options(cls, options: Any = None) -> DecompositionMethod:
        if options is None:
            return cls()
        return cls(options.eigen_refresh, options.eigen_full_every, options.ekfac_decay, update=options.ekfac_update)

    def __repr__(self) -> str:
        refresh = "" if self.warm is None else f"refresh='warm', full_every={self.warm.full_every}, "
        if self.update == "adam":
            return f"{type(self).__name__}({refresh}decay={self.decay:g}, update='adam')"
        return f"{type(self).__name__}({refresh}decay={self.decay:g})"

    @property
    def gives_direction(self) -> bool:
        """Whether the update is the step's whole direction (Adam's), which the base must not normalise again."""
        return self.update == "adam"

    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: dict[str, Any] | None = None) -> torch.Tensor:
        """The update with this step's scaling (staged in ``state['pending']`` until :meth:`commit`)."""
        if state is None:
            raise ValueError("compute_method='ekfac' preconditions with the layer's scaling: pass its state")
        a_eig: Eigen = a
        g_eig: Eigen = g
        if self.update == "adam":
            return self._adam(grad, a_eig, g_eig, state)
        v = eigen_project(grad, a_eig, g_eig)
        scale = state.get("scale")
        if scale is None:
            scale = eigen_outer(a_eig, g_eig)
        samples = float(state.get("samples", 1))
        new = torch.mul(v, v).mul_((1.0 - self.decay) * samples).add_(scale.to(v.dtype), alpha=self.decay)
        state["pending"] = new
        v.div_(new + damping)
        return eigen_unproject(v, a_eig, g_eig)

    def _adam(self, grad: torch.Tensor, a: Eigen, g: Eigen, state: dict[str, Any]) -> torch.Tensor:
        """Adam's direction in the eigenbasis (the moments staged in ``state['pending']``)."""
        if "betas" not in state:
            raise ValueError("ekfac_update='adam' takes Adam's betas and eps from the optimizer: it needs base='adamw'")
        beta1, beta2 = state["betas"][0], self.decay
        eps = float(state["eps"])
        step = int(state.get("step", 0)) + 1
        exp_avg = state.get("exp_avg")
        exp_avg = grad.mul(1.0 - beta1) if exp_avg is None else exp_avg.to(grad.dtype).mul(beta1).add_(grad, alpha=1.0 - beta1)
        projected = eigen_project(grad, a, g)
        exp_avg_sq = state.get("exp_avg_sq")
        square = torch.mul(projected, projected).mul_(1.0 - beta2)
        exp_avg_sq = square if exp_avg_sq is None else square.add_(exp_avg_sq.to(square.dtype), alpha=beta2)
        state["pending"] = (exp_avg, exp_avg_sq, step)
        denom = exp_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps)
        direction = eigen_project(exp_avg, a, g).div_(1.0 - beta1**step).div_(denom)
        return eigen_unproject(direction, a, g)

    def commit(self, state: dict[str, Any]) -> None:
        pending = state.pop("pending", None)
        if pending is None:
            return
        if self.update == "adam":
            state["exp_avg"], state["exp_avg_sq"], state["step"] = pending
        else:
            state["scale"] = pending

    def save_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        if self.update == "adam":
            return {"exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq"), "step": int(state.get("step", 0))}
        return {"scale": state.get("scale"), "samples": int(state.get("samples", 1))}

    def load_state(self, saved: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
        if saved is None:
            return {}
        if self.update == "adam":
            if "exp_avg_sq" not in saved:
                raise ValueError("this checkpoint's EKFAC state is the natural update's; resume with ekfac_update='natural'")
            out: dict[str, Any] = {"step": int(saved.get("step", 0))}
            for key in ("exp_avg", "exp_avg_sq"):
                t = saved.get(key)
                out[key] = None if t is None else t.detach().clone().to(device)
            return out
        if "scale" not in saved:
            raise ValueError("this checkpoint's EKFAC state is Adam's; resume with ekfac_update='adam'")
        scale = saved.get("scale")
        return {"scale": None if scale is None else scale.detach().clone().to(device), "samples": int(saved.get("samples", 1))}
