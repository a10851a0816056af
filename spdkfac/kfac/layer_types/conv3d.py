"""``nn.Conv3d``: im2col rows of volumes, any stride, dilation, padding mode and groups.

The maths is the 2-D convolution's (:mod:`spdkfac.kfac.layer_types.conv`):
``A`` from the patches ``(C/groups) x kd x kh x kw`` (channel-major, as the
weight stores them), one row per sample and output voxel, ``G`` from the
output gradient, block-diagonal per group. The rows are one strided view of
the (padded) input, copied once; the 2-D fast paths (shared shifts, the
depthwise batched Gram) are not used.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..factor_shape import FactorShape
from ..linalg import channel_gram, symmetric_gram
from .conv import GroupedConvolution, block_gram, sample_chunks, summed, symmetric_zero_padding, with_bias_row

__all__ = ["Conv3dHelper"]


class Conv3dHelper(GroupedConvolution):
    module: nn.Conv3d

    def __init__(self, module: nn.Conv3d) -> None:
        super().__init__(module)
        self.kernel_size = tuple(int(k) for k in module.kernel_size)
        self.stride = tuple(int(s) for s in module.stride)
        self.dilation = tuple(int(d) for d in module.dilation)
        self.groups = int(module.groups)
        self.half_rows = self.groups == 1
        zero = symmetric_zero_padding(module)
        #: ``F.pad``'s list for the input: zeros, or the module's padding mode's own (reflect, replicate, circular).
        self.pad = [p for z in reversed(zero) for p in (z, z)] if zero is not None else list(module._reversed_padding_repeated_twice)
        self.pad_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode

    computes_with = ("forward", "_conv_forward")

    @property
    def a_shape(self) -> FactorShape:
        per_group = (self.module.in_channels // self.groups) * math.prod(self.kernel_size)
        return FactorShape(per_group + (1 if self.has_bias else 0), blocks=self.groups)

    def _output_size(self, x: torch.Tensor) -> list[int]:
        """The output's depth, height and width for the (unpadded) input."""
        padded = [size + self.pad[2 * i] + self.pad[2 * i + 1] for i, size in enumerate(reversed(x.shape[2:]))][::-1]
        return [(size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(padded, self.kernel_size, self.stride, self.dilation)]

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The patches ``(groups, n * voxels, C/groups * kd * kh * kw)`` of the padded input, one copy."""
        out = self._output_size(x)
        if any(self.pad):
            x = F.pad(x, self.pad, mode=self.pad_mode)
        n, c = x.shape[:2]
        cg = c // self.groups
        s_n, s_c, *s_space = x.stride()
        windows = x.as_strided(
            (self.groups, n, *out, cg, *self.kernel_size),
            (cg * s_c, s_n, *(st * s for st, s in zip(s_space, self.stride)), s_c, *(st * d for st, d in zip(s_space, self.dilation))),
            x.storage_offset(),
        )
        return windows.reshape(self.groups, n * math.prod(out), cg * math.prod(self.kernel_size))

    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        x = x.to(dtype)
        if self.groups == 1 and math.prod(self.kernel_size) == 1 and not any(self.pad):
            strided = x[:, :, :: self.stride[0], :: self.stride[1], :: self.stride[2]]  # a 1x1x1 kernel: the voxels
            return with_bias_row(channel_gram(strided), strided, self.has_bias)
        voxels = math.prod(self._output_size(x))
        parts = sample_chunks(x, voxels * self.a_shape.dim * self.groups * x.element_size())  # a few samples at a time
        return summed(self._rows_gram(part) for part in parts), x.shape[0] * voxels

    def _rows_gram(self, x: torch.Tensor) -> torch.Tensor:
        """The Gram of ``x``'s patches (with the ones column of a bias), per group."""
        rows = self.input_rows(x)
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(self.groups, rows.shape[1], 1)], dim=2)
        return symmetric_gram(rows[0]) if self.groups == 1 else block_gram(rows)
