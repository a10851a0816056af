"""``nn.Conv1d`` and ``nn.Conv2d``: im2col rows, any stride, dilation, padding mode and groups.

A convolution's input rows are its im2col patches (one per sample and
output position, channel-major as ``F.unfold`` orders them); its
output-gradient rows one per sample and position. A ``Conv1d`` is the
``Conv2d`` of height 1. Padding other than symmetric zeros (``'reflect'``,
``'replicate'``, ``'circular'``, an asymmetric ``'same'``) is applied to the
input first, as the module's forward does, and the rows are those of the
padded input.

With ``groups > 1`` the factors are block-diagonal, one block per group
(K-FAC of each group's own weight): ``A_g`` from the patches of the group's
input channels, ``G_g`` from the group's output channels. A depthwise
convolution has ``k x k`` (+1 with a bias) ``A`` blocks and
``multiplier x multiplier`` ``G`` blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..conv_gram import SharedShiftWork, conv_input_gram, shared_shift_work
from ..factor_shape import FactorShape
from ..linalg import channel_gram, mirrored_upper, symmetric_gram
from .base import LayerHelper, bias_grad_view, split_bias_column, with_bias_column

__all__ = [
    "ConvHelper",
    "GroupedConvolution",
    "block_gram",
    "conv_output_gram",
    "sample_chunks",
    "spatial_pair",
    "summed",
    "symmetric_zero_padding",
    "with_bias_row",
]

#: Any convolution module (the transposed ones' helper reuses this one's geometry).
Conv = nn.modules.conv._ConvNd

#: Bytes of kernel-offset rows a depthwise Gram copies at a time (a few channels; at least one).
DEPTHWISE_ROWS_BYTES = 8 << 20

#: Bytes of im2col rows built at a time (whole samples; at least one): the Gram is summed over such chunks, so a
#: factor's rows never take more memory than this (ResNet-50's 7x7 stem, batch 64 at 224x224: 472 MB in one piece).
IM2COL_ROWS_BYTES = 64 << 20


def symmetric_zero_padding(m: Conv) -> tuple[int, ...] | None:
    """The per-dimension zero padding when the module pads with zeros symmetrically, else None."""
    if m.padding_mode != "zeros":
        return None
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return (0,) * len(m.kernel_size)
        pads = []
        for k, d in zip(m.kernel_size, m.dilation):
            total = d * (k - 1)
            if total % 2:
                return None  # asymmetric 'same' padding
            pads.append(total // 2)
        return tuple(pads)
    return tuple(int(p) for p in m.padding)


def spatial_pair(values: tuple[int, ...], one_d: bool) -> tuple[int, int]:
    """A per-dimension value as the (height, width) pair of a 2-D convolution (a 1-D one's is of height 1)."""
    return (1, int(values[0])) if one_d else (int(values[0]), int(values[1]))


class GroupedConvolution(LayerHelper):
    """What every convolution helper shares: ``G`` from the output gradient (block-diagonal per group), ``S`` = the
    output positions per sample, and the gradient as the weight reshaped (``_as_matrix`` / ``_as_weight`` where a
    reshape does not do: a transposed convolution's swapped channels)."""

    groups: int
    module: Conv

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(self.module.out_channels // self.groups, blocks=self.groups)

    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        return conv_output_gram(g, self.groups)

    def positions(self, rows: int, batch: int) -> int:
        return rows // batch

    def unbatched(self, t: torch.Tensor) -> bool:
        return t.dim() == self.weight.dim() - 1  # (C, *spatial): the weight has the two channel dimensions

    def _as_matrix(self, weight_like: torch.Tensor) -> torch.Tensor:
        """The weight's gradient as :attr:`grad_shape` without the bias column."""
        return weight_like.reshape(*self.grad_shape[:-1], -1)

    def _as_weight(self, matrix: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_as_matrix`: the weight's own layout."""
        return matrix.reshape(self.weight.shape)

    def grad(self) -> torch.Tensor | None:
        grad = self.weight.grad
        if grad is None:
            return None
        return with_bias_column(self._as_matrix(grad), self.bias)

    def write_grad(self, update: torch.Tensor) -> None:
        split_bias_column(update, self.weight, self.bias, as_weight=self._as_weight)

    def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        grad = self.weight.grad
        if grad is None or len(self.grad_shape) != 2:
            return None
        matrix = self._as_matrix(grad)
        if matrix.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
            return None  # a copy (a channels-last gradient, a transposed convolution's swapped channels): not a view
        return matrix, None if self.bias is None else bias_grad_view(self.bias)


class ConvHelper(GroupedConvolution):
    module: Conv

    def __init__(self, module: Conv) -> None:
        super().__init__(module)
        m = module
        self.one_d = len(m.kernel_size) == 1
        self.kernel_size = spatial_pair(m.kernel_size, self.one_d)
        self.stride = spatial_pair(m.stride, self.one_d)
        self.half_rows = m.groups == 1  # (the grouped and depthwise Grams are batched products and sums)
        self.dilation = spatial_pair(m.dilation, self.one_d)
        self.groups = int(m.groups)
        zero = symmetric_zero_padding(m)
        # Zero padding the fast Gram paths handle themselves; any other padding is applied to the input first.
        self.padding: tuple[int, int] = (0, 0) if zero is None else ((0, zero[0]) if self.one_d else (zero[0], zero[1]))
        self.pad_mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        self.explicit_pad: list[int] | None = None if zero is not None else [int(p) for p in m._reversed_padding_repeated_twice]

    computes_with = ("forward", "_conv_forward")

    @property
    def a_shape(self) -> FactorShape:
        m = self.module
        per_group = (m.in_channels // self.groups) * self.kernel_size[0] * self.kernel_size[1]
        return FactorShape(per_group + (1 if self.has_bias else 0), blocks=self.groups)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """The input as ``(n, C, H, W)``, with any padding the fast paths do not handle applied."""
        if self.explicit_pad is not None:
            x = F.pad(x, self.explicit_pad, mode=self.pad_mode)
        return x.unsqueeze(2) if self.one_d else x

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """im2col rows ``(n*L, C*kh*kw)`` of the (padded, 4-D) input, channel-major as ``F.unfold`` orders them.

        Built as one strided view of the (padded) input, copied once; the
        ``F.unfold`` route copies twice (unfold, then the transpose to rows),
        which made it up to 2.3x slower at ResNet-50's 224x224 shapes.
        """
        x, out_h, out_w = self._windows(x)
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        n, c = x.shape[:2]
        s_n, s_c, s_h, s_w = x.stride()
        windows = x.as_strided(
            (n, out_h, out_w, c, kh, kw),
            (s_n, s_h * sh, s_w * sw, s_c, s_h * dh, s_w * dw),
            x.storage_offset(),
        )
        return windows.reshape(n * out_h * out_w, c * kh * kw)

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        x = self._padded(x.to(dtype))
        if self.groups > 1:
            return self._grouped_gram(x)
        shared = self.shared_gram(x)
        if shared is not None:
            return shared
        out_h, out_w = self._output_size(x)
        return summed(self._rows_gram(part) for part in self._sample_chunks(x, out_h * out_w)), x.shape[0] * out_h * out_w

    def _rows_gram(self, x: torch.Tensor) -> torch.Tensor:
        """The Gram of ``x``'s im2col rows (with the ones column of a bias)."""
        rows = self.input_rows(x)
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return symmetric_gram(rows)

    def _sample_chunks(self, x: torch.Tensor, positions: int) -> list[torch.Tensor]:
        return sample_chunks(x, positions * self.a_shape.dim * self.a_shape.blocks * x.element_size())

    def _output_size(self, x: torch.Tensor) -> tuple[int, int]:
        """The output height and width for the (4-D, before the zero padding) input."""
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = self.kernel_size, self.padding, self.stride, self.dilation
        return (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1

    def _windows(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """The zero-padded 4-D input and the output height and width."""
        out_h, out_w = self._output_size(x)
        ph, pw = self.padding
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph))
        return x, out_h, out_w

    def _grouped_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Each group's Gram of its im2col rows, as a ``(groups, a, a)`` stack (ones column included with a bias).

        Depthwise (one input channel per group): :meth:`_depthwise_gram`.
        Otherwise each group's rows are built contiguously and multiplied in
        one batched product.
        """
        x, out_h, out_w = self._windows(x)
        n, c = x.shape[:2]
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        count = n * out_h * out_w
        bias = 1 if self.has_bias else 0
        if c == self.groups:
            return self._depthwise_gram(x, out_h, out_w), count
        cg = c // self.groups

        def part_gram(part: torch.Tensor) -> torch.Tensor:
            s_n, s_c, s_h, s_w = part.stride()
            windows = part.as_strided(
                (self.groups, part.shape[0], out_h, out_w, cg, kh, kw),
                (cg * s_c, s_n, s_h * sh, s_w * sw, s_c, s_h * dh, s_w * dw),
                part.storage_offset(),
            )
            part_count = part.shape[0] * out_h * out_w
            rows = windows.reshape(self.groups, part_count, cg * kh * kw)  # one copy, each group's rows contiguous
            if bias:
                rows = torch.cat([rows, rows.new_ones(self.groups, part_count, 1)], dim=2)
            return block_gram(rows)

        return summed(part_gram(part) for part in self._sample_chunks(x, out_h * out_w)), count

    def _depthwise_gram(self, x: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
        """Per-channel Gram of the kernel-offset rows, a few channels at a time: ``(C, k+b, k+b)``.

        For a slice of channels the input at each kernel offset is copied into
        rows ``(channels, offsets, samples x positions)`` (plus a ones row with
        a bias) and multiplied by their transpose in one batched product. The
        slice holds at most :data:`DEPTHWISE_ROWS_BYTES` of rows (one channel at least), so the copy stays in cache-sized
        pieces. 3-6x faster than one elementwise product and reduction per
        offset pair (the earlier form) at MobileNetV2's shapes on CPU.
        """
        n, c = x.shape[:2]
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        k = kh * kw
        bias = 1 if self.has_bias else 0
        positions = n * out_h * out_w
        chunk = max(1, DEPTHWISE_ROWS_BYTES // max(1, (k + bias) * positions * x.element_size()))
        by_channel = x.transpose(0, 1)  # (C, n, H, W) view
        gram = x.new_empty(c, k + bias, k + bias)
        for c0 in range(0, c, chunk):
            part = by_channel[c0 : c0 + chunk]
            rows = [
                part[:, :, i * dh : i * dh + (out_h - 1) * sh + 1 : sh, j * dw : j * dw + (out_w - 1) * sw + 1 : sw]
                for i in range(kh)
                for j in range(kw)
            ]
            if bias:
                rows.append(part.new_ones(part.shape[0], n, out_h, out_w))
            stacked = torch.stack(rows, dim=1).reshape(part.shape[0], k + bias, positions)
            torch.bmm(stacked, stacked.transpose(1, 2), out=gram[c0 : c0 + chunk])
        return mirrored_upper(gram)  # exactly symmetric, as every factor

    def shared_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The rows' Gram and row count without im2col rows where there is a cheaper way.

        A 1x1 kernel without padding: the rows are the (strided) input's
        channel vectors (:func:`~spdkfac.kfac.linalg.channel_gram`). Stride 1, a
        larger kernel, on a CPU, where they pay (:meth:`SharedShiftWork.pays`):
        shared shifts (:mod:`spdkfac.kfac.conv_gram`).
        """
        if self.kernel_size == (1, 1) and self.padding == (0, 0):
            sh, sw = self.stride
            strided = x[:, :, ::sh, ::sw]
            return with_bias_row(channel_gram(strided), strided, self.has_bias)
        if self.stride != (1, 1) or x.device.type != "cpu":
            # (On a GPU the im2col rows and one product beat the shared shifts' many small products: ResNet-50's
            # 3x3 factors 2.7 ms against 30-87 ms each at 224x224, batch 64, on an H200.)
            return None
        work = self.shared_shift_work(x)
        if work is None or not work.pays(torch.get_num_threads()):
            return None  # small maps, few channels or many threads: the im2col rows' one product is cheaper
        return conv_input_gram(x, self.kernel_size, self.padding, self.dilation, self.has_bias)

    def shared_shift_work(self, x: torch.Tensor) -> SharedShiftWork | None:
        """Both routes' work for the (padded, 4-D) input of a stride-1 convolution (:mod:`~spdkfac.kfac.conv_gram`)."""
        return shared_shift_work(tuple(x.shape), self.kernel_size, self.padding, self.dilation, self.has_bias)


def conv_output_gram(g: torch.Tensor, groups: int) -> tuple[torch.Tensor, int]:
    """``G``'s Gram of a convolution's output gradient ``(n, out, *positions)`` and the row count: one row per sample
    and position, a ``(groups, og, og)`` stack of the groups' blocks when ``groups > 1``."""
    out = g.shape[1]
    rows = g.numel() // out
    if groups == 1:
        return channel_gram(g), rows
    og = out // groups
    if og == 1:  # depthwise without a channel multiplier: 1x1 blocks, the squared sums
        return g.square().sum(dim=[0, *range(2, g.dim())]).view(groups, 1, 1), rows
    # Each group's rows contiguous ((groups, rows, og), one copy), then one batched product.
    grouped = g.reshape(g.shape[0], groups, og, -1).permute(1, 0, 3, 2).reshape(groups, rows, og)
    return block_gram(grouped), rows


def sample_chunks(x: torch.Tensor, row_bytes_per_sample: int) -> list[torch.Tensor]:
    """``x`` split by samples so that each part's im2col rows take at most :data:`IM2COL_ROWS_BYTES` (one part,
    ``x`` itself, when they fit; one sample at least): a convolution's ``A`` is then the sum of the parts' Grams."""
    samples = max(1, IM2COL_ROWS_BYTES // max(1, row_bytes_per_sample))
    return [x] if samples >= x.shape[0] else [x[i : i + samples] for i in range(0, x.shape[0], samples)]


def summed(grams: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of the parts' Grams (:func:`sample_chunks`), into the first (one part: that Gram itself)."""
    total: torch.Tensor | None = None
    for gram in grams:
        total = gram if total is None else total.add_(gram)
    assert total is not None, "no part"
    return total


def block_gram(rows: torch.Tensor) -> torch.Tensor:
    """``rows_b^T rows_b`` of every block of a ``(blocks, rows, d)`` stack, exactly symmetric."""
    return mirrored_upper(rows.transpose(1, 2) @ rows)


def with_bias_row(gram: torch.Tensor, x: torch.Tensor, with_bias: bool) -> tuple[torch.Tensor, int]:
    """The Gram of ``x``'s channel rows, bordered (``with_bias``) by the Gram terms of a ones column, and the row count."""
    count = math.prod(x.shape[:1] + x.shape[2:])
    if not with_bias:
        return gram, count
    c = gram.shape[0]
    out = gram.new_empty(c + 1, c + 1)
    out[:c, :c] = gram
    sums = x.sum(dim=[0, *range(2, x.dim())], dtype=gram.dtype)  # (float32 sums of half-precision rows)
    out[c, :c] = sums
    out[:c, c] = sums
    out[c, c] = count
    return out, count
