"""The preconditioner attached to your optimizer: stepped from its ``step()``, saved in its ``state_dict()``.

``KFACPreconditioner(model, optimizer=opt)`` is for training loops that are
not yours to edit (Lightning, Hugging Face's ``Trainer``, accelerate): they
call ``opt.step()`` and checkpoint ``opt.state_dict()``, and nothing else.
Hooks on the optimizer make those two calls carry the preconditioner:

- ``opt.step()`` preconditions first (a step pre-hook). Given a closure, the
  closure runs its forward and backward pass inside ``step()``, so the
  preconditioning goes after it: the closure is wrapped.
- ``opt.state_dict()`` holds the K-FAC state under :data:`STATE_KEY`, and
  ``opt.load_state_dict()`` restores it; a checkpoint without it (made before
  K-FAC was added) loads with a warning, K-FAC starting afresh.
- ``opt.consolidate_state_dict(to=0)`` is added (or, where the optimizer has
  one, ``ZeroRedundancyOptimizer``'s, runs after the preconditioner's): a
  collective that gives rank ``to`` every worker's K-FAC state for its next
  ``state_dict()`` (with ``grad_worker_fraction`` below 1 each worker keeps
  its own layers'). Lightning calls it on every worker before each
  checkpoint of an optimizer that has it; Hugging Face's ``Trainer`` through
  :func:`spdkfac.update.trainer_callback.hugging_face_callback`.
- A ``GradScaler`` that skips an overflowing step never calls ``opt.step()``:
  that batch's factors are dropped when the next forward pass begins, which
  knows the skip by the scale the scaler lowered (or by the gradients
  ``opt.zero_grad()`` cleared: ``SPDKFACOptimizer._drop_unstepped``).

Unattached (KAISA's usage: ``preconditioner.step()``, then ``opt.step()``),
the preconditioner averages the model's gradients, and the parameters your
optimizer holds outside the model (a loss's own weights) drifted apart on
each worker, silently. A process-wide step pre-hook of ``torch.optim``
(:func:`watch`) shows each such preconditioner every optimizer's step; one
that trains its model hands it those parameters, averaged at once and then
from the backward pass, as an attached optimizer's are.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["STATE_KEY", "OptimizerAttachment", "check_attachable", "refuse_averaging_optimizer", "unwatch", "watch"]

#: The key of the K-FAC state in the attached optimizer's ``state_dict()``.
STATE_KEY = "kfac_preconditioner"

#: The method added to the attached optimizer, by the name ``ZeroRedundancyOptimizer`` gives it (Lightning looks for it).
CONSOLIDATE = "consolidate_state_dict"


class _Preconditioner(Protocol):
    def _step_from_optimizer(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    def consolidate_state_dict(self, to: int = 0) -> None: ...


class _Unattached(Protocol):
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...


#: The unattached preconditioners on several workers (held weakly), and the one hook that shows them every step.
_watching: weakref.WeakSet[Any] = weakref.WeakSet()
_hook: list[RemovableHandle] = []


def watch(preconditioner: _Unattached) -> None:
    """Show ``preconditioner`` every ``torch.optim`` optimizer's ``step()`` before it runs, for as long as it lives."""
    _watching.add(preconditioner)
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_before_any_step))


def unwatch(preconditioner: _Unattached) -> None:
    """Stop showing ``preconditioner`` the optimizers' steps (its hooks are removed)."""
    _watching.discard(preconditioner)


def _before_any_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for preconditioner in list(_watching):
        preconditioner._before_optimizer_step(optimizer)


def check_attachable(optimizer: Any) -> None:
    """Raise TypeError for an object the preconditioner cannot ride on: not a ``torch.optim.Optimizer``, or one
    that averages the gradients itself (:func:`refuse_averaging_optimizer`)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer= must be a torch.optim.Optimizer (its step and state_dict hooks carry the preconditioner), "
            f"got {type(optimizer).__name__}; without one, call preconditioner.step() before your optimizer's step()"
        )
    refuse_averaging_optimizer(optimizer)


def refuse_averaging_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise TypeError for Horovod's ``DistributedOptimizer`` (a subclass of the optimizer's class made in Horovod's
    module), KAISA's usage under horovodrun: it all-reduces the gradients in place while the preconditioner's own
    all-reduces of the same tensors are in flight, and the result depends on their timing."""
    if type(optimizer).__module__.startswith("horovod"):
        raise TypeError(
            "KFACPreconditioner averages every gradient over the workers itself (with Horovod under horovodrun): "
            "hvd.DistributedOptimizer would average them a second time, in place, while the preconditioner's "
            "all-reduces of the same tensors are in flight. Use the optimizer unwrapped, and drop "
            "optimizer.synchronize() and skip_synchronize()"
        )


class OptimizerAttachment:
    """The hooks on the user's optimizer that step, save and restore the preconditioner with it.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (the caller checks it first, :func:`check_attachable`).
        preconditioner: what the hooks call; the optimizer holds it (through
            the hooks) for as long as it lives.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, preconditioner: _Preconditioner) -> None:
        self.optimizer = optimizer
        self.in_step = False  # whether the optimizer's step() is preconditioning now
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._before_step(preconditioner)),
            optimizer.register_state_dict_post_hook(_saving(preconditioner)),
            optimizer.register_load_state_dict_pre_hook(_loading(preconditioner)),
        ]
        # The optimizer's own method on its instance, where one was set there (None: its class's, or none).
        self._replaced = optimizer.__dict__.get(CONSOLIDATE)
        self._consolidate = _consolidating(preconditioner, getattr(optimizer, CONSOLIDATE, None))
        setattr(optimizer, CONSOLIDATE, self._consolidate)

    def _before_step(self, preconditioner: _Preconditioner) -> Callable[..., Any]:
        def precondition() -> None:
            self.in_step = True
            try:
                preconditioner._step_from_optimizer()
            finally:
                self.in_step = False

        def hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is None:
                precondition()
                return None

            def closure_then_precondition() -> Any:  # the closure's backward pass first
                loss = closure()
                precondition()
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_precondition}
            return (args[0], closure_then_precondition, *args[2:]), kwargs

        return hook

    def remove(self) -> None:
        """Detach the hooks from the optimizer."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.optimizer.__dict__.get(CONSOLIDATE) is self._consolidate:
            if self._replaced is None:
                delattr(self.optimizer, CONSOLIDATE)
            else:
                setattr(self.optimizer, CONSOLIDATE, self._replaced)


def _consolidating(preconditioner: _Preconditioner, own: Callable[..., Any] | None) -> Callable[[int], None]:
    def consolidate_state_dict(to: int = 0) -> None:
        """Collective: give rank ``to`` every worker's K-FAC state (and this optimizer's own, where it shards it)
        for its next ``state_dict()``; call it on every worker, between steps, before rank ``to`` saves."""
        preconditioner.consolidate_state_dict(to)
        if own is not None:
            own(to)

    return consolidate_state_dict


def _saving(preconditioner: _Preconditioner) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    def hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[STATE_KEY] = preconditioner.state_dict()
        return state_dict

    return hook


def _loading(preconditioner: _Preconditioner) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    def hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)  # (the caller's dict keeps its key)
        saved = state_dict.pop(STATE_KEY, None)
        if saved is None:
            warnings.warn(
                f"the state_dict loaded into {type(optimizer).__name__} holds no K-FAC state (saved without the "
                "preconditioner attached): the preconditioner starts afresh (factors from the identity, step 0)",
                stacklevel=3,
            )
        else:
            preconditioner.load_state_dict(saved)
        return state_dict

    return hook
