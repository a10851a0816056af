"""Gradients of parameters sharded by FSDP (``fully_shard``): read whole, written back as each worker's shard.

Under FSDP2 a parameter between passes is a ``DTensor``, each worker
holding rows of it, and after ``backward()`` its gradient is the average
over the workers in the same rows (FSDP's reduce-scatter). K-FAC needs the
whole gradient matrix (``G⁻¹ ∇W A⁻¹`` mixes every row with every other).
Inside :func:`whole_gradients` a layer type's helper sees, in place of each
sharded parameter, a stand-in of its shape whose gradient is the whole
gradient (an all-gather, the same bytes on every worker); it reads and
writes that as it does a plain parameter's, and on leaving each worker
copies its own rows back into the sharded gradient (no communication). One
stand-in per parameter, so layers sharing one (an attention's q, k and v
rows of ``in_proj_weight``) write into the same whole gradient.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

#: Where torch defines ``DTensor`` (public from torch 2.5, private before). Read from ``sys.modules`` only: a
#: ``DTensor`` exists only where its module was loaded, and loading it here would double ``import spdkfac``'s time.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")

__all__ = ["assign_weight_slots", "is_sharded", "parameter_slots", "whole", "whole_gradients"]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or gradient sharded over a device mesh)."""
    for name in _DTENSOR_MODULES:
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None:
            return isinstance(tensor, dtensor)
    return False


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (all-gathered from the workers' shards; a plain tensor as it is)."""
    sharded: Any = tensor
    return sharded.full_tensor() if is_sharded(tensor) else tensor


@contextmanager
def whole_gradients(helpers: Sequence[Any], write_back: bool = True) -> Iterator[None]:
    """Within: each helper's sharded parameters replaced by stand-ins holding the whole gradients; on leaving (with
    ``write_back``) each worker's rows of them copied into the sharded gradients, and the parameters put back.

    The gradients are all-gathered in the helpers' order, the same on every
    worker. Without sharded parameters, nothing is done.
    """
    if not any(is_sharded(getattr(helper, "weight", None)) for helper in helpers):  # (FSDP shards every parameter or none)
        yield
        return
    swapped: list[tuple[Any, str, torch.Tensor]] = []
    stand_ins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (parameter, stand-in)
    try:
        for helper in helpers:
            for attr, value in list(vars(helper).items()):
                if not is_sharded(value):
                    continue
                if id(value) not in stand_ins:
                    stand_ins[id(value)] = (value, _stand_in(value))
                swapped.append((helper, attr, value))
                setattr(helper, attr, stand_ins[id(value)][1])
        yield
        if write_back:
            for param, stand_in in stand_ins.values():
                if stand_in.grad is None:
                    continue
                if param.grad is None:  # (a bias the update gave a gradient to)
                    param.grad = torch.zeros_like(param)
                param.grad.copy_(_replicated(stand_in.grad, param))
    finally:
        for helper, attr, value in reversed(swapped):
            setattr(helper, attr, value)


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """A tensor of ``param``'s whole shape, dtype and device (no storage of that size) holding its whole gradient."""
    stand_in = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
    if param.grad is not None:
        stand_in.grad = whole(param.grad)
    return stand_in


def _replicated(whole_grad: torch.Tensor, param: Any) -> torch.Tensor:
    """``whole_grad``, the same on every worker, as a ``DTensor`` replicated over ``param``'s mesh: copied into the
    sharded gradient, each worker keeps its rows."""
    from torch.distributed.tensor import DTensor, Replicate  # (loaded already: the parameter is one)

    mesh = param.device_mesh
    replicated: torch.Tensor = DTensor.from_local(whole_grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated


def assign_weight_slots(layers: Sequence[Any], model: nn.Module) -> None:
    """Give each layer the slot of ``model`` its weight is registered in (its ``weight_slot``), where FSDP2 puts the
    whole copy during its passes."""
    slots = parameter_slots(model)
    for layer in layers:
        layer.weight_slot = slots.get(id(layer.helper.weight))


def parameter_slots(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """Per parameter (by ``id``): the module of ``model`` and the name under which it registers it. FSDP2 registers
    a parameter's whole copy there during its passes, its shard between them."""
    return {id(held): (module, name) for module in model.modules() for name, held in module._parameters.items() if held is not None}
