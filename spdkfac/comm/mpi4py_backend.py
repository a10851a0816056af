"""Raw MPI collectives through mpi4py: the baseline the performance-model benchmark compares engines with.

Not an engine the optimizer selects (``backend='auto'`` never picks it); the
benchmark uses it to measure what the MPI library alone costs, under
``mpirun -np N python -m spdkfac.perfmodels benchmark --engine mpi4py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .base import CommBackend

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["Mpi4pyEngine"]


class Mpi4pyEngine(CommBackend):
    """Raw MPI collectives through mpi4py (benchmark only: the library's own overhead baseline).

    Works on CPU tensors (their numpy views are the MPI buffers); launch with
    ``mpirun -np N python -m spdkfac.perfmodels benchmark --engine mpi4py``.
    """

    name = "mpi4py"

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError("--engine mpi4py needs mpi4py (pip install 'spdkfac[mpi]') and an MPI launch (mpirun)") from exc
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self._types = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T}

    @property
    def rank(self) -> int:
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self._comm.Get_size())

    def _buffer(self, tensor: torch.Tensor) -> np.ndarray:
        """``tensor``'s numpy view (a contiguous copy when ``tensor`` is strided)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"--engine mpi4py measures host buffers; got a {tensor.device} tensor (pass --device cpu)")
        if tensor.dtype not in self._types:
            raise TypeError(f"--engine mpi4py supports {', '.join(str(t) for t in self._types)}; got {tensor.dtype}")
        return tensor.detach().contiguous().numpy()

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> _MpiHandle:
        if not tensor.is_floating_point():
            raise TypeError(f"all-reduce averages, so it needs a floating-point tensor, got {tensor.dtype}")
        array = self._buffer(tensor)
        req = self._comm.Iallreduce(self._mpi.IN_PLACE, [array, self._types[tensor.dtype]], op=self._mpi.SUM)
        return _MpiHandle(req, tensor, array, self.size)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> _MpiHandle:
        array = self._buffer(tensor)
        return _MpiHandle(self._comm.Ibcast([array, self._types[tensor.dtype]], root=root), tensor, array, 1)

    def barrier(self) -> None:
        self._comm.Barrier()


class _MpiHandle:
    """A pending mpi4py request; on completion it averages (all-reduce) and copies a staged buffer back."""

    def __init__(self, req: MPI.Request, tensor: torch.Tensor, array: np.ndarray, divisor: int) -> None:
        self._req, self._tensor, self._array, self._divisor = req, tensor, array, divisor
        self._staged = not tensor.is_contiguous()  # ``array`` is a copy, not a view

    def _finish(self) -> None:
        if self._divisor > 1:
            self._array /= self._divisor
        if self._staged:
            self._tensor.copy_(torch.from_numpy(self._array))
        self._req = None

    def wait(self) -> None:
        if self._req is not None:
            self._req.Wait()
            self._finish()

    def done(self) -> bool:
        if self._req is not None and self._req.Test():
            self._finish()
        return self._req is None
