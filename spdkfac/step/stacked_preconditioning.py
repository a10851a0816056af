"""Same-shape layers preconditioned together: two batched products per group instead of two products per layer.

A transformer repeats one block, so its layers come in few shapes (ViT-S/16:
74 layers, 5 shapes: its 48 attention projections share one). On a GPU its preconditioning is then bound by the host
issuing kernels layer by layer, not by the arithmetic (docs/experiments/gpu.md).
For a method whose preconditioning is products that broadcast over a leading
dimension (:attr:`~spdkfac.kfac.methods.base.DecompositionMethod.stackable`),
the layers that agree in shapes, dtypes and device are stacked and
preconditioned by one call; where their layer type gives its gradient as
views, the group's gradients are read as one stack
(:class:`~spdkfac.step.gradient_views.StackedGradients`). By default only on a GPU: on the CPU the
arithmetic paces the step, and the stacked products and the copies into the
stack measured slower (:attr:`Preconditioner.stack_groups
<spdkfac.step.preconditioning.Preconditioner.stack_groups>`).

The decompositions are stacked once per decomposition step, and each layer's
decomposition then *is* its slice of the stack: no second copy is kept (but
for a moment at that first stacking, when the new decompositions and their
stack both exist, as any copy would). A
layer whose decomposition was replaced since (the next decomposition step, a
checkpoint loaded) no longer holds its slice, which is noticed by identity,
and its group is stacked again. A group some of whose layers have no
gradient this step (skipped) is preconditioned layer by layer, so that it is
not restacked on every change. The batched products agree with the
per-layer ones to rounding (bitwise on some CPUs, not on all: MKL's AVX-512
kernels round some shapes differently), and every rank computes the same
groups, so the replicas stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kfac.layers import KFACLayer

__all__ = ["StackedDecompositions", "stack_key"]


def stack_key(layer: KFACLayer) -> tuple[Any, ...] | None:
    """What layers must share to be preconditioned stacked; None where the layer cannot be (alone, as usual)."""
    method = layer.method
    if not method.stackable or method.stateful or not layer.decomposed or len(layer.grad_shape) != 2:
        return None
    a, g = layer.decomposition("A"), layer.decomposition("G")
    if not (isinstance(a, torch.Tensor) and isinstance(g, torch.Tensor)) or a.dim() != 2 or g.dim() != 2:
        return None  # diagonal (an Embedding's A) or a multi-tensor decomposition
    return (type(method), layer.grad_shape, tuple(a.shape), tuple(g.shape), a.dtype, g.dtype, a.device, layer.helper.weight.dtype)


@dataclass
class _Stack:
    a: torch.Tensor
    g: torch.Tensor

    def held_by(self, layers: Sequence[KFACLayer]) -> bool:
        """Whether each layer's decompositions are still its slices of this stack."""
        return all(
            layer.decomposition("A") is self.a_views[i] and layer.decomposition("G") is self.g_views[i] for i, layer in enumerate(layers)
        )

    def __post_init__(self) -> None:
        self.a_views = list(self.a.unbind(0))
        self.g_views = list(self.g.unbind(0))


class StackedDecompositions:
    """The stacked decompositions of each group of same-shape layers, and the grouping itself."""

    def __init__(self) -> None:
        self._stacks: dict[tuple[str, ...], _Stack] = {}
        self._grouped: tuple[tuple[Any, ...], list[list[int]]] | None = None  # (what it depends on, the groups)

    def groups(self, layers: Sequence[KFACLayer]) -> list[list[int]]:
        """Indices into ``layers``: every set of two or more with one :func:`stack_key`, in order of its first
        layer, then each other layer alone (in the positions of the first members and the singles).

        Kept until a decomposition is set or a weight changes dtype: the keys
        cost more than the products they save on a GPU when made every step.
        """
        depends = tuple((id(layer), layer.decomposition_version, layer.helper.weight.dtype) for layer in layers)
        if self._grouped is None or self._grouped[0] != depends:
            self._grouped = (depends, self.group(layers))
        return self._grouped[1]

    @staticmethod
    def group(layers: Sequence[KFACLayer]) -> list[list[int]]:
        """:meth:`groups`, made afresh."""
        units: list[list[int]] = []
        by_key: dict[tuple[Any, ...], list[int]] = {}
        for i, layer in enumerate(layers):
            key = stack_key(layer)
            if key is None:
                units.append([i])
            elif key in by_key:
                by_key[key].append(i)
            else:
                by_key[key] = [i]
                units.append(by_key[key])
        return [unit for group in units for unit in ([group] if len(group) > 1 else [[i] for i in group])]

    def stacked(self, layers: Sequence[KFACLayer]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(n, d, d)`` A and G decompositions of ``layers`` (one group); each layer then holds its slices."""
        names = tuple(layer.name for layer in layers)
        stack = self._stacks.get(names)
        if stack is None or not stack.held_by(layers):
            # Drop what is stale first (this group's, or another that shared a layer), so that its memory is free
            # before the new stack is allocated.
            for old in [key for key in self._stacks if set(key) & set(names)]:
                del self._stacks[old]
            stack = None  # (the old stack, if any, is freed before the new one is allocated)
            stack = _Stack(
                torch.stack([layer.decomposition("A") for layer in layers]), torch.stack([layer.decomposition("G") for layer in layers])
            )
            for layer, a, g in zip(layers, stack.a_views, stack.g_views):
                layer.set_decomposition("A", a)
                layer.set_decomposition("G", g)
            self._stacks[names] = stack
        return stack.a, stack.g
