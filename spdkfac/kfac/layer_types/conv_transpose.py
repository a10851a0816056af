"""``nn.ConvTranspose1d`` and ``nn.ConvTranspose2d``: the factors of the equivalent stride-1 convolution.

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
gradient with its first two dimensions swapped (per group).

With a stride above 1 most of a patch is inserted zeros, and which kernel
offsets meet an input value depends only on the output position's residue
modulo the stride: ``A`` is block-diagonal over those residue classes (but
for the bias). Each class's rows are the patches of an ordinary stride-1
convolution of the input itself, with the class's offsets as its kernel
(sub-pixel convolutions), so its Gram takes the convolution helper's fast
paths; ``stride⁴`` times fewer products than the whole zero-filled patches
(benchmarks/transposed_conv_factor.py; grouped layers keep the whole
patches).

The output size follows the module's ``output_padding``; a call with
``output_size`` that asks for another one is refused in the backward pass
(the forward hooks cannot see it), naming the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tensor_cores import HALF_DTYPES
from .base import split_bias_column, with_bias_column
from .conv import ConvHelper, spatial_pair

__all__ = ["ConvTransposeHelper"]

ConvTranspose = Union[nn.ConvTranspose1d, nn.ConvTranspose2d]


class ConvTransposeHelper(ConvHelper):
    def __init__(self, module: ConvTranspose) -> None:
        super().__init__(module)  # kernel, dilation, groups, channels as the convolution's
        one_d = self.one_d
        kernel, dilation = self.kernel_size, self.dilation
        self.transposed_stride = spatial_pair(module.stride, one_d)
        assert not isinstance(module.padding, str)  # (a transposed convolution takes numbers only)
        # (a 1-D module is the 2-D one of height 1: no padding along the height)
        padding, output_padding = ((0, int(v[0])) if one_d else (int(v[0]), int(v[1])) for v in (module.padding, module.output_padding))
        #: Zeros before and after the (dilated) input along height and width, in the module's frame (negative: crop).
        self.before = tuple(d * (k - 1) - p for k, d, p in zip(kernel, dilation, padding))
        self.after = tuple(b + o for b, o in zip(self.before, output_padding))
        # The equivalent convolution runs with stride 1 over the prepared input, which carries every padding.
        self.stride = (1, 1)
        self.padding = (0, 0)
        self.explicit_pad = None
        #: Output sizes the forward passes since :meth:`forget` produce (checked against the output gradients).
        self._expected: list[tuple[int, ...]] = []
        #: Per axis and residue of the output position modulo the stride: the kernel offsets that meet input values.
        self._offsets = [self._class_offsets(axis) for axis in range(2)]
        #: Per residue class: a plain convolution over the (flipped) input with the class's offsets as its kernel.
        self._classes = {
            (ry, rx): self._class_conv(offsets_y, offsets_x)
            for ry, offsets_y in enumerate(self._offsets[0])
            for rx, offsets_x in enumerate(self._offsets[1])
        }

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        if type(module) not in (nn.ConvTranspose1d, nn.ConvTranspose2d):
            return f"a subclass of {type(module).__mro__[1].__name__} (its forward may differ)"
        return None

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        if self.groups > 1 or self.transposed_stride == (1, 1):
            return super().input_gram(x, dtype)
        flipped = (x.unsqueeze(2) if self.one_d else x).to(dtype).flip(2, 3)
        out_h, out_w = self._output_size(flipped.shape[2:])
        self._expected.append((out_h, out_w))
        c = flipped.shape[1]
        kh, kw = self.kernel_size
        dim, bias = c * kh * kw, int(self.has_bias)
        columns = torch.arange(dim, device=x.device).view(c, kh, kw)
        gram: torch.Tensor | None = None
        for (ry, rx), sub in self._classes.items():
            rows = (len(range(ry, out_h, self.transposed_stride[0])), len(range(rx, out_w, self.transposed_stride[1])))
            if sub is None or not all(rows):
                continue  # (positions that meet no input value: zero rows, which only the bias counts)
            part, _ = sub.input_gram(self._class_input(flipped, (ry, rx), rows, sub), flipped.dtype)
            if gram is None:
                gram = part.new_zeros(dim + bias, dim + bias)
            index = columns[:, self._offsets[0][ry]][:, :, self._offsets[1][rx]].reshape(-1)
            if bias:
                index = torch.cat([index, index.new_tensor([dim])])
            gram[index.unsqueeze(1), index] += part
        count = flipped.shape[0] * out_h * out_w
        if gram is None:
            gram = flipped.new_zeros(dim + bias, dim + bias, dtype=torch.float32 if flipped.dtype in HALF_DTYPES else None)
        if bias:
            gram[dim, dim] = count  # (every position's one: the classes' counts and the zero rows')
        return gram, count

    def _class_conv(self, offsets_y: list[int], offsets_x: list[int]) -> ConvHelper | None:
        """The stride-1 convolution whose patches are a residue class's rows (None: no offset meets a value)."""
        if not offsets_y or not offsets_x:
            return None
        dy, dx = (
            (offsets[1] - offsets[0]) * self.dilation[axis] // self.transposed_stride[axis] if len(offsets) > 1 else 1
            for axis, offsets in enumerate((offsets_y, offsets_x))
        )
        kernel = (len(offsets_y), len(offsets_x))
        conv = nn.Conv2d(self.module.in_channels, 1, kernel, dilation=(dy, dx), bias=self.has_bias, device="meta")
        return ConvHelper(conv)

    def _class_input(self, flipped: torch.Tensor, residue: tuple[int, int], rows: tuple[int, int], sub: ConvHelper) -> torch.Tensor:
        """The flipped input cropped or zero-padded so that the class's stride-1 windows are its output positions.

        Window ``t`` of residue ``r`` (output position ``r + t·s``) reads input
        ``t + (r + a0·d − after)/s + m·d'`` at its ``m``-th offset ``a0 + m·s/g``
        (``g = gcd(s, d)``, ``d' = d/g``, the class convolution's dilation).
        """
        pads = []
        for axis in (1, 0):  # (F.pad: the last dimension first)
            r = residue[axis]
            first = (r + self._offsets[axis][r][0] * self.dilation[axis] - self.after[axis]) // self.transposed_stride[axis]
            last = first + rows[axis] - 1 + (sub.kernel_size[axis] - 1) * sub.dilation[axis]
            pads += [-first, last - (flipped.shape[2 + axis] - 1)]
        return F.pad(flipped, pads)

    def _output_size(self, size: Sequence[int]) -> tuple[int, int]:
        """The output height and width for an input of ``size`` (with the module's ``output_padding``)."""
        s, k, d = self.transposed_stride, self.kernel_size, self.dilation
        height, width = ((size[i] - 1) * s[i] + self.before[i] + self.after[i] - d[i] * (k[i] - 1) + 1 for i in range(2))
        return height, width

    def _class_offsets(self, axis: int) -> list[list[int]]:
        """Per residue of the output position modulo the stride: the kernel offsets that meet an input value.

        In the prepared (flipped) input the values sit at ``after + j·s``, so
        offset ``a`` of a window at ``p`` meets one where ``p + a·d − after`` is
        a multiple of the stride (the zeros outside the input are values too,
        of the same offsets: the residue alone decides).
        """
        stride, kernel, dilation = self.transposed_stride[axis], self.kernel_size[axis], self.dilation[axis]
        return [[a for a in range(kernel) if (r + a * dilation - self.after[axis]) % stride == 0] for r in range(stride)]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """The flipped input with the zeros of the equivalent convolution, as ``(n, C, H, W)``."""
        x = x.unsqueeze(2) if self.one_d else x
        n, c, h, w = x.shape
        sh, sw = self.transposed_stride
        flipped = x.flip(2, 3)
        if (sh, sw) == (1, 1):
            dilated = flipped
        else:
            dilated = x.new_zeros(n, c, (h - 1) * sh + 1, (w - 1) * sw + 1)
            dilated[:, :, ::sh, ::sw] = flipped
        (top, left), (bottom, right) = self.before, self.after
        # Flipped, the zeros after the input come first.
        prepared = F.pad(dilated, (right, left, bottom, top))
        self._expected.append(self._output_size((h, w)))
        return prepared

    def forget(self) -> None:
        self._expected = []

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        size = (1, g.shape[2]) if self.one_d else (g.shape[2], g.shape[3])
        if self._expected and size not in self._expected:
            expected = self._expected[-1][1:] if self.one_d else self._expected[-1]
            raise ValueError(
                f"{type(self.module).__name__}: the output is {tuple(g.shape[2:])} where output_padding="
                f"{tuple(self.module.output_padding)} gives {expected}: called with output_size, which K-FAC's hooks "
                "cannot see; set output_padding on the module instead, or list it in skip_layers"
            )
        return super().output_gram(g)

    def grad(self) -> torch.Tensor | None:
        grad = self.weight.grad
        if grad is None:
            return None
        return with_bias_column(self._as_matrix(grad), self.bias)

    def write_grad(self, update: torch.Tensor) -> None:
        split_bias_column(update, self.weight, self.bias, as_weight=self._as_weight)

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
