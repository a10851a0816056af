"""torch.distributed engine: gloo on CPU, NCCL on GPU, launched with ``torchrun``."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .base import CommBackend, Handle, check_gather_counts
from .device import worker_device

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Work

__all__ = ["TorchDistributedBackend"]


class _TorchHandle:
    __slots__ = ("_divisor", "_tensor", "_work")

    def __init__(self, work: Work | None, tensor: torch.Tensor, divisor: int) -> None:
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


class _TorchGatherHandle:
    """``all_gather`` into equal padded blocks; on ``wait()`` each block's segment is copied into place."""

    __slots__ = ("_blocks", "_counts", "_offsets", "_out", "_work")

    def __init__(self, work: Work | None, blocks: list[torch.Tensor], out: torch.Tensor, offsets: list[int], counts: Sequence[int]) -> None:
        self._work, self._blocks, self._out, self._offsets, self._counts = work, blocks, out, offsets, list(counts)

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        for block, start, count in zip(self._blocks, self._offsets, self._counts):
            self._out[start : start + count].copy_(block[:count])
        self._work = None

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


_EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=120)


def _shut_down_process_group() -> None:
    """Tear down the process group this module created, once every rank is done with it.

    Left to interpreter shutdown, a gloo process group can be destroyed while
    its worker threads are still joinable, and the process then aborts
    ("terminate called without an active exception") after all its work is
    done. So at exit each rank first waits for the others (a rank that exits
    early must not close its sockets under a peer still communicating), then
    destroys the group. After an uncaught exception the barrier is skipped:
    the peers may be blocked in a different collective, and the launcher stops
    them anyway.
    """
    if not dist.is_initialized():
        return
    failed = getattr(sys, "last_value", None) is not None
    try:
        if not failed and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
            else:
                dist.barrier()
    except Exception as exc:  # a peer died or is stuck: still release our resources
        print(f"[spdkfac] exit barrier failed on rank {dist.get_rank()}: {exc}", file=sys.stderr)
    finally:
        dist.destroy_process_group()


class TorchDistributedBackend(CommBackend):
    """Collectives through the default ``torch.distributed`` process group.

    If no process group exists yet, one is created from the ``env://``
    variables ``torchrun`` sets, with NCCL when CUDA is available and gloo
    otherwise (override with ``SPDKFAC_DIST_BACKEND``; with NCCL the rank's
    GPU, ``LOCAL_RANK``, is made current first), and destroyed
    cleanly at interpreter exit after all ranks arrive; a group the caller
    created stays the caller's to destroy.
    """

    name = "torch"

    def __init__(self) -> None:
        if not dist.is_available():  # pragma: no cover
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        if not dist.is_initialized():
            from torch.distributed.distributed_c10d import PrefixStore
            from torch.distributed.rendezvous import rendezvous

            engine = os.environ.get("SPDKFAC_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
            if engine == "nccl":
                worker_device("cuda")  # NCCL communicates on the current device: this rank's own GPU
            # The rendezvous store outlives a torchrun restart: keys of the lost attempt's workers (their gloo
            # addresses) would be read by the new ones, which then fail to connect. One namespace per attempt.
            store, rank, size = next(rendezvous("env://"))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend=engine, store=PrefixStore(f"spdkfac/attempt_{attempt}", store), rank=rank, world_size=size)
            atexit.register(_shut_down_process_group)

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

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        offsets = check_gather_counts(tensor, counts, self.size, name)
        width = max(counts)  # all_gather moves equal blocks: pad every segment to the longest
        mine = tensor.new_zeros(width)
        mine[: counts[self.rank]].copy_(tensor[offsets[self.rank] : offsets[self.rank] + counts[self.rank]])
        blocks = [tensor.new_empty(width) for _ in range(self.size)]
        work = dist.all_gather(blocks, mine, async_op=True)
        return _TorchGatherHandle(work, blocks, tensor, offsets, counts)

    def barrier(self) -> None:
        dist.barrier()
