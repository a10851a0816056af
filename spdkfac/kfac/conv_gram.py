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

On small maps and few channels the many small products and their Python cost
outweigh the saving: :func:`shared_shift_work` counts both routes' work and
says which is cheaper (``python -m benchmarks.conv_factor`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .linalg import mirror_upper_

__all__ = ["SharedShiftWork", "conv_input_gram", "shared_shift_work"]

Rect = tuple[int, int, int, int]  # rows [r0, r1) x cols [c0, c1) of the image
Shift = tuple[int, int]

#: The cost model of :meth:`SharedShiftWork.pays`, in multiply-adds of one large product (the im2col Gram's), fitted
#: on 3x3 and 5x5 kernels, 2x2 to 16x16 maps, 8 to 512 channels, batch 8 and 64, and 11 real layers, on 1 and 2
#: threads (benchmarks/conv_factor.py): a shared shift's small products run at this fraction of that rate,
SMALL_PRODUCT_SLOWDOWN = 2.5
#: each product and block costs about this much in Python and dispatch on one thread,
PER_OPERATION = 3e5
#: each ``C x C`` product and block written costs this much per element (on few pixels they are memory bound),
PER_WRITTEN_ELEMENT = 40.0
#: and these fixed costs grow by this much of themselves with each further thread: the large product runs on all the
#: threads, while each small operation pays for starting them and gains little (measured: the im2col Gram 1.5-1.8x
#: faster on 2 threads, the shared shifts on few channels not at all).
PER_THREAD_GROWTH = 5.0


@dataclass(frozen=True)
class SharedShiftWork:
    """The work of a stride-1 convolution's ``A`` by shared shifts and by the im2col rows' one product."""

    multiply_adds: int  # of the shifts' products over the whole image and the border strips' products
    products: int
    blocks: int  # the upper ``C x C`` blocks assembled
    channels: int
    im2col_multiply_adds: int  # rows x (their width)²

    def cost(self, threads: int = 1) -> float:
        """The shared shifts' cost in multiply-adds of one large product, on ``threads`` threads."""
        operations = self.products + self.blocks
        written = self.channels**2 * (self.products + 2 * self.blocks)
        fixed = PER_OPERATION * operations + PER_WRITTEN_ELEMENT * written
        return SMALL_PRODUCT_SLOWDOWN * self.multiply_adds + (1.0 + PER_THREAD_GROWTH * (max(1, threads) - 1)) * fixed

    def pays(self, threads: int = 1) -> bool:
        """Whether the shared shifts are expected to be faster than the im2col rows' one product (on a CPU, with
        ``threads`` threads for torch's operations)."""
        return self.cost(threads) < self.im2col_multiply_adds


@dataclass(frozen=True)
class _Geometry:
    """Where each kernel offset reads, the shift between each pair of offsets, and the strips each offset misses."""

    offsets: tuple[Shift, ...]
    pairs: tuple[tuple[int, int], ...]
    shift_of: dict[tuple[int, int], Shift]  # (read only: cached)
    shifts: tuple[Shift, ...]
    strips: tuple[tuple[Rect, ...], ...]  # per offset
    out_h: int
    out_w: int


@lru_cache(maxsize=1024)
def _geometry(h: int, w: int, kernel_size: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> _Geometry:
    (kh, kw), (ph, pw), (dh, dw) = kernel_size, padding, dilation
    out_h, out_w = h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)
    k = kh * kw
    # Offset a = (i, j) reads image pixel (p_r + i*dh - ph, p_c + j*dw - pw) for output position p.
    offsets = tuple((i * dh - ph, j * dw - pw) for i in range(kh) for j in range(kw))
    pairs = tuple((a, b) for a in range(k) for b in range(a, k))
    shift_of = {(a, b): (offsets[b][0] - offsets[a][0], offsets[b][1] - offsets[a][1]) for a, b in pairs}
    strips = tuple(tuple(_missed_strips(orow, orow + out_h, ocol, ocol + out_w, h, w)) for orow, ocol in offsets)
    return _Geometry(offsets, pairs, shift_of, tuple(sorted(set(shift_of.values()))), strips, out_h, out_w)


@lru_cache(maxsize=1024)
def shared_shift_work(
    shape: tuple[int, ...],
    kernel_size: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    with_bias: bool = False,
) -> SharedShiftWork | None:
    """Both routes' work for an ``(n, C, H, W)`` input (None where :func:`conv_input_gram` would return None).

    Cached: a layer sees the same shapes step after step, and counting the strips' products costs ~0.2 ms."""
    n, c, h, w = shape
    k = kernel_size[0] * kernel_size[1]
    g = _geometry(h, w, kernel_size, padding, dilation)
    if k == 1 or g.out_h <= 0 or g.out_w <= 0:
        return None
    gh, gw = dilation[0] * (kernel_size[0] - 1), dilation[1] * (kernel_size[1] - 1)
    hb, wb = h + gh, w + gw
    span = (n - 1) * hb * wb + (h - 1) * wb + w  # the columns each shift's product reads (as conv_input_gram lays them)
    multiply_adds, products = len(g.shifts) * c * c * span, len(g.shifts)
    strip_products: set[tuple[Rect, Shift]] = set()
    for a in range(k):
        for rect in g.strips[a]:
            for b in range(a, k):
                key = (rect, g.shift_of[(a, b)])
                if key not in strip_products:
                    strip_products.add(key)
                    multiply_adds += c * c * n * (rect[1] - rect[0]) * (rect[3] - rect[2])
                    products += 1
    width = c * k + int(with_bias)
    return SharedShiftWork(multiply_adds, products, len(g.pairs), c, n * g.out_h * g.out_w * width * width)


def _missed_strips(r0: int, r1: int, c0: int, c1: int, h: int, w: int) -> list[Rect]:
    """The image pixels outside rows [r0, r1) x cols [c0, c1), as disjoint rectangles."""
    r0, r1, c0, c1 = max(r0, 0), min(r1, h), max(c0, 0), min(c1, w)
    strips = [(0, r0, 0, w), (r1, h, 0, w), (r0, r1, 0, c0), (r0, r1, c1, w)]
    return [(a, b, c, d) for a, b, c, d in strips if a < b and c < d]


def conv_input_gram(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    with_bias: bool = False,
) -> tuple[torch.Tensor, int] | None:
    """``rows^T rows`` of the im2col rows (``F.unfold`` order) of a stride-1 convolution's input, and the row count.

    ``x`` is ``(n, C, H, W)``. With ``with_bias`` the rows get a trailing
    ones column (its Gram row holds the column sums and the row count).
    Returns None when the kernel is 1x1 (the rows are the input itself: no
    shifts to share) or the output would be empty.
    """
    (kh, kw), (dh, dw) = kernel_size, dilation
    n, c, h, w = x.shape
    geometry = _geometry(h, w, kernel_size, padding, dilation)
    out_h, out_w = geometry.out_h, geometry.out_w
    k = kh * kw
    if k == 1 or out_h <= 0 or out_w <= 0:
        return None
    pairs, shift_of, shifts = geometry.pairs, geometry.shift_of, geometry.shifts

    # Channel-major images in one flat buffer, each followed by zero gap rows and every row by zero gap
    # columns wide enough for every shift, with zero margins before and after. A shift by (dr, dc) is then
    # one flat offset: wherever it leaves an image it reads a zero (a gap, a margin or a neighbour's gap),
    # so S_δ is a single GEMM over one contiguous span, with no copy per shift.
    gh, gw = dh * (kh - 1), dw * (kw - 1)
    hb, wb = h + gh, w + gw
    margin = gh * wb + gw
    span = n * hb * wb
    flat = x.new_zeros(c, margin + span + margin)
    flat[:, margin : margin + span].view(c, n, hb, wb)[:, :, :h, :w] = x.transpose(0, 1)
    lo, hi = margin, margin + (n - 1) * hb * wb + (h - 1) * wb + w

    def region(rect: Rect, dr: int = 0, dc: int = 0) -> torch.Tensor:
        """The pixels of ``rect`` (every sample), moved by (dr, dc), as a ``C x pixels`` copy."""
        r0, r1, c0, c1 = rect
        start = margin + (r0 + dr) * wb + (c0 + dc)
        return flat.as_strided((c, n, r1 - r0, c1 - c0), (flat.stride(0), hb * wb, wb, 1), flat.storage_offset() + start).reshape(c, -1)

    full = {(dr, dc): flat[:, lo:hi] @ flat[:, lo + dr * wb + dc : hi + dr * wb + dc].transpose(0, 1) for dr, dc in shifts}

    # What each offset misses: the border strips outside the pixels it visits. Offsets that miss the same
    # strip share its products for equal shifts.
    corrections: dict[tuple[int, int], torch.Tensor] = {}
    strip_products: dict[tuple[Rect, tuple[int, int]], torch.Tensor] = {}
    strip_pixels: dict[Rect, torch.Tensor] = {}
    col_sums = x.sum(dim=(0, 2, 3)) if with_bias else None
    offset_sums: list[torch.Tensor] = []
    for a in range(k):
        strips = geometry.strips[a]
        for rect in strips:
            if rect not in strip_pixels:
                strip_pixels[rect] = region(rect)
            for b in range(a, k):  # the upper blocks of row a
                delta = shift_of[(a, b)]
                key = (rect, delta)
                if key not in strip_products:
                    strip_products[key] = strip_pixels[rect] @ region(rect, *delta).transpose(0, 1)
                part = strip_products[key]
                corrections[(a, b)] = corrections[(a, b)] + part if (a, b) in corrections else part
        if col_sums is not None:  # with_bias
            s = col_sums.clone()
            for rect in strips:
                s -= strip_pixels[rect].sum(dim=1)
            offset_sums.append(s)

    blocks: dict[tuple[int, int], torch.Tensor] = {}
    for a, b in pairs:
        block = full[shift_of[(a, b)]]
        if (a, b) in corrections:
            block = block - corrections[(a, b)]
        blocks[(a, b)] = mirror_upper_(block.clone()) if a == b else block  # exactly symmetric, as the plain Gram

    count = n * out_h * out_w
    dim = c * k + (1 if with_bias else 0)
    gram = x.new_empty(dim, dim)
    body = gram[: c * k, : c * k].view(c, k, c, k)  # [channel, offset, channel', offset'] as F.unfold orders them
    for a in range(k):
        # The rows of offset a, built contiguously ([channel', offset'] interleaved) and written as whole
        # rows, instead of two element-strided writes per block (~15% less assembly time at C=512).
        row = [blocks[(a, b)] if a <= b else blocks[(b, a)].T for b in range(k)]
        body[:, a] = torch.stack(row, dim=2)
    if with_bias:
        sums = torch.stack(offset_sums, dim=1).reshape(-1)  # [channel, offset]
        gram[-1, :-1] = sums
        gram[:-1, -1] = sums
        gram[-1, -1] = count
    return gram, count
