"""Linear-algebra kernels of K-FAC: symmetric packing and damped SPD inversion.

Kronecker factors and their inverses are symmetric, so only the upper triangle
(``d(d+1)/2`` elements) ever travels over the network. The inversion uses a
Cholesky factorisation, which is both the fastest and the most stable inverse
for a symmetric positive-definite matrix. On a GPU the kernels take the
forms measured fastest there (one product, one gather; cupy's ``syevd`` for
small eigendecompositions); on the CPU the blocked forms tuned for caches.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .tensor_cores import HALF_DTYPES, gram_of_half_rows

__all__ = [
    "all_finite",
    "channel_gram",
    "checks_by_norm",
    "cupy_available",
    "invert_clamped_eigh",
    "invert_spd",
    "mirror_upper_",
    "mirrored_upper",
    "non_finite_indices",
    "pack_upper",
    "symmetric_eigh",
    "symmetric_gram",
    "triangle_size",
    "unpack_upper",
]


def triangle_size(dim: int) -> int:
    """Number of elements in the upper triangle (with diagonal) of a ``dim x dim`` matrix."""
    return dim * (dim + 1) // 2


# Block edge of the blocked symmetric kernels below. Transposing a 256-wide
# strip at a time keeps both the read and the write side in cache, and 256
# columns are wide enough for GEMM to run at full speed.
_BLOCK = 256


def mirrored_upper(matrix: torch.Tensor) -> torch.Tensor:
    """A new matrix (or ``(..., d, d)`` stack) with each upper triangle kept and mirrored into the lower one."""
    return torch.triu(matrix) + torch.triu(matrix, 1).transpose(-1, -2)


def mirror_upper_(matrix: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """Overwrite the strict lower triangle of a square matrix with the transpose of its upper one, in place.

    Works strip by strip (``block`` rows at a time): an element-wise column
    write of a large matrix misses the cache on every element (184 ms for
    d=4608 on the reference CPU), block transposes do not.
    """
    if matrix.device.type != "cpu":  # a GPU: two whole-matrix kernels, not two launches per strip
        return matrix.copy_(mirrored_upper(matrix))
    dim = matrix.shape[0]
    for start in range(0, dim, block):
        stop = min(start + block, dim)
        diag = matrix[start:stop, start:stop]
        diag.copy_(mirrored_upper(diag))
        if stop < dim:
            matrix[stop:, start:stop].copy_(matrix[start:stop, stop:].transpose(0, 1))
    return matrix


def symmetric_gram(rows: torch.Tensor) -> torch.Tensor:
    """``rows.T @ rows``, exactly symmetric, computing only the blocks on and above the diagonal.

    A Kronecker factor is such a Gram matrix of the layer's input (or output
    gradient) rows. A full GEMM computes both halves; multiplying each strip
    of columns only with the columns from its own diagonal onwards saves up
    to half the flops (1.3-1.6x faster for the conv factors of ResNet-50 at
    224x224 on the reference CPU) and yields the same values in the upper
    triangle, mirrored into the lower one.
    """
    dim = rows.shape[1]
    if rows.device.type != "cpu":  # a GPU: one product (measured on an H200: strips cost launches, not flops)
        if rows.dtype in HALF_DTYPES:  # half-precision rows (autocast): exact products into float32
            return mirror_upper_(gram_of_half_rows(rows))
        return mirror_upper_(rows.transpose(0, 1) @ rows)
    block = 128 if dim <= 768 else _BLOCK
    if dim < 2 * block:  # one strip: a full GEMM, made exactly symmetric
        return mirror_upper_(rows.transpose(0, 1) @ rows, block)
    out = rows.new_empty(dim, dim)
    for start in range(0, dim, block):
        stop = min(start + block, dim)
        out[start:stop, start:] = rows[:, start:stop].transpose(0, 1) @ rows[:, start:]
    return mirror_upper_(out, block)


# Positions per sample from which multiplying each sample's (C, positions) block in place beats copying the
# tensor into rows first (CPU; measured at ResNet-50's 224x224 shapes: 1.8x faster at 56x56, even at ~12x12).
_PER_SAMPLE_MIN_POSITIONS = 128


def channel_gram(x: torch.Tensor) -> torch.Tensor:
    """``rows.T @ rows`` for the rows ``x.movedim(1, -1).reshape(-1, C)`` of an ``(n, C, *positions)`` tensor.

    These rows (one per sample and position) give the factors of 1x1
    convolutions and the ``G`` factors of every convolution. In PyTorch's
    default NCHW layout they are not a view: the permuting copy cost as much
    as the product at 56x56 maps. Channels-last tensors are read as rows
    directly; NCHW ones on the CPU with enough positions are multiplied one
    sample at a time in place (``Σ_n x_n x_nᵀ``, each ``x_n`` a contiguous
    ``C x positions`` block); otherwise the channel-major transpose is copied
    in contiguous runs. Upper strips only, mirrored, as :func:`symmetric_gram`.
    """
    n, c = x.shape[:2]
    last = x.movedim(1, -1)
    if last.is_contiguous():
        return symmetric_gram(last.reshape(-1, c))
    if x.is_contiguous() and x.device.type == "cpu" and math.prod(x.shape[2:]) >= _PER_SAMPLE_MIN_POSITIONS:
        block = 128 if c <= 768 else _BLOCK
        spans = [(0, c)] if c < 2 * block else [(start, min(start + block, c)) for start in range(0, c, block)]
        out = x.new_zeros(c, c)
        for sample in x.reshape(n, c, -1):
            for start, stop in spans:
                out[start:stop, start:].addmm_(sample[start:stop], sample[start:].transpose(0, 1))
        return mirror_upper_(out, block)
    channel_major = x.transpose(0, 1).reshape(c, -1)  # copies runs of contiguous positions
    return symmetric_gram(channel_major.transpose(0, 1))


_TRIU_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def _flat_upper_indices(dim: int, device: torch.device) -> torch.Tensor:
    """Flat (row-major) indices of the upper triangle, cached per dimension and device."""
    key = (dim, str(device))
    idx = _TRIU_CACHE.get(key)
    if idx is None:
        rows, cols = torch.triu_indices(dim, dim, device=device)
        idx = rows * dim + cols
        _TRIU_CACHE[key] = idx
    return idx


# Above this dimension, copying contiguous row segments beats one gather with a
# d(d+1)/2-long int64 index (measured on CPU: 3x faster at d=4608, slower below ~2000).
_ROWWISE_MIN_DIM = 2048


def pack_upper(matrix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the upper triangle of a square matrix, row by row, into a flat vector (``out`` if given)."""
    dim = matrix.shape[0]
    if out is None:
        out = matrix.new_empty(triangle_size(dim))
    if dim >= _ROWWISE_MIN_DIM and matrix.device.type == "cpu":  # (on a GPU one gather beats dim launches)
        offset = 0
        for i in range(dim):
            n = dim - i
            out[offset : offset + n].copy_(matrix[i, i:])
            offset += n
        return out
    idx = _flat_upper_indices(dim, matrix.device)
    torch.index_select(matrix.reshape(-1), 0, idx, out=out)
    return out


def unpack_upper(packed: torch.Tensor, dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the full symmetric ``dim x dim`` matrix from its packed upper triangle."""
    if packed.numel() != triangle_size(dim):
        raise ValueError(f"packed triangle has {packed.numel()} elements, expected {triangle_size(dim)} for dim={dim}")
    if out is None:
        out = packed.new_empty(dim, dim)
    if dim >= _ROWWISE_MIN_DIM and packed.device.type == "cpu":
        offset = 0
        for i in range(dim):
            n = dim - i
            out[i, i:].copy_(packed[offset : offset + n])
            offset += n
        return mirror_upper_(out)
    idx = _flat_upper_indices(dim, packed.device)
    out.view(-1).index_copy_(0, idx, packed)
    return mirror_upper_(out)  # the lower triangle is overwritten, never read


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or infinite (:func:`non_finite_indices` of the one tensor)."""
    return not non_finite_indices([tensor])


def checks_by_norm(device: torch.device) -> bool:
    """Whether :func:`non_finite_indices` reads each tensor's largest magnitude (one multi-tensor pass: off the CPU)
    rather than its sum."""
    return device.type != "cpu"


def non_finite_indices(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The positions of the tensors that hold a NaN or an infinity, with one host synchronisation in all.

    One value per tensor decides, gathered and read at once: on a GPU the
    largest magnitude (``inf``-norm: one fused pass over all tensors of a
    device and dtype; not finite exactly when the tensor holds a NaN or an
    infinity), on the CPU the sum (4-10x faster there than the norm), with
    the tensors whose sum is not finite (an overflow, possibly) checked
    element by element.
    """
    if not tensors:
        return []
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    home = tensors[0].device  # the flags are gathered here: one host sync below, not one per group
    flags, order = [], []
    for (device, _), positions in groups.items():
        group = [tensors[i].detach() for i in positions]
        values = torch._foreach_norm(group, math.inf) if checks_by_norm(device) else [t.sum() for t in group]
        flags.append(torch.isfinite(torch.stack(values)).to(home))
        order += positions
    finite = torch.cat(flags)
    if bool(finite.all()):  # the one read-back of the usual, all-finite case
        return []
    suspects = [order[k] for k, ok in enumerate(finite.tolist()) if not ok]
    # A largest magnitude decides; a sum that is not finite may be an overflow of finite values, checked element-wise.
    return sorted(i for i in suspects if checks_by_norm(tensors[i].device) or not bool(torch.isfinite(tensors[i]).all()))


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """True when cupy imports and sees a CUDA device."""
    try:
        import cupy
        import cupyx.linalg  # noqa: F401

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # pragma: no cover - depends on the machine
        return False


def invert_spd(matrix: torch.Tensor, damping: float, use_cupy: bool = False) -> torch.Tensor:
    """Return ``(matrix + damping * I)^-1`` for a symmetric positive semi-definite matrix.

    Uses a Cholesky factorisation: ``torch.linalg.cholesky`` +
    ``torch.cholesky_inverse``, or with ``use_cupy`` on CUDA (cupy installed)
    cuSOLVER's ``potrf``/``potrs`` through ``cupyx.linalg.invh``. The default
    follows the measurement: on an H200, torch.linalg inverted every
    ResNet-50 factor dimension faster (a whole stage 131 ms against 159 ms,
    benchmarks/RESULTS.md). The result is symmetrised so that packing its
    upper triangle loses nothing.

    Raises:
        torch.linalg.LinAlgError: if the damped matrix is not positive definite
            (damping too small for a rank-deficient factor).
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"invert_spd expects a square matrix, got shape {tuple(matrix.shape)}")
    damped = matrix.clone()
    damped.diagonal().add_(damping)
    if use_cupy and damped.is_cuda and cupy_available():  # pragma: no cover - needs a GPU
        import cupy
        import cupyx.linalg
        from torch.utils.dlpack import from_dlpack

        with _on_torch_stream(damped.device):
            inv_cp = cupyx.linalg.invh(cupy.from_dlpack(damped))
            inv = from_dlpack(inv_cp)
    else:
        chol = torch.linalg.cholesky(damped)
        inv = torch.cholesky_inverse(chol)
    # Exactly symmetric, the lower triangle copied from the upper one, and row-major: packing keeps only the
    # upper triangle and unpacking builds a row-major matrix, so every rank then holds the same values in the
    # same layout whether it inverted or received the inverse. (cholesky_inverse returns a column-major
    # matrix; a product with it rounds differently from one with the row-major copy for some shapes.)
    return mirror_upper_(inv.contiguous())


def invert_clamped_eigh(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """``(F₊ + damping * I)^-1`` of a symmetric matrix (or a ``(blocks, d, d)`` stack), through ``eigh``.

    ``F₊`` is ``F`` with its negative eigenvalues set to 0: the nearest
    positive semi-definite matrix, which is what a Gram factor is in exact
    arithmetic (its negative eigenvalues are rounding, ``~ eps * scale``).
    This is the inverse the eigen method implies for a factor, and it cannot
    fail where :func:`invert_spd`'s Cholesky does: the damping is added to
    clamped eigenvalues, never to an indefinite matrix. About 10x the
    Cholesky's cost on the CPU: the inverse method's fallback only
    (:class:`~spdkfac.kfac.methods.inverse.InverseMethod`). The result is
    exactly symmetric and row-major, as :func:`invert_spd`'s.
    """
    d, q = symmetric_eigh(matrix)
    scaled = q / (d.clamp_min(0.0) + damping).unsqueeze(-2)
    return mirrored_upper(scaled @ q.transpose(-1, -2))


#: Dimensions up to which cuSOLVER's ``syevd`` through cupy beats ``torch.linalg.eigh`` on CUDA (on an H200:
#: 3.0x at 512, 2.3x at 256, 1.3x at 128; even at 576 and above, where torch.linalg uses the same solver).
CUPY_EIGH_MAX_DIM = 512


def _on_torch_stream(device: torch.device) -> Any:  # pragma: no cover - needs a GPU
    """A context in which cupy launches on torch's current stream of ``device`` (so no synchronisation is needed)."""
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ExternalStream: cupy 14 names Stream.from_external
        return cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh(matrix)``: ascending eigenvalues and column eigenvectors of a symmetric matrix (or stack).

    On CUDA, one matrix of dimension up to :data:`CUPY_EIGH_MAX_DIM` goes to
    cuSOLVER's ``syevd`` through cupy when cupy is installed, where that was
    measured faster; everything else to ``torch.linalg.eigh``.
    """
    if matrix.is_cuda and matrix.dim() == 2 and matrix.shape[0] <= CUPY_EIGH_MAX_DIM and cupy_available():  # pragma: no cover
        import cupy
        from torch.utils.dlpack import from_dlpack

        with _on_torch_stream(matrix.device):
            d, q = cupy.linalg.eigh(cupy.from_dlpack(matrix.contiguous()))
            return from_dlpack(d), from_dlpack(q)
    d, q = torch.linalg.eigh(matrix)
    return d, q
