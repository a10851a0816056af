"""The hooks an optimizer puts on the user's modules (and parameters) belong to that optimizer, not to the model.

Three things follow, each a failure before:

- The model holds them weakly. The hooks are closures over the optimizer's
  state; held strongly, a model the script kept held every optimizer ever
  built on it, with its factors (``del optimizer`` freed nothing), and that
  optimizer's hooks went on computing factors in every forward pass. A
  parameter's gradient hooks live in C++, where the garbage collector cannot
  see them: held strongly there, no optimizer with them was ever freed.
- A copy of the model gets inert hooks. Scripts copy their model while
  training (``copy.deepcopy`` for the best model so far, an EMA or SWA
  average, a distillation teacher; ``torch.save(model)``). Before, a pickle
  failed ("Can't pickle local object"), a deep copy took the whole optimizer
  along, and the copy's forward passes ran the optimizer's hooks.
- One optimizer per module at a time (:func:`claim`). A second optimizer
  built on a model (the next stage of a fine-tuning, an optimizer rebuilt with
  new settings) failed at its first forward pass while the first one's hooks
  stayed ("factor A computed twice in one step"). Now the newer one takes the
  modules over: the old one is detached (its held updates applied), and
  refuses to step if the script still uses it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Callable

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookHandle", "InertHook", "OptimizerHook", "claim", "load_state_dict_pre_hooks", "register"]


class InertHook:
    """What an :class:`OptimizerHook` becomes in a copied or unpickled model, or once its optimizer is gone: nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _weak(fn: Callable[..., Any] | None) -> weakref.ref[Callable[..., Any]] | None:
    return None if fn is None else weakref.ref(fn)


class OptimizerHook:
    """``fn`` as a module hook, held weakly (its :class:`HookHandle` holds it); copied or pickled as an :class:`InertHook`.

    Args:
        fn: the hook.
        before_copy: called when the module is deep-copied (with ``deepcopy``'s
            memo: the copies made so far, by ``id``) or pickled (with None),
            before anything registered after this hook is; a module's hooks
            are copied after its own parameters and before its children.
    """

    __slots__ = ("_before_copy", "_fn")

    def __init__(self, fn: Callable[..., Any], before_copy: Callable[[dict[int, Any] | None], None] | None = None) -> None:
        self._fn = weakref.ref(fn)
        self._before_copy = _weak(before_copy)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn()
        return None if fn is None else fn(*args, **kwargs)

    def _copying(self, memo: dict[int, Any] | None) -> InertHook:
        before_copy = None if self._before_copy is None else self._before_copy()
        if before_copy is not None:
            before_copy(memo)
        return InertHook()

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return self._copying(memo)

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        self._copying(None)
        return InertHook, ()


class HookHandle:
    """A registered :class:`OptimizerHook`: keeps its functions alive, and removes it when freed or asked to."""

    def __init__(self, handle: RemovableHandle, fn: Callable[..., Any], before_copy: Callable[..., Any] | None) -> None:
        self.fn, self.before_copy = fn, before_copy
        self._remove = weakref.finalize(self, handle.remove)

    def remove(self) -> None:
        self._remove()


def register(
    add: Callable[[Callable[..., Any]], RemovableHandle],
    fn: Callable[..., Any],
    before_copy: Callable[[dict[int, Any] | None], None] | None = None,
) -> HookHandle:
    """``add(hook)`` (a module's ``register_*_hook``) with ``fn`` as an :class:`OptimizerHook`; keep the handle to keep it."""
    return HookHandle(add(OptimizerHook(fn, before_copy)), fn, before_copy)


#: The optimizer whose hooks are on each module (weakly, both ways).
_claims: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def claim(owner: Any, modules: Iterable[nn.Module]) -> list[Any]:
    """Record ``owner`` as the optimizer of ``modules``; return the other optimizers that held some of them.

    The caller detaches those: one the script still uses then refuses to
    step, and one it let go of (not yet collected: an optimizer's parts refer
    to each other) is detached a little before the collector frees it.
    """
    ref = weakref.ref(owner)
    previous: dict[int, Any] = {}
    for module in modules:
        held = _claims.get(module)
        found = None if held is None else held()
        if found is not None and found is not owner:
            previous[id(found)] = found
        _claims[module] = ref
    return list(previous.values())


def load_state_dict_pre_hooks(module: nn.Module) -> Callable[..., RemovableHandle]:
    """``module.register_load_state_dict_pre_hook``; a torch without it (2.4) has the private form, whose hooks
    take the same arguments (the module first) with ``with_module=True``."""
    public: Callable[..., RemovableHandle] | None = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public
    return functools.partial(module._register_load_state_dict_pre_hook, with_module=True)  # pragma: no cover - older torch
