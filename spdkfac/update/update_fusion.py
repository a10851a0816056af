"""Update fusion: the parameter update moved out of ``step()`` into the pass that touches the same data.

Eager training reads every parameter, gradient and momentum buffer again,
cold, in a separate optimizer pass. Fusing the update into a pass that
touches them anyway (the seed paper, ``optimizer-fusion``) saves that trip:

* :class:`ForwardFusion` (``update_fusion='forward'``): ``step()`` computes
  everything global (the KL clip, the non-finite check) and the
  preconditioned gradients, and each parameter's update is applied in the
  forward pre-hook of the module that owns it, at the next forward pass.
  What that pass does not reach is applied at the next ``step()``,
  :meth:`ForwardFusion.flush`, or whenever the model's or optimizer's
  ``state_dict`` is read or loaded.
* :class:`BackwardFusion` (``update_fusion='backward'``): each preconditioned
  layer (and each other parameter) is updated during ``backward()`` as soon
  as its averaged gradient exists. Only on steps that need nothing global:
  the steps that recompute the decompositions (and the first) take the
  update at ``step()`` as without fusion.

Each parameter gets the same operations as without fusion
(:func:`~spdkfac.update.base_update.sgd_param_update`), so the parameters after every step
are bitwise those of the unfused optimizer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from ..kfac.layers import KFACLayer, functional_submodules
from ..options import Option
from ..step.compiled_hooks import run_eagerly
from ..step.grad_sync import GradientSync, GradNote, changed_since, note_grad
from ..step.module_hooks import HookHandle, load_state_dict_pre_hooks, register
from ..step.nonfinite import non_finite
from .base_update import BaseOptimizer, sgd_param_update

__all__ = ["NO_KL_CLIP", "BackwardFusion", "ForwardFusion", "UpdateFusion", "check_update_fusion", "update_owners"]


class UpdateFusion(Option):
    """Where the parameter update runs (``update_fusion``)."""

    NONE = "none"  # in step()
    FORWARD = "forward"  # each module's parameters just before its next forward pass (ForwardFusion)
    BACKWARD = "backward"  # each layer as soon as its averaged gradient exists, in backward() (BackwardFusion)


NO_KL_CLIP = (
    "update_fusion='backward' needs kl_clip=None: the KL clip scales every layer's update by one number computed "
    "from all of them, so no layer can be updated before the last gradient; use update_fusion='forward'"
)


def check_update_fusion(
    update_fusion: UpdateFusion, base: BaseOptimizer, precondition: bool, kl_clip: float | None, grad_scaler: Any | None, distributed: bool
) -> None:
    """Refuse the options fusion cannot keep: another base than momentum SGD, and for ``'backward'`` those that need
    every gradient before any update (ValueError naming the option and the way out)."""
    if update_fusion is not UpdateFusion.NONE and base is not BaseOptimizer.SGD:
        raise ValueError(
            f"update_fusion={update_fusion!r} holds and rolls back momentum-SGD updates only; with base={base!r} use update_fusion='none'"
        )
    if update_fusion is not UpdateFusion.BACKWARD:
        return
    if precondition and kl_clip is not None:
        raise ValueError(NO_KL_CLIP)
    if grad_scaler is not None:
        raise ValueError(
            "update_fusion='backward' cannot be used with a grad_scaler: the scaler unscales and checks all gradients "
            "for Inf before any update; use update_fusion='forward'"
        )
    if precondition and distributed:
        raise ValueError(
            "update_fusion='backward' cannot be used with distribute_preconditioning or grad_worker_fraction < 1: "
            "the preconditioned gradients of another worker's layers arrive in broadcasts after the backward pass; "
            "use update_fusion='forward'"
        )


def update_owners(model: nn.Module, params: Iterable[torch.Tensor]) -> dict[nn.Module, list[torch.Tensor]]:
    """The module whose forward pre-hook applies each parameter's update: the module that holds it.

    A layer whose parent uses its weight without calling its ``forward()``
    (``nn.MultiheadAttention.out_proj``) is handled by that parent, which
    runs first. A parameter held by several modules is applied by the first
    that runs.
    """
    wanted = set(params)
    functional = set(functional_submodules(model))
    modules = dict(model.named_modules(remove_duplicate=False))
    owners: dict[nn.Module, dict[torch.Tensor, None]] = {}  # (dicts: ordered sets of tensors, compared by identity)
    for name, module in modules.items():
        holder = modules[name.rpartition(".")[0]] if name in functional else module
        for p in module.parameters(recurse=False):
            if p in wanted:
                owners.setdefault(holder, {})[p] = None
    return {module: list(held) for module, held in owners.items()}


@dataclass
class _Pending:
    """A parameter's update fixed by ``step()``: its gradient and the hyperparameters then in force."""

    grad: torch.Tensor
    lr: float
    momentum: float
    weight_decay: float


class ForwardFusion:
    """Holds each parameter's update from ``step()`` until the next forward pass reaches its module.

    Args:
        model: the model (pre-hooks on every module that holds a parameter,
            ``state_dict`` and ``load_state_dict`` hooks that apply everything first).
        param_groups, state: the optimizer's (read live).
    """

    def __init__(self, model: nn.Module, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        self.bind(param_groups, state)
        self.pending: dict[torch.Tensor, _Pending] = {}
        self.applied_in_forward = 0  # updates applied by pre-hooks (the rest at flush)
        params = [p for group in param_groups for p in group["params"]]
        self._handles: list[HookHandle] = []
        for module, owned in update_owners(model, params).items():
            pre_hook = run_eagerly(self._pre_hook(owned))  # compiled: a graph break
            self._handles.append(register(module.register_forward_pre_hook, pre_hook))
            self._handles.append(register(module.register_state_dict_pre_hook, self._flush_hook))
            self._handles.append(register(load_state_dict_pre_hooks(module), self._flush_hook))
        # A copy of the model (deepcopy, torch.save(model)) copies its parameters updated: the root's hooks come first.
        self._handles.append(register(model.register_state_dict_pre_hook, self._flush_hook, self._before_copy))

    def bind(self, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Use the optimizer's ``param_groups`` and ``state`` (``load_state_dict`` replaces both)."""
        self.param_groups, self.state = param_groups, state

    def _pre_hook(self, owned: list[torch.Tensor]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, inputs: Any) -> None:
            if self.pending:
                for p in owned:
                    if p in self.pending:
                        self._apply(p)
                        self.applied_in_forward += 1

        return hook

    def defer(self) -> None:
        """Fix the update of every parameter with a gradient (call where ``step()`` would update them)."""
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is not None:
                    self.pending[p] = _Pending(p.grad, lr, momentum, wd)

    @torch.no_grad()
    def _apply(self, p: torch.Tensor) -> None:
        u = self.pending.pop(p)
        sgd_param_update(p, u.grad, self.state[p], u.lr, u.momentum, u.weight_decay)

    def flush(self) -> None:
        """Apply every update still held (the parameters and momentum then equal the unfused optimizer's)."""
        for p in list(self.pending):
            self._apply(p)

    def _flush_hook(self, *args: Any) -> None:
        self.flush()

    @torch.no_grad()
    def _before_copy(self, memo: dict[int, Any] | None) -> None:
        """The model is being deep-copied (``memo``) or pickled (None): apply what is held first.

        Its children come after the root's hooks, so they are copied updated.
        A parameter copied before (the root's own) is brought up to date in
        the deep copy; ``torch.save`` writes tensor data after pickling, so
        the in-place updates reach it (a plain ``pickle`` would not see them).
        """
        held = list(self.pending)
        self.flush()
        if memo is None:
            return
        for p in held:
            copy = memo.get(id(p))
            if isinstance(copy, torch.Tensor):
                copy.copy_(p)

    def remove_hooks(self) -> None:
        """Apply what is held, then detach the hooks."""
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class _Unit:
    """What backward fusion updates at once: the parameters of preconditioned layers that share them, or one other parameter.

    Layers share parameters when they are blocks of one (``nn.MultiheadAttention``'s
    q, k and v rows of ``in_proj_weight``): all are preconditioned before it is updated.
    """

    params: list[torch.Tensor]
    layers: list[KFACLayer] = field(default_factory=list)
    arrived: int = 0
    done: bool = False


@dataclass
class _Backup:
    param: torch.Tensor
    value: torch.Tensor
    buffer: torch.Tensor | None  # the momentum buffer before the update (None: it did not exist)
    state: dict[str, Any]


class BackwardFusion:
    """Updates each layer (and each other parameter) in ``backward()`` as soon as its averaged gradient exists.

    A layer is preconditioned and updated when all its parameters' gradients
    are final and averaged (the all-reduces are polled from the gradient
    hooks, and waited for at the end of ``backward()``). The values each
    update overwrites are kept until ``step()`` commits them, and the
    gradients the updates used are checked for NaN/Inf once, at the end of
    ``backward()`` (one host synchronisation per step, not one per layer,
    which on a GPU would stall the backward pass at every layer): a step that
    meets NaN/Inf (in any layer, or in the factors at ``step()``) is rolled
    back bitwise, so no parameter or momentum buffer changes, as without
    fusion.

    Args:
        param_groups, state: the optimizer's (read live).
        layers: the preconditioned layers (empty for plain SGD).
        grads: the gradient averaging (waited on and polled here).
        names: parameter -> name, for the non-finite report.
        fused_step: whether this step's update may be fused (it keeps the
            decompositions); asked at the step's first final gradient.
        begin_layer: called with each layer before it is preconditioned in
            backward (what ``step()`` hands its method first: the step's batch).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        state: dict[torch.Tensor, dict[str, Any]],
        layers: list[KFACLayer],
        grads: GradientSync,
        names: dict[torch.Tensor, str],
        fused_step: Callable[[], bool],
        begin_layer: Callable[[KFACLayer], None] | None = None,
    ) -> None:
        self.grads = grads
        self.begin_layer = begin_layer
        self.names = names
        self.fused_step = fused_step
        self.bind(param_groups, state)
        self.units: list[_Unit] = []
        self._unit_of: dict[torch.Tensor, _Unit] = {}
        for layer in (layer for layer in layers if layer.preconditions):  # (a tied embedding's weight is its output layer's)
            params = [p for p in layer.params() if p in self._group]
            shared = next((self._unit_of[p] for p in params if p in self._unit_of), None)
            if shared is None:
                self._add(_Unit(params, [layer]))
                continue
            shared.layers.append(layer)
            for p in params:
                if p not in self._unit_of:
                    shared.params.append(p)
                    self._unit_of[p] = shared
        for p in self._group:
            if p not in self._unit_of:
                self._add(_Unit([p]))
        self.fused_steps = 0  # steps whose update was applied in backward
        self._backups: list[_Backup] = []  # what this step's updates overwrote, until commit()
        self.begin()

    def bind(self, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Use the optimizer's ``param_groups`` and ``state`` (``load_state_dict`` replaces both)."""
        self.state = state
        self._group = {p: group for group in param_groups for p in group["params"]}

    def _add(self, unit: _Unit) -> None:
        self.units.append(unit)
        for p in unit.params:
            self._unit_of[p] = unit

    def begin(self) -> None:
        """Start a step: roll back what an unfinished (skipped, abandoned) step wrote."""
        self.rollback()
        self.active: bool | None = None  # whether this step is fused: decided at its first final gradient
        self.finished = False
        self.bad: list[str] = []
        #: The gradients this step's updates used and their versions (read at step(): a later change is lost).
        self._used: dict[torch.Tensor, GradNote] = {}
        self._ready: deque[_Unit] = deque()
        self._queued = False
        for unit in self.units:
            unit.arrived, unit.done = 0, False

    @property
    def applied(self) -> bool:
        """Whether this step wrote parameters that ``step()`` has not committed yet."""
        return bool(self._backups)

    def grad_ready(self, p: torch.Tensor) -> None:
        """Called from the gradient hook when ``p``'s gradient is final (its all-reduce started)."""
        if self.active is None:
            self.active = self.fused_step()
        if not self.active:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._queued = True
        unit = self._unit_of[p]
        unit.arrived += 1
        if unit.arrived == len(unit.params):
            self._ready.append(unit)
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Update the ready units in arrival order; without ``block``, only while their all-reduces are done."""
        while self._ready:
            unit = self._ready[0]
            if not block and not self.grads.done(unit.params):
                return
            self._ready.popleft()
            self.grads.wait(unit.params)
            self._update(unit)

    def finish(self) -> None:
        """Wait for every gradient and update every unit not yet updated (end of ``backward()``, or ``step()``)."""
        if not self.active or self.finished:
            return
        self.grads.synchronize()  # starts the all-reduces of gradients set outside autograd, waits for all
        self._drain(block=True)
        for unit in self.units:
            if not unit.done:
                self._update(unit)
        used = (b.param for b in self._backups)
        self.bad = non_finite((self.names.get(p, "?"), p.grad) for p in used if p.grad is not None)
        if self.bad:
            self.rollback()
        self._used = {b.param: note_grad(b.param) for b in self._backups if b.param.grad is not None}
        self.finished = True

    def check_unchanged(self) -> None:
        """At ``step()``: raise if the script changed a gradient this step's update had used in ``backward()``
        (clipping between ``backward()`` and ``step()``): the change would be lost on the fused steps and kept on the
        others, silently."""
        for p, note in self._used.items():
            if changed_since(p, note):
                raise RuntimeError(
                    f"the gradient of {self.names.get(p, '?')!r} was changed (clipped, scaled or edited) between backward() "
                    "and step(), but update_fusion='backward' had already applied this step's update in backward(): the "
                    "change would be lost. To clip or edit the gradients, use update_fusion='forward' or 'none'"
                )

    @torch.no_grad()
    def _update(self, unit: _Unit) -> None:
        """Precondition and update ``unit``, keeping what it overwrites (checked for NaN/Inf in :meth:`finish`)."""
        unit.done = True
        for layer in unit.layers:
            grad = layer.grad_matrix()
            if grad is None:
                return
            group = self._group[unit.params[0]]
            if self.begin_layer is not None:
                self.begin_layer(layer)
            layer.write_grad(layer.precondition(grad, float(group["damping"])))
        for p in unit.params:
            if p.grad is None:
                continue
            group, state = self._group[p], self.state[p]
            buf = state.get("momentum_buffer")
            self._backups.append(_Backup(p, p.detach().clone(), None if buf is None else buf.clone(), state))
            sgd_param_update(p, p.grad, state, group["lr"], group["momentum"], group["weight_decay"])

    @torch.no_grad()
    def rollback(self) -> None:
        """Restore every parameter and momentum buffer written since the last :meth:`commit`, bitwise."""
        for b in reversed(self._backups):
            b.param.copy_(b.value)
            if b.buffer is None:
                b.state.pop("momentum_buffer", None)
            else:
                b.state["momentum_buffer"].copy_(b.buffer)
        self._backups = []

    def commit(self) -> None:
        """``step()`` accepted this step's updates: forget the overwritten values."""
        self._backups = []
        self.fused_steps += 1
