"""The DHO2 optimizer: FOSI's hybrid-order step with a distributed Lanczos and the ADMM-like outer iteration."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..comm import CommBackend, get_backend
from ..step.grad_sync import GradientSync, collective_names
from ..step.nonfinite import NonFiniteError, NonFiniteGuard, SkipStep
from ..update.base_update import BaseOptimizer
from ..update.rules import adamw_delta, momentum_direction
from .config import ADMMRule, DHO2Config
from .hvp import HessianVectorProduct, flatten
from .lanczos import RowSplit, distributed_lanczos, extreme_eigenpairs, lanczos_memory, start_vector
from .update import ADMMState, EigenBasis, hybrid_delta

__all__ = ["DHO2Optimizer"]

Closure = Callable[[], torch.Tensor]


class DHO2Optimizer(torch.optim.Optimizer):
    """DHO2 (Gu et al.): FOSI's hybrid first/second-order step, distributed, with an ADMM-like outer loop.

    Every step splits the averaged gradient ``g`` between two orthogonal
    subspaces: the span ``V`` of the Hessian's ``k`` largest and ``l``
    smallest eigenvectors, where it takes an α-scaled Newton step, and the
    complement, where the base optimizer (AdamW, or momentum SGD) works and
    its output is projected back onto the complement (FOSI, Eqs. 3-4). Every
    ``refresh_every`` steps the eigenpairs are recomputed by the Lanczos
    iteration on Hessian-vector products of the current batch's loss, its
    n × m basis split by rows across the workers (Algorithm 2). With
    ``admm=True`` (``'dho2'``) the steps run on the augmented Lagrangian of
    ``min f(w_a) s.t. w_a = w``: the gradient is shifted by the multiplier
    π (and, with ``admm_rule`` ``'lagrangian'`` or ``'proximal'``, by
    σ(w_a − w)), the Newton step uses ``(A + σI)⁻¹``, and every
    ``admm_period`` steps the multiplier is updated and (except
    ``'proximal'``) the parameters move to ``w_a + π/σ`` (Algorithm 3);
    ``admm=False`` (``'dho2-wa'``) is plain distributed FOSI.

    **Loop.** As with any optimizer, with one addition: pass a closure that
    returns the loss of this worker's current batch, computed with
    gradients enabled, *without* calling ``backward()``. It is called only
    on steps that refresh the eigenpairs (``refresh_due``), once, and the
    Hessian is taken from its graph::

        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step(lambda: loss_fn(model(x), y))

    Every worker must pass its closure on the same steps (a refresh is a
    sequence of collectives). ``step()`` returns the closure's loss when it
    was called, else None.

    **Eigenvalue rule.** Pairs with ``|a| <= eigenvalue_floor`` are dropped
    at each refresh (their directions go to the base optimizer); the others
    scale the Newton step by ``α/(|a| + σ)`` (σ = 0 without ADMM): negative
    curvature is followed downhill with the magnitude of its eigenvalue.

    Args:
        model: the model (all its parameters that require gradients, one group).
        lr: the base optimizer's learning rate (AdamW: 1e-3, the paper's).
        base: ``'adamw'`` (the paper's) or ``'sgd'`` (momentum SGD).
        betas, eps: AdamW's.
        weight_decay: AdamW's decoupled decay (0.05, the paper's), or SGD's L2 term.
        momentum: SGD's momentum (``base='sgd'`` only).
        k, l: the largest / smallest eigenpairs of the Newton subspace (FOSI's 5 and 0).
        refresh_every: T, steps between eigenpair refreshes (the DHO2 paper's I; FOSI's default 100).
        lanczos_steps: m; default ``max(4(k+l), 2 ln n)`` (FOSI's, at most n).
        alpha: the Newton step's scale α (FOSI's 0.1 for an Adam base). A learning-rate schedule scales it too:
            the step uses ``α · lr_now / lr``, so warm-up and decay apply to the whole update (without a
            schedule, α as in the paper). Without this, the Newton step would stay at full size while the
            base step decays, and as training converges the curvature (its divisor) shrinks.
        admm: the ADMM-like outer iteration (Algorithm 3); False gives DHO2-WA.
        admm_rule: its form (:class:`~spdkfac.dho2.update.ADMMState`): ``'code'`` (the authors' code, also
            Algorithm 3 as printed), ``'lagrangian'`` (the inner loop on Eq. 11's subproblem, the parameters
            moved to ``w = w_a + π/σ``) or ``'proximal'`` (the same, the parameters left at ``w_a``); default
            :data:`~spdkfac.dho2.config.DEFAULT_ADMM_RULE`, the best measured (docs/dho2.md). ``admm=True`` only.
        sigma: σ, the augmented Lagrangian's penalty; default by rule
            (:data:`~spdkfac.dho2.config.DEFAULT_SIGMA`: the authors' code's 5e-9 for ``'code'``). ``admm=True`` only.
        admm_period: steps per outer iteration (the paper: P = 4 epochs; the training job passes 4 epochs of steps).
        eigenvalue_floor: eigenpairs with ``|a|`` at most this are dropped (see above).
        seed: seeds the Lanczos start vectors (the same on every worker).
        backend: ``'auto'``, ``'horovod'``, ``'torch'``, ``'single'`` or a ``CommBackend``.
        accumulation_steps: backward passes per step (as :class:`~spdkfac.SPDKFACOptimizer`).
        skip_nonfinite: consecutive steps meeting NaN/Inf skipped (with a warning, on every worker alike) before ``NonFiniteError``.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        *,
        base: BaseOptimizer | str = BaseOptimizer.ADAMW,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.05,
        momentum: float | None = None,
        k: int = 5,
        l: int = 0,  # noqa: E741 the paper's name
        refresh_every: int = 100,
        lanczos_steps: int | None = None,
        alpha: float = 0.1,
        admm: bool = True,
        admm_rule: ADMMRule | None = None,
        sigma: float | None = None,
        admm_period: int = 400,
        eigenvalue_floor: float = 1e-6,
        seed: int = 0,
        backend: str | CommBackend = "auto",
        accumulation_steps: int = 1,
        skip_nonfinite: int = 0,
        grad_scaler: Any | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"DHO2Optimizer takes the model (an nn.Module), got {type(model).__name__}")
        if momentum is not None and base != BaseOptimizer.SGD:
            raise ValueError(f"momentum applies to base='sgd' only; the {base!r} base uses betas")
        if grad_scaler is not None:
            raise ValueError("DHO2Optimizer does not support a GradScaler (float16 loss scaling); use bfloat16 autocast or float32")
        self.config = DHO2Config(
            lr=lr,
            base=base,
            betas=tuple(betas),  # type: ignore[arg-type]
            eps=eps,
            weight_decay=weight_decay,
            momentum=0.9 if momentum is None else momentum,
            k=k,
            l=l,
            refresh_every=refresh_every,
            lanczos_steps=lanczos_steps,
            alpha=alpha,
            admm=admm,
            admm_rule=admm_rule,
            sigma=sigma,
            admm_period=admm_period,
            eigenvalue_floor=eigenvalue_floor,
            seed=seed,
            accumulation_steps=accumulation_steps,
            skip_nonfinite=skip_nonfinite,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameter that requires a gradient")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(
                f"DHO2 keeps the parameters as one vector: they must share one dtype and device, got {sorted(map(str, kinds))}"
            )
        super().__init__(params, dict(lr=lr))
        self.backend = get_backend(backend)
        self.params = params
        self._frozen = [p for p in model.parameters() if not p.requires_grad]  # (refused once unfrozen: see step())
        self.n = sum(p.numel() for p in params)
        self.lanczos_steps = self.config.steps_for(self.n)
        self.split = RowSplit(self.n, self.backend.size)
        self.grads = GradientSync(self.backend, self.param_groups, collective_names(model, self.param_groups), accumulation_steps, None)
        self.nonfinite = NonFiniteGuard(self.config.skip_nonfinite)
        self.steps = 0
        self.refreshes = 0
        self.basis: EigenBasis | None = None
        self.base_state: dict[str, Any] = {}
        self.admm = ADMMState(self._flat_params(), self.config.shift, str(self.config.admm_rule)) if self.config.admm else None
        self._lanczos_bytes = 0
        #: seconds of the last step: ``{'refresh': HVPs + Lanczos + eigenpairs, 'update': the rest}`` (gradient averaging excluded)
        self.last_step_times: dict[str, float] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction (ValueError): DHO2 keeps the model's parameters as one vector, whose
        curvature, split across the workers and ADMM state are sized when it is built."""
        if "grads" not in self.__dict__:  # (torch.optim's construction adds the first group)
            super().add_param_group(param_group)
            return
        raise ValueError(
            "DHO2 keeps the model's parameters as one vector sized when the optimizer is built: make the group's "
            "module part of the model (or unfreeze its parameters) before the optimizer is built"
        )

    # ----------------------------------------------------------------- vectors
    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write_params(self, flat: torch.Tensor) -> None:
        for p, piece in zip(self.params, torch.split(flat, [p.numel() for p in self.params])):
            p.copy_(piece.view_as(p))

    @property
    def needs_loss_closure(self) -> bool:
        """Always True: :meth:`step` evaluates the loss itself (the Hessian-vector products of its eigenpair
        refreshes differentiate the closure's loss), so a training loop passes ``step(closure)`` on every step;
        it is called on the refresh steps only (:attr:`refresh_due`)."""
        return True

    @property
    def refresh_due(self) -> bool:
        """True when the next ``step()`` recomputes the eigenpairs (and so calls its closure)."""
        return self.steps % self.config.refresh_every == 0

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """Average the gradients, refresh the eigenpairs when due (calling ``closure``), and update the parameters."""
        self.grads.check_accumulated("step()")
        if any(p.requires_grad for p in self._frozen):
            raise ValueError(
                f"{sum(p.requires_grad for p in self._frozen)} parameter(s) of the model were frozen when DHO2 was built and "
                "are trainable now: DHO2 keeps the parameters as one vector sized when it is built, so they would never "
                "be updated; build the optimizer after unfreezing (or use SPDKFACOptimizer, which takes them in)"
            )
        refresh = self.refresh_due
        if refresh and closure is None:
            raise ValueError(
                f"step {self.steps} refreshes the Hessian eigenpairs (every {self.config.refresh_every} steps): pass "
                "step(closure) with a closure returning this worker's batch loss (no backward()), on every worker"
            )
        loss = None
        self.last_step_times = {}
        try:
            self.grads.synchronize()
            grad = flatten([p.grad for p in self.params], self.params)
            if not bool(torch.isfinite(grad).all()):
                self.nonfinite.bad_step(NonFiniteError(f"non-finite averaged gradient at step {self.steps}; no parameter was changed"))
            t0 = time.perf_counter()
            basis = self.basis
            if refresh:
                assert closure is not None
                loss, basis = self._refresh(closure)
            t1 = time.perf_counter()
            assert basis is not None  # step 0 refreshes
            w = self._flat_params()
            g = self.admm.gradient(grad, w) if self.admm is not None else grad
            shift = self.config.shift
            alpha = self.config.alpha * float(self.param_groups[0]["lr"]) / self.config.lr  # follows the LR schedule
            delta = hybrid_delta(g, basis, alpha, shift, self._base_update(w))
            if not bool(torch.isfinite(delta).all()):  # identical on every worker (the base state has advanced)
                self.nonfinite.bad_step(NonFiniteError(f"non-finite update at step {self.steps}; no parameter was changed"))
            w += delta
            self.steps += 1
            if refresh:
                self.basis, self.refreshes = basis, self.refreshes + 1
            if self.admm is not None and self.steps % self.config.admm_period == 0:
                w = self.admm.end_period(w)
            self._write_params(w)
            self.nonfinite.good_step()
            self.last_step_times = {"refresh": t1 - t0, "update": time.perf_counter() - t1}
        except SkipStep:
            pass
        finally:
            self.grads.reset(None)
        return loss

    def _base_update(self, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The base optimizer as a map from a flat gradient to the change of the parameters (state kept in ``base_state``)."""
        cfg, lr = self.config, float(self.param_groups[0]["lr"])
        if cfg.base == BaseOptimizer.ADAMW:
            return lambda x: adamw_delta(x, w, self.base_state, lr, cfg.betas, cfg.eps, cfg.weight_decay)
        return lambda x: momentum_direction(x, w, self.base_state, cfg.momentum, cfg.weight_decay) * -lr

    def _refresh(self, closure: Closure) -> tuple[torch.Tensor, EigenBasis]:
        """New eigenpairs at the current parameters from the closure's loss (every worker: the same collectives, the same result)."""
        before = [p.grad._version if p.grad is not None else None for p in self.params]
        with torch.enable_grad():
            loss = closure()
        if [p.grad._version if p.grad is not None else None for p in self.params] != before:
            raise RuntimeError("the closure changed the gradients: it must return the loss without calling backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the closure must return the loss tensor (with its graph), got {type(loss).__name__}")
        hvp = HessianVectorProduct(loss, self.params, self.backend)
        v1 = start_vector(self.n, self.config.seed * 1_000_003 + self.refreshes, self.params[0].dtype, self.params[0].device)
        result = distributed_lanczos(hvp, self.split, self.backend, self.lanczos_steps, v1)
        self._lanczos_bytes = result.basis_bytes
        if not bool(torch.isfinite(result.tridiagonal).all()):  # identical on every worker: all skip alike
            self.nonfinite.bad_step(NonFiniteError(f"non-finite Hessian-vector products at step {self.steps}; no parameter was changed"))
        values, vectors = extreme_eigenpairs(result, self.split, self.backend, self.config.k, self.config.l)
        return loss.detach(), EigenBasis(values, vectors).keep_curvature(self.config.eigenvalue_floor)

    # ---------------------------------------------------------- between steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; raises while gradient all-reduces are pending (no ``step()`` yet)."""
        if self.grads.pending and not self.grads.synchronized:
            raise RuntimeError("zero_grad() called while gradient all-reduces are pending; call step() first")
        self.grads.reset(None)
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait until every gradient holds its average (``step()`` does it)."""
        self.grads.synchronize()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The torch.optim state plus DHO2's: step and refresh counters, base optimizer, eigenpairs, ADMM; resumes bit for bit."""
        sd = super().state_dict()
        sd["dho2"] = {
            "n": self.n,
            "steps": self.steps,
            "refreshes": self.refreshes,
            "base_state": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.base_state.items()},
            "basis": None if self.basis is None else {"values": self.basis.values.clone(), "vectors": self.basis.vectors.clone()},
            "admm": None if self.admm is None else {"multiplier": self.admm.multiplier.clone(), "anchor": self.admm.anchor.clone()},
            "nonfinite": (self.nonfinite.consecutive, self.nonfinite.skipped_total),
            "config": self.config.as_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint of :meth:`state_dict` made for the same model and the same ``admm`` setting."""
        dho2 = state_dict.get("dho2")
        if dho2 is None:
            raise ValueError("not a DHO2Optimizer checkpoint (no 'dho2' entry)")
        if dho2["n"] != self.n:
            raise ValueError(f"checkpoint is for a model of {dho2['n']} parameters, this one has {self.n}")
        if (dho2["admm"] is None) != (self.admm is None):
            raise ValueError(f"checkpoint made with admm={dho2['admm'] is not None}, this optimizer has admm={self.admm is not None}")
        if self.admm is not None:  # checkpoints from before admm_rule ran the 'code' rule
            saved = (dho2["config"].get("admm_rule") or "code", dho2["config"]["sigma"])
            if saved != (self.config.admm_rule, self.config.sigma):
                raise ValueError(
                    f"checkpoint made with admm_rule={saved[0]!r}, sigma={saved[1]!r}; this optimizer has "
                    f"admm_rule={self.config.admm_rule!r}, sigma={self.config.sigma!r}: pass the checkpoint's"
                )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "dho2"})
        device = self.params[0].device
        self.steps, self.refreshes = int(dho2["steps"]), int(dho2["refreshes"])
        self.base_state = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in dho2["base_state"].items()}
        basis = dho2["basis"]
        self.basis = None if basis is None else EigenBasis(basis["values"].clone().to(device), basis["vectors"].clone().to(device))
        if self.admm is not None:
            self.admm.multiplier = dho2["admm"]["multiplier"].clone().to(device)
            self.admm.anchor = dho2["admm"]["anchor"].clone().to(device)
        self.nonfinite.consecutive, self.nonfinite.skipped_total = (int(x) for x in dho2["nonfinite"])
        self.grads.reset(None)

    # -------------------------------------------------------------- reporting
    def memory_usage(self) -> dict[str, int]:
        """Bytes per kind on this worker: the Lanczos basis block (about n·m/P, held during a refresh), the tridiagonal B,
        the eigenvectors kept between refreshes, the ADMM vectors and the base optimizer's state."""
        item = self.params[0].element_size()
        tensors = [v for v in self.base_state.values() if isinstance(v, torch.Tensor)]
        return {
            "lanczos_basis": self._lanczos_bytes or lanczos_memory(self.n, self.lanczos_steps, self.backend.size, item),
            "lanczos_tridiagonal": self.lanczos_steps**2 * item,
            "eigenvectors": 0 if self.basis is None else self.basis.vectors.numel() * item,
            "admm": 0 if self.admm is None else 2 * self.n * item,
            "base_state": sum(t.numel() * t.element_size() for t in tensors),
        }

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters."""
        self.grads.remove_hooks()

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config.as_dict().items())
        return f"DHO2Optimizer(n={self.n}, m={self.lanczos_steps}, workers={self.backend.size}, {options})"
