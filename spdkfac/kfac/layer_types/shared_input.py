"""The input Gram of a Linear layer, computed once for the layers that read the same input in a row.

Modern blocks feed one tensor to several Linear layers: self-attention's q, k
and v (``nn.MultiheadAttention``'s projections, or the separate ``q_proj``,
``k_proj``, ``v_proj`` of Llama-style models), and a gated MLP's ``gate_proj``
and ``up_proj``. Their factors ``A`` are then equal, and the Gram that makes
them (``rows * in^2`` multiply-adds, about half a forward pass of the layer)
is computed for the first and copied for the next, so the factors are bitwise
those computed apart. One instance serves every Linear layer of an optimizer
(:func:`~spdkfac.kfac.layers.kfac_layers` hands it out).

"The same input" is read from the tensor: one storage, layout and version.
Inside a compiled graph (:func:`compiled_buffers`) that proves nothing:
inductor reuses a dead buffer's memory for a later tensor by plan and its
kernels write without counting a version, so there every Gram is computed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Callable

import torch

__all__ = ["SharedInputGram", "compiled_buffers"]

_COMPILED = contextvars.ContextVar("spdkfac_compiled_buffers", default=False)  # (per thread: in-process ranks)


@contextlib.contextmanager
def compiled_buffers() -> Iterator[None]:
    """Within: the hooks read a compiled graph's buffers (a tap's tensors), whose identity does not tell their values."""
    token = _COMPILED.set(True)
    try:
        yield
    finally:
        _COMPILED.reset(token)


class SharedInputGram:
    """The last Linear input's Gram, returned (a copy) to the next layer that reads the same values.

    The input is held (so its memory cannot be reused by another tensor at
    the same address) until a different input replaces it or the step ends
    (:meth:`forget`). Autograd holds it until that layer's backward anyway:
    a Linear layer saves its input for the weight's gradient.
    """

    def __init__(self) -> None:
        self._input: tuple[torch.Tensor, int] | None = None  # the input and its version when its Grams were computed
        self._grams: dict[tuple[torch.dtype, bool], tuple[torch.Tensor, int]] = {}  # (dtype, ones column) -> Gram, rows

    @staticmethod
    def _same(held: torch.Tensor, version: int, x: torch.Tensor) -> bool:
        """The same values: one storage, offset, shape and strides, and no in-place change since (views share a version)."""
        return (
            held.data_ptr() == x.data_ptr()
            and held.shape == x.shape
            and held.stride() == x.stride()
            and held.dtype == x.dtype
            and held.device == x.device
            and x._version == version
        )

    def gram(
        self, x: torch.Tensor, dtype: torch.dtype, ones_column: bool, compute: Callable[[], tuple[torch.Tensor, int]]
    ) -> tuple[torch.Tensor, int]:
        """``compute()`` (the Gram of ``x``'s rows in ``dtype``, with a ones column for a bias, and the row count), or a
        copy of the one held for the same input, dtype and column."""
        if _COMPILED.get():
            return compute()
        if self._input is None or not self._same(*self._input, x):
            self._input, self._grams = (x, x._version), {}
        key = (dtype, ones_column)
        held = self._grams.get(key)
        if held is not None:
            return held[0].clone(), held[1]
        gram, rows = compute()
        self._grams[key] = (gram.clone(), rows)  # (the caller scales its Gram in place)
        return gram, rows

    def forget(self) -> None:
        self._input, self._grams = None, {}
