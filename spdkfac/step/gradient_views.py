"""The layers' gradients read and written through views: a group's gradients as one stack, updates by multi-tensor copies.

Layer by layer, reading a gradient joins the weight's gradient to its bias
column (one copy), and writing an update back copies its two parts into the
weight and bias gradients (two copies). On a GPU each copy is a kernel
launch, and launches, not arithmetic, pace a transformer's ``step()`` there
(docs/experiments/gpu.md). A layer type that can give its gradient as views
(:meth:`~spdkfac.kfac.layer_types.base.LayerHelper.grad_views`: the weight
part as a ``g x a_w`` view of the weight's gradient, the bias column as the
bias's) lets a group of same-shape layers be read as one stack
(:class:`StackedGradients`), and the updates be written by multi-tensor
copies (:class:`GradientWrites`). On a GPU such a copy is one kernel only
where every part is dense and laid out as its gradient: a stacked group's
parts are (its weight parts and bias columns are made contiguous at once),
a layer's own update is not (its weight part skips the bias column), so a
layer alone still costs a kernel per part. Copies only: the values are
those of each layer's own ``grad_matrix()`` and ``write_grad()``, bitwise,
on every device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..kfac.layer_types.base import LayerHelper
from ..kfac.layers import KFACLayer
from ..kfac.sharded_grads import is_sharded

__all__ = ["GradientWrites", "StackedGradients", "copies_by_layout", "gradient_views", "same_layout"]

#: A layer's weight part (``g x a_w``) and bias column (None without a bias), views of its gradients.
Views = tuple[torch.Tensor, "torch.Tensor | None"]


def gradient_views(layer: KFACLayer) -> Views | None:
    """The layer's gradient views; None where its type has none, or reads or writes its gradient otherwise than
    the views it inherits (a subclass overriding ``grad()`` or ``write_grad()`` alone), or FSDP shards its weight (its
    views would be shards: read whole by ``grad_matrix()``)."""
    if not _views_are_its_gradient(type(layer.helper)) or is_sharded(layer.helper.weight):
        return None
    return layer.helper.grad_views()


class StackedGradients:
    """A group's gradients read as one stack by their views (:func:`gradient_views`)."""

    def __init__(self, views: list[Views]) -> None:
        self.views = views

    @classmethod
    def of(cls, layers: Sequence[KFACLayer]) -> StackedGradients | None:
        """The group's gradient views; None where a layer has none, or the layers differ in having a bias (their
        matrices then agree in shape only)."""
        views = [gradient_views(layer) for layer in layers]
        found = [v for v in views if v is not None]
        if len(found) != len(views) or len({bias is None for _, bias in found}) != 1:
            return None
        return cls(found)

    def read(self) -> torch.Tensor:
        """The ``(n, g, a)`` stack of the layers' gradient matrices (bias as the last column)."""
        weights = torch.stack([weight for weight, _ in self.views])
        if self.views[0][1] is None:
            return weights
        biases = torch.stack([bias for _, bias in self.views if bias is not None])
        return torch.cat([weights, biases.unsqueeze(-1)], dim=-1)


class GradientWrites:
    """Updates gathered for writing into the layers' gradients, then written: by multi-tensor copies for every layer
    with gradient views (:meth:`write`), by its own ``write_grad()`` for each other.

    The layers' gradients must not overlap (tied modules are one layer), so
    the order of the copies does not matter.
    """

    def __init__(self) -> None:
        self._targets: list[torch.Tensor] = []
        self._sources: list[torch.Tensor] = []
        self._others: list[tuple[KFACLayer, torch.Tensor]] = []

    def add(self, layer: KFACLayer, update: torch.Tensor) -> None:
        """``update`` (in the layer's ``grad_shape``) for ``layer``'s gradients."""
        views = gradient_views(layer)
        if views is None:
            self._others.append((layer, update))
            return
        weight, bias = views
        if bias is None:
            self._targets.append(weight)
            self._sources.append(update)
        else:
            self._targets += [weight, bias]
            self._sources += [update[..., :-1], update[..., -1]]

    def add_stack(self, stacked: StackedGradients, updates: torch.Tensor) -> None:
        """The ``(n, g, a)`` updates of a group read by ``stacked``: its weight parts and bias columns each made
        contiguous at once (one copy each), so that every part is laid out as its gradient is."""
        weights = [weight for weight, _ in stacked.views]
        if stacked.views[0][1] is None:
            self._targets += weights
            self._sources += updates.unbind(0)
            return
        self._targets += weights + [bias for _, bias in stacked.views if bias is not None]
        self._sources += updates[..., :-1].contiguous().unbind(0) + updates[..., -1].contiguous().unbind(0)

    def write(self) -> None:
        """Copy every gathered update into its gradients: off the CPU, one multi-tensor copy per dtype pair for the
        parts laid out as their gradients (one kernel on a GPU) and one for the rest (a kernel each); on the CPU one
        for all."""
        for targets, sources in self._copies():
            torch._foreach_copy_(targets, sources)
        for layer, update in self._others:
            layer.write_grad(update)

    def _copies(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The (targets, sources) lists :meth:`write` copies, one multi-tensor copy each."""
        if not self._targets:
            return []
        if not copies_by_layout(self._targets[0].device):
            return [(self._targets, self._sources)]
        alike: dict[tuple[torch.dtype, torch.dtype, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        rest: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for target, source in zip(self._targets, self._sources):
            lists = alike.setdefault((target.dtype, source.dtype, target.device), ([], [])) if same_layout(target, source) else rest
            lists[0].append(target)
            lists[1].append(source)
        return [lists for lists in [*alike.values(), rest] if lists[0]]


def copies_by_layout(device: torch.device) -> bool:
    """Whether :meth:`GradientWrites.write` sorts its copies by layout: off the CPU, where a multi-tensor copy of parts
    laid out as their gradients is one kernel (on the CPU it is a loop of copies whatever the layout)."""
    return device.type != "cpu"


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are dense and laid out alike (sizes, and strides where a size is not 1): what a
    multi-tensor op on a GPU needs of every pair to run as one kernel (else it runs a kernel per tensor)."""
    if a.shape != b.shape or a.device != b.device:
        return False
    if a.is_contiguous() and b.is_contiguous():  # (the usual case, answered without reading strides in Python)
        return True
    return _dense(a) and _dense(b) and all(size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or overlaps (its strides a permutation of a
    contiguous tensor's)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.cache
def _views_are_its_gradient(helper_type: type[LayerHelper]) -> bool:
    """Whether the type's ``grad_views`` is declared where (or below where) its ``grad()`` and ``write_grad()``
    are: a subclass that reads or writes its gradient otherwise, with its parent's views, keeps its own read
    and write."""
    owner = _declared_by(helper_type, "grad_views")
    return all(issubclass(owner, _declared_by(helper_type, name)) for name in ("grad", "write_grad"))


def _declared_by(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))
