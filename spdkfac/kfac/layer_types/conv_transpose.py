"""``nn.ConvTranspose1d/2d/3d``: the factors of the equivalent stride-1 convolution.

A transposed convolution with stride ``s``, padding ``p``, output padding
``op``, dilation ``d`` and kernel ``k`` is the convolution, with stride 1 and
the same dilation, of its input with ``s - 1`` zeros between neighbouring
values and ``d(k - 1) - p`` zeros before and ``d(k - 1) - p + op`` after
(negative: cropped), by the spatially flipped kernel. K-FAC of a
convolution (Grosse and Martens' KFC) then applies as it is: ``A`` from the
im2col patches of that prepared input, one row per output position, ``G``
from the output gradient, ``S`` = the output positions per sample. The
input is flipped as well, so that a patch's offsets run in the kernel's own
order: ``A``'s rows are ``(input channel, kernel offset)`` as the weight
``(in, out / groups, *k)`` stores them, and the gradient matrix is the weight
gradient with its first two dimensions swapped (per group). The Grams are
the convolution helpers' (:mod:`.conv`, :mod:`.conv3d`), of a convolution
module made on the ``meta`` device for the purpose.

With a stride above 1 most of a patch is inserted zeros, and which kernel
offsets meet an input value depends only on the output position's residue
modulo the stride: ``A`` is block-diagonal over those residue classes (but
for the bias). Each class's rows are the patches of an ordinary stride-1
convolution of the input itself, with the class's offsets as its kernel
(sub-pixel convolutions), so its Gram takes the convolution helper's fast
paths: ``stride^(2·dims)`` times fewer products than the whole zero-filled
patches (benchmarks/transposed_conv_factor.py; grouped layers keep the whole
patches).

The output size follows the module's ``output_padding``; a call with
``output_size`` that asks for another one is refused in the backward pass
(the forward hooks cannot see it), naming the module.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..factor_shape import FactorShape
from ..tensor_cores import HALF_DTYPES
from .conv import ConvHelper, GroupedConvolution
from .conv3d import Conv3dHelper

__all__ = ["ConvTransposeHelper"]

ConvTranspose = Union[nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d]
#: The convolution helper and module class per number of spatial dimensions.
CONVS: dict[int, tuple[type[nn.Module], type[ConvHelper] | type[Conv3dHelper]]] = {
    1: (nn.Conv1d, ConvHelper),
    2: (nn.Conv2d, ConvHelper),
    3: (nn.Conv3d, Conv3dHelper),
}


def _convolution(dims: int, channels: int, kernel: Sequence[int], dilation: Sequence[int], groups: int, bias: bool) -> GroupedConvolution:
    """The helper of a stride-1, unpadded convolution (its module on the ``meta`` device: geometry only)."""
    conv_type, helper_type = CONVS[dims]
    conv = conv_type(channels, groups, tuple(kernel), dilation=tuple(dilation), groups=groups, bias=bias, device="meta")
    return helper_type(conv)  # type: ignore[arg-type]


class _ResidueClass(NamedTuple):
    """One residue class of the output positions: the convolution whose patches are its rows, and where its Gram
    goes in ``A`` (its offsets' columns, channel-major, then the bias's)."""

    conv: GroupedConvolution
    columns: torch.Tensor


class ConvTransposeHelper(GroupedConvolution):
    module: ConvTranspose

    def __init__(self, module: ConvTranspose) -> None:
        super().__init__(module)
        assert not isinstance(module.padding, str)  # (a transposed convolution takes numbers only)
        self.dims = len(module.kernel_size)
        self.kernel_size = tuple(int(k) for k in module.kernel_size)
        self.stride = tuple(int(s) for s in module.stride)
        self.dilation = tuple(int(d) for d in module.dilation)
        self.groups = int(module.groups)
        self.half_rows = self.groups == 1
        #: Zeros before and after the (spread) input per spatial dimension, in the module's frame (negative: crop).
        self.before = tuple(d * (k - 1) - int(p) for k, d, p in zip(self.kernel_size, self.dilation, module.padding))
        self.after = tuple(b + int(o) for b, o in zip(self.before, module.output_padding))
        #: The equivalent convolution (stride 1, no padding: the prepared input carries it).
        self.equivalent = _convolution(self.dims, module.in_channels, self.kernel_size, self.dilation, self.groups, self.has_bias)
        #: Per spatial dimension and residue of the output position modulo the stride: the offsets meeting input values.
        self._offsets = [self._class_offsets(axis) for axis in range(self.dims)]
        #: Per residue class: a plain convolution over the (flipped) input with the class's offsets as its kernel.
        self._classes = {residue: self._residue_class(residue) for residue in itertools.product(*(range(s) for s in self.stride))}
        #: Output sizes the forward passes since :meth:`forget` produce (checked against the output gradients).
        self._expected: list[tuple[int, ...]] = []

    computes_with = ("forward", "_output_padding")

    @property
    def a_shape(self) -> FactorShape:
        return self.equivalent.a_shape

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        x = x.to(dtype)
        self._expected.append(self._output_size(x.shape[2:]))
        if self.groups > 1 or all(s == 1 for s in self.stride):
            return self.equivalent.input_gram(self.prepared(x), dtype)
        flipped = x.flip(list(range(2, x.dim())))
        out = self._expected[-1]
        dim, bias = math.prod(self.kernel_size) * x.shape[1], int(self.has_bias)
        gram: torch.Tensor | None = None
        for residue, found in self._classes.items():
            rows = tuple(len(range(r, size, s)) for r, size, s in zip(residue, out, self.stride))
            if found is None or not all(rows):
                continue  # (positions that meet no input value: zero rows, which only the bias counts)
            part, _ = found.conv.input_gram(self._class_input(flipped, residue, rows, found.conv), dtype)
            if gram is None:
                gram = part.new_zeros(dim + bias, dim + bias)
            index = found.columns.to(x.device)
            gram[index.unsqueeze(1), index] += part
        count = x.shape[0] * math.prod(out)
        if gram is None:
            gram = x.new_zeros(dim + bias, dim + bias, dtype=torch.float32 if x.dtype in HALF_DTYPES else None)
        if bias:
            gram[dim, dim] = count  # (every position's one: the classes' counts and the zero rows')
        return gram, count

    def prepared(self, x: torch.Tensor) -> torch.Tensor:
        """The flipped input spread out by zeros and padded: the equivalent convolution's input."""
        spatial = list(range(2, x.dim()))
        flipped = x.flip(spatial)
        if any(s > 1 for s in self.stride):
            spread = x.new_zeros(*x.shape[:2], *((size - 1) * s + 1 for size, s in zip(x.shape[2:], self.stride)))
            values: tuple[slice, ...] = (slice(None), slice(None), *(slice(None, None, s) for s in self.stride))
            spread[values] = flipped
            flipped = spread
        # Flipped, the zeros after the input come first (F.pad: the last dimension first).
        return F.pad(flipped, [p for axis in reversed(range(self.dims)) for p in (self.after[axis], self.before[axis])])

    def _residue_class(self, residue: tuple[int, ...]) -> _ResidueClass | None:
        """The convolution whose patches are a residue class's rows and their place in ``A`` (None: no offset meets a
        value)."""
        offsets = [self._offsets[axis][r] for axis, r in enumerate(residue)]
        if not all(offsets):
            return None
        dilation = [(o[1] - o[0]) * self.dilation[axis] // self.stride[axis] if len(o) > 1 else 1 for axis, o in enumerate(offsets)]
        conv = _convolution(self.dims, self.module.in_channels, [len(o) for o in offsets], dilation, 1, self.has_bias)
        dim = self.module.in_channels * math.prod(self.kernel_size)
        columns = torch.arange(dim).view(self.module.in_channels, *self.kernel_size)
        where: tuple[slice | torch.Tensor, ...] = (slice(None), *torch.meshgrid(*(torch.tensor(o) for o in offsets), indexing="ij"))
        index = columns[where].reshape(-1)
        return _ResidueClass(conv, torch.cat([index, index.new_tensor([dim])]) if self.has_bias else index)

    def _class_input(self, flipped: torch.Tensor, residue: tuple[int, ...], rows: tuple[int, ...], sub: GroupedConvolution) -> torch.Tensor:
        """The flipped input cropped or zero-padded so that the class's stride-1 windows are its output positions.

        Window ``t`` of residue ``r`` (output position ``r + t·s``) reads input
        ``t + (r + a0·d − after)/s + m·d'`` at its ``m``-th offset ``a0 + m·s/g``
        (``g = gcd(s, d)``, ``d' = d/g``, the class convolution's dilation).
        """
        kernel, dilation = sub.module.kernel_size, sub.module.dilation
        pads = []
        for axis in reversed(range(self.dims)):  # (F.pad: the last dimension first)
            r = residue[axis]
            first = (r + self._offsets[axis][r][0] * self.dilation[axis] - self.after[axis]) // self.stride[axis]
            last = first + rows[axis] - 1 + (int(kernel[axis]) - 1) * int(dilation[axis])
            pads += [-first, last - (flipped.shape[2 + axis] - 1)]
        return F.pad(flipped, pads)

    def _class_offsets(self, axis: int) -> list[list[int]]:
        """Per residue of the output position modulo the stride: the kernel offsets that meet an input value.

        In the prepared (flipped) input the values sit at ``after + j·s``, so
        offset ``a`` of a window at ``p`` meets one where ``p + a·d − after`` is
        a multiple of the stride (the zeros outside the input are values too,
        of the same offsets: the residue alone decides).
        """
        stride, kernel, dilation = self.stride[axis], self.kernel_size[axis], self.dilation[axis]
        return [[a for a in range(kernel) if (r + a * dilation - self.after[axis]) % stride == 0] for r in range(stride)]

    def _output_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The output's spatial size for an input of ``size`` (with the module's ``output_padding``)."""
        s, k, d = self.stride, self.kernel_size, self.dilation
        return tuple((size[i] - 1) * s[i] + self.before[i] + self.after[i] - d[i] * (k[i] - 1) + 1 for i in range(self.dims))

    def forget(self) -> None:
        self._expected = []

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        size = tuple(g.shape[2:])
        if self._expected and size not in self._expected:
            raise ValueError(
                f"{type(self.module).__name__}: the output is {size} where output_padding="
                f"{tuple(self.module.output_padding)} gives {self._expected[-1]}: called with output_size, which K-FAC's hooks "
                "cannot see; set output_padding on the module instead, or list it in skip_layers"
            )
        return super().output_gram(g)

    def _as_matrix(self, weight_like: torch.Tensor) -> torch.Tensor:
        """``(in, out/g, *k)`` -> ``(g, out/g, in/g * prod(k))`` (``(out, in * prod(k))`` with one group)."""
        groups = self.groups
        cin, og = weight_like.shape[:2]
        per_group = weight_like.reshape(groups, cin // groups, og, -1).transpose(1, 2)
        return per_group.reshape(*self.grad_shape[:-1], -1) if groups > 1 else per_group.reshape(og, -1)

    def _as_weight(self, matrix: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_as_matrix`: the weight's own layout."""
        groups = self.groups
        cin, og = self.weight.shape[:2]
        blocks = matrix.reshape(groups, og, cin // groups, -1).transpose(1, 2)
        return blocks.reshape(self.weight.shape)
