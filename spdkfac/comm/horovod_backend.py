"""Horovod engine: ``allreduce_async_`` / ``broadcast_async_`` (the paper's choice)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from .base import CommBackend, Handle, check_gather_counts

__all__ = ["HorovodBackend"]


class _HorovodHandle:
    __slots__ = ("_handle", "_hvd")

    def __init__(self, hvd: ModuleType, handle: int | None) -> None:  # hvd: horovod.torch; handle: its request id
        self._hvd = hvd
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None:
            self._hvd.synchronize(self._handle)
            self._handle = None

    def done(self) -> bool:
        return self._handle is None or bool(self._hvd.poll(self._handle))


class _HorovodGatherHandle:
    """Horovod's all-gather returns a new tensor: copied into the caller's on ``wait()``."""

    __slots__ = ("_handle", "_hvd", "_out")

    def __init__(self, hvd: ModuleType, handle: int, out: torch.Tensor) -> None:
        self._hvd = hvd
        self._handle: int | None = handle
        self._out = out

    def wait(self) -> None:
        if self._handle is not None:
            self._out.copy_(self._hvd.synchronize(self._handle))
            self._handle = None

    def done(self) -> bool:
        return self._handle is None or bool(self._hvd.poll(self._handle))


class HorovodBackend(CommBackend):
    """Collectives through Horovod (initialised here if the user has not)."""

    name = "horovod"

    def __init__(self) -> None:
        try:
            import horovod.torch as hvd
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "backend='horovod' needs Horovod with PyTorch support; run scripts/setup.sh or pip install 'spdkfac[horovod]'"
            ) from exc
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd

    @property
    def rank(self) -> int:
        return int(self._hvd.rank())

    @property
    def size(self) -> int:
        return int(self._hvd.size())

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        return _HorovodHandle(self._hvd, self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Average))

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        return _HorovodHandle(self._hvd, self._hvd.broadcast_async_(tensor, root_rank=root, name=name))

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        offsets = check_gather_counts(tensor, counts, self.size, name)
        mine = tensor[offsets[self.rank] : offsets[self.rank] + counts[self.rank]]  # segments may differ in size
        return _HorovodGatherHandle(self._hvd, self._hvd.allgather_async(mine, name=name), tensor)

    def barrier(self) -> None:
        self._hvd.allreduce(torch.zeros(1), name="spdkfac.barrier")
