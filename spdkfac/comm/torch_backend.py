"""torch.distributed engine: gloo on CPU, NCCL on GPU, launched with ``torchrun``."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .base import CommBackend, Handle

__all__ = ["TorchDistributedBackend"]


class _TorchHandle:
    __slots__ = ("_work", "_tensor", "_divisor")

    def __init__(self, work, tensor: torch.Tensor, divisor: int) -> None:
        self._work = work
        self._tensor = tensor
        self._divisor = divisor

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        if self._divisor > 1:
            # gloo has no AVG reduction: sum, then divide once the sum has arrived.
            self._tensor.div_(self._divisor)
        self._work = None

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


class TorchDistributedBackend(CommBackend):
    """Collectives through the default ``torch.distributed`` process group.

    If no process group exists yet, one is created from the ``env://``
    variables ``torchrun`` sets, with NCCL when CUDA is available and gloo
    otherwise (override with ``SPDKFAC_DIST_BACKEND``).
    """

    name = "torch"

    def __init__(self) -> None:
        if not dist.is_available():  # pragma: no cover
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        if not dist.is_initialized():
            engine = os.environ.get("SPDKFAC_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(backend=engine)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return _TorchHandle(work, tensor, self.size)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        work = dist.broadcast(tensor, src=root, async_op=True)
        return _TorchHandle(work, tensor, 1)

    def barrier(self) -> None:
        dist.barrier()
