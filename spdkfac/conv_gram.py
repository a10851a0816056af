"""The Gram matrix of a stride-1 convolution's im2col rows, without building them.

For a ``kh x kw`` kernel the im2col rows hold ``K = kh*kw`` shifted copies
of the input, so their Gram matrix ``A`` (the K-FAC input factor times the
number of rows) is made of ``K x K`` blocks of size ``C x C``. Block
``(a, b)`` sums ``x[q] x[q + δ]^T`` over the input pixels ``q`` that kernel
offset ``a`` visits, with ``δ`` the distance from offset ``a`` to offset
``b`` (pixels outside the image are the zero padding). For stride 1 that set
of pixels is the whole image minus at most a few border rows and columns, so

    block(a, b) = S_δ - (the same sum over the border strips offset a misses)

where ``S_δ = Σ_q x[q] x[q + δ]^T`` over the whole image depends only on
``δ``. The upper blocks need ``(2kh-1)(2kw-1)/2`` distinct shifts instead of
``K(K+1)/2`` blocks: for a 3x3 kernel 13 ``C x C`` products over the
image replace the ``9C x 9C`` Gram (13 C² per pixel instead of 40.5, or 20
computing only its upper half), plus small products over the border strips.
Same sums, reassociated: the result equals the im2col Gram to rounding (and
is exactly symmetric).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .linalg import mirror_upper_

__all__ = ["conv_input_gram"]

Rect = Tuple[int, int, int, int]  # rows [r0, r1) x cols [c0, c1) of the image


def _missed_strips(r0: int, r1: int, c0: int, c1: int, h: int, w: int) -> List[Rect]:
    """The image pixels outside rows [r0, r1) x cols [c0, c1), as disjoint rectangles."""
    r0, r1, c0, c1 = max(r0, 0), min(r1, h), max(c0, 0), min(c1, w)
    strips = [(0, r0, 0, w), (r1, h, 0, w), (r0, r1, 0, c0), (r0, r1, c1, w)]
    return [(a, b, c, d) for a, b, c, d in strips if a < b and c < d]


def conv_input_gram(
    x: torch.Tensor,
    kernel_size: Tuple[int, int],
    padding: Tuple[int, int],
    dilation: Tuple[int, int],
    with_bias: bool = False,
) -> Optional[Tuple[torch.Tensor, int]]:
    """``rows^T rows`` of the im2col rows (``F.unfold`` order) of a stride-1 convolution's input, and the row count.

    ``x`` is ``(n, C, H, W)``. With ``with_bias`` the rows get a trailing
    ones column (its Gram row holds the column sums and the row count).
    Returns None when the kernel is 1x1 (the rows are the input itself: no
    shifts to share) or the output would be empty.
    """
    (kh, kw), (ph, pw), (dh, dw) = kernel_size, padding, dilation
    n, c, h, w = x.shape
    out_h, out_w = h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)
    k = kh * kw
    if k == 1 or out_h <= 0 or out_w <= 0:
        return None
    # Offset a = (i, j) reads image pixel (p_r + i*dh - ph, p_c + j*dw - pw) for output position p.
    offsets = [(i * dh - ph, j * dw - pw) for i in range(kh) for j in range(kw)]
    pairs = [(a, b) for a in range(k) for b in range(a, k)]
    shift_of = {(a, b): (offsets[b][0] - offsets[a][0], offsets[b][1] - offsets[a][1]) for a, b in pairs}
    shifts = sorted(set(shift_of.values()))

    # Channels-last image inside a zero frame wide enough for every shift.
    fh, fw = dh * (kh - 1), dw * (kw - 1)
    framed = F.pad(x, (fw, fw, fh, fh)).permute(0, 2, 3, 1)  # (n, h + 2fh, w + 2fw, C) view

    def pixels(rect: Rect) -> torch.Tensor:
        r0, r1, c0, c1 = rect
        return framed[:, fh + r0 : fh + r1, fw + c0 : fw + c1, :].reshape(-1, c)

    def products(rect: Rect, wanted: List[Tuple[int, int]]) -> List[torch.Tensor]:
        """``Σ_{q in rect} x[q] x[q + δ]^T`` for each shift δ (one GEMM each: measured faster than one
        GEMM on the shifted copies concatenated, whose interleaving copy cost more than the products)."""
        r0, r1, c0, c1 = rect
        left = pixels(rect).T
        return [left @ framed[:, fh + r0 + dr : fh + r1 + dr, fw + c0 + dc : fw + c1 + dc, :].reshape(-1, c)
                for dr, dc in wanted]

    whole: Rect = (0, h, 0, w)
    full = dict(zip(shifts, products(whole, shifts)))  # S_δ over the whole image

    # What each offset misses: the border strips outside the pixels it visits.
    corrections: Dict[Tuple[int, int], torch.Tensor] = {}
    col_sums = pixels(whole).sum(dim=0) if with_bias else None
    offset_sums: List[torch.Tensor] = []
    for a, (orow, ocol) in enumerate(offsets):
        strips = _missed_strips(orow, orow + out_h, ocol, ocol + out_w, h, w)
        partners = range(a, k)  # the upper blocks of row a
        for rect in strips:
            for b, part in zip(partners, products(rect, [shift_of[(a, b)] for b in partners])):
                corrections[(a, b)] = corrections[(a, b)].add_(part) if (a, b) in corrections else part
        if with_bias:
            s = col_sums.clone()
            for rect in strips:
                s -= pixels(rect).sum(dim=0)
            offset_sums.append(s)

    count = n * out_h * out_w
    dim = c * k + (1 if with_bias else 0)
    gram = x.new_empty(dim, dim)
    body = gram[: c * k, : c * k].view(c, k, c, k)  # [channel, offset, channel', offset'] as F.unfold orders them
    for a, b in pairs:
        block = full[shift_of[(a, b)]]
        if (a, b) in corrections:
            block = block - corrections[(a, b)]
        body[:, a, :, b] = block
        if a != b:
            body[:, b, :, a] = block.T
        else:
            body[:, a, :, a] = mirror_upper_(body[:, a, :, a].clone())  # exactly symmetric, as the plain Gram
    if with_bias:
        sums = torch.stack(offset_sums, dim=1).reshape(-1)  # [channel, offset]
        gram[-1, :-1] = sums
        gram[:-1, -1] = sums
        gram[-1, -1] = count
    return gram, count
