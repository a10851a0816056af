"""SOAP and Muon from HeavyBall (an optional dependency), on gradients averaged over the workers as every optimizer here.

    pip install --no-deps heavyball      # >= 3.2; needs numpy (and torch), both already there

Each worker runs the library's optimizer on the same averaged gradients (the
gradient all-reduce of :class:`spdkfac.step.grad_sync.GradientSync`, which
:class:`~spdkfac.update.adamw.DistributedAdamW` uses too), so the replicas stay
identical. HeavyBall compiles its steps with ``torch.compile`` by default;
here it runs eagerly (the other optimizers are not compiled either, and a
CPU compile needs a C++ tool chain).

* ``soap``: ``heavyball.SOAP`` with its defaults (betas (0.9, 0.95),
  preconditioner refreshed every 2 steps) and the benchmark's decoupled
  weight decay.
* ``muon``: Muon (``heavyball.Muon``: Nesterov momentum, Newton-Schulz
  orthogonalisation) on the hidden 2-D+ weights (convolution filters
  flattened), ``heavyball.AdamW`` on everything else (biases, norms, and the
  output layer), as Muon's authors prescribe; the AdamW part's base LR is the
  spec's ``adamw_lr`` (default 1e-3 per worker, scaled and scheduled like the
  Muon LR, which is the one the grid searches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from spdkfac.comm import CommBackend
from spdkfac.step.grad_sync import GradientSync, collective_names

__all__ = ["EXTERNAL_OPTIMIZERS", "ExternalOptimizer", "external_options", "make_external", "require_heavyball"]

#: name -> the options a spec may change (with their defaults)
EXTERNAL_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "soap": {"precondition_frequency": 2, "shampoo_beta": 0.95},
    "muon": {"adamw_lr": 1e-3},
}

INSTALL = "pip install --no-deps heavyball   (HeavyBall >= 3.2: SOAP and Muon; numpy and torch are its only run-time needs)"


def require_heavyball() -> Any:
    """The heavyball module, set to run eagerly; a clear SystemExit saying how to install it when it is missing."""
    try:
        import heavyball
        import heavyball.utils
    except ImportError:
        raise SystemExit(f"error: the soap and muon optimizers need HeavyBall, an optional benchmark dependency:\n    {INSTALL}") from None
    heavyball.utils.compile_mode = None  # eager: no torch.compile (see the module docstring)
    return heavyball


def external_options(name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """The options of ``name`` with a spec's changes (ValueError naming an unknown one)."""
    options = dict(EXTERNAL_OPTIMIZERS[name])
    unknown = sorted(set(changes) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name}; its options are {sorted(options)}")
    options.update(changes)
    return options


def output_layer(model: nn.Module) -> nn.Module | None:
    """The model's last ``nn.Linear`` (the classifier head), or None."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


class ExternalOptimizer:
    """A HeavyBall optimizer stepping on the averaged gradients; ``param_groups`` are the library's own (for the LR schedule)."""

    def __init__(self, inner: Any, model: nn.Module, backend: CommBackend, param_groups: list[dict[str, Any]]) -> None:
        self.inner = inner
        self.param_groups = param_groups
        self.grads = GradientSync(backend, param_groups, collective_names(model, param_groups), 1, None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Average the gradients over the workers, then the library's step (identical on every worker)."""
        self.grads.synchronize()
        self.inner.step()
        self.grads.reset(None)

    def zero_grad(self) -> None:
        self.grads.reset(None)
        self.inner.zero_grad(set_to_none=True)

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()


def make_external(
    name: str, model: nn.Module, lr: float, weight_decay: float, backend: CommBackend, workers: int, **changes: Any
) -> ExternalOptimizer:
    """``soap`` or ``muon`` for ``model`` at peak LR ``lr`` (already scaled by ``workers``), decoupled ``weight_decay``."""
    hb = require_heavyball()
    options = external_options(name, changes)
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "soap":
        inner = hb.SOAP(params, lr=lr, weight_decay=weight_decay, **options)
        return ExternalOptimizer(inner, model, backend, inner.param_groups)
    head = output_layer(model)
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    hidden = [p for p in params if p.ndim >= 2 and id(p) not in head_params]
    rest = [p for p in params if p.ndim < 2 or id(p) in head_params]
    inner = hb.SplitOpt(
        [
            {"params": hidden, "optimizer": hb.Muon, "lr": lr, "weight_decay": weight_decay},
            {"params": rest, "optimizer": hb.AdamW, "lr": options["adamw_lr"] * workers, "weight_decay": weight_decay},
        ]
    )
    return ExternalOptimizer(inner, model, backend, [g for opt in inner.optimizers for g in opt.param_groups])
