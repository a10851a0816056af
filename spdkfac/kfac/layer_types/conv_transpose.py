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

The output size follows the module's ``output_padding``; a call with
``output_size`` that asks for another one is refused in the backward pass
(the forward hooks cannot see it), naming the module.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        if type(module) not in (nn.ConvTranspose1d, nn.ConvTranspose2d):
            return f"a subclass of {type(module).__mro__[1].__name__} (its forward may differ)"
        return None

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
        self._expected.append(tuple(prepared.shape[2 + i] - self.dilation[i] * (self.kernel_size[i] - 1) for i in range(2)))
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
