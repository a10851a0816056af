"""torch.distributed engine: gloo on CPU, NCCL on GPU, launched with ``torchrun``."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .base import CommBackend, CompletedHandle, Handle, check_gather_counts
from .device import worker_device
from .errors import DEFAULT_COLLECTIVE_TIMEOUT_S, CollectiveTimeoutError, check_collective_timeout, timeout_message
from .liveness import Liveness

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Work

__all__ = ["TorchDistributedBackend", "moves_device_tensors_only"]


def _is_timeout(exc: BaseException) -> bool:
    """gloo says "Timed out waiting 10000ms for recv operation to complete"; other engines "timeout"."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _wait(work: Work, name: str, on_timeout: Callable[[str], str]) -> None:
    """``work.wait()``; a timeout becomes a :class:`CollectiveTimeoutError` that says who did not answer."""
    try:
        work.wait()
    except RuntimeError as exc:
        if not _is_timeout(exc):
            raise
        raise CollectiveTimeoutError(on_timeout(name)) from exc


def moves_device_tensors_only(backend_name: str) -> bool:
    """Whether a process group of this torch.distributed backend refuses CPU tensors: NCCL's (``'nccl'``, or a
    per-device mapping such as ``'cuda:nccl'`` without a CPU entry); gloo, MPI, UCC and ``'cpu:gloo,cuda:nccl'``
    take them."""
    name = str(backend_name).lower()
    if ":" in name:
        return not any(entry.split(":")[0].strip() == "cpu" for entry in name.split(","))
    return name == "nccl"


class _TorchHandle:
    __slots__ = ("_divisor", "_name", "_on_timeout", "_tensor", "_work")

    def __init__(self, work: Work | None, tensor: torch.Tensor, divisor: int, name: str, on_timeout: Callable[[str], str]) -> None:
        self._work = work
        self._tensor = tensor
        self._divisor = divisor
        self._name = name
        self._on_timeout = on_timeout

    def wait(self) -> None:
        if self._work is None:
            return
        _wait(self._work, self._name, self._on_timeout)
        if self._divisor > 1:
            # gloo has no AVG reduction: sum, then divide once the sum has arrived.
            self._tensor.div_(self._divisor)
        self._work = None

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


class _TorchGatherHandle:
    """``all_gather`` into equal padded blocks; on ``wait()`` each block's segment is copied into place."""

    __slots__ = ("_blocks", "_counts", "_name", "_offsets", "_on_timeout", "_out", "_work")

    def __init__(
        self,
        work: Work | None,
        blocks: list[torch.Tensor],
        out: torch.Tensor,
        offsets: list[int],
        counts: Sequence[int],
        name: str,
        on_timeout: Callable[[str], str],
    ) -> None:
        self._work, self._blocks, self._out, self._offsets, self._counts = work, blocks, out, offsets, list(counts)
        self._name, self._on_timeout = name, on_timeout

    def wait(self) -> None:
        if self._work is None:
            return
        _wait(self._work, self._name, self._on_timeout)
        for block, start, count in zip(self._blocks, self._offsets, self._counts):
            self._out[start : start + count].copy_(block[:count])
        self._work = None

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


#: The longest the exit barrier waits, whatever the collective timeout: the ranks of a finished job arrive together.
_EXIT_BARRIER_LIMIT_S = 120.0
_leaving_on_error = threading.Event()
#: What the engine that created this process's group knows about it (its timeout, its heartbeats).
_OWN_GROUP: dict[str, Any] = {}


def skip_exit_barrier() -> None:
    """This process leaves because of an error: tear its group down at exit without waiting for the others.

    The peers may be blocked in another collective and would never reach the
    exit barrier; waiting for them would only delay the failure the launcher
    needs to see to stop the job.
    """
    _leaving_on_error.set()


def _free_unreachable_groups() -> None:
    """At exit, free the process groups that only unreachable objects still hold, while their threads can finish.

    An optimizer's parts refer to each other, so one the script let go of
    waits for the garbage collector, and with it the ``DistributedDataParallel``
    model it holds, and that model's process group, which
    ``destroy_process_group`` only unregisters. Left to interpreter shutdown,
    the group's gloo threads run on there, and one that drops the last
    reference to a Python tensor is killed taking the GIL: the finished worker
    aborts ("terminate called without an active exception"). Collected here,
    before shutdown, the group is destroyed and its threads joined.

    Not by the collector itself, though: there the last reference to a DDP
    model's group is its reducer's, whose destructor keeps the GIL while the
    group's destructor joins gloo's threads, and a thread still finishing a
    collective needs the GIL to let go of its Python tensor: a deadlock (seen
    as a worker that never exits, one run in about a hundred). So the groups'
    own Python objects are held through the collection and let go after it;
    their destructor releases the GIL while it waits for the threads.
    """
    held = [getattr(o, "process_group", None) for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel)]
    gc.collect()
    del held  # (here the groups are destroyed, the GIL released while their threads finish)


# Registered when the engine's module is first imported, before any group's shutdown handler: atexit runs it after them.
atexit.register(_free_unreachable_groups)


def _shut_down_process_group(timeout_s: float, liveness: Liveness | None) -> None:
    """Tear down the process group this module created, once every rank is done with it.

    Left to interpreter shutdown, a gloo process group can be destroyed while
    its worker threads are still joinable, and the process then aborts
    ("terminate called without an active exception") after all its work is
    done. So at exit each rank first waits for the others (a rank that exits
    early must not close its sockets under a peer still communicating), then
    destroys the group. After an uncaught exception (or :func:`skip_exit_barrier`)
    the barrier is skipped: the peers may be blocked in a different
    collective, and the launcher stops them anyway.
    """
    if liveness is not None:
        liveness.stop()
    _OWN_GROUP.clear()
    if not dist.is_initialized():
        return
    failed = _leaving_on_error.is_set() or getattr(sys, "last_value", None) is not None
    try:
        if not failed and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(timeout_s, _EXIT_BARRIER_LIMIT_S)))
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

    ``collective_timeout`` (seconds) bounds every collective of the group
    this engine creates: with gloo, a collective that has not completed by
    then raises :class:`~spdkfac.comm.errors.CollectiveTimeoutError` naming
    the ranks that stopped answering (their heartbeats in the rendezvous store
    stopped); with NCCL, torch's watchdog ends the process. A group the
    caller created keeps the timeout given to its ``init_process_group``.
    """

    name = "torch"

    def __init__(self, collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        timeout_s = check_collective_timeout(collective_timeout)
        if not dist.is_available():  # pragma: no cover
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        # The timeout and heartbeats of the group an engine created earlier in this process; unknown for the caller's.
        self._timeout_s: float | None = _OWN_GROUP.get("timeout_s")
        self._liveness: Liveness | None = _OWN_GROUP.get("liveness")
        # The process groups of sub-group broadcasts, by (members, gloo for CPU tensors where the group is NCCL's).
        self._subgroups: dict[tuple[tuple[int, ...], bool], Any] = {}
        self._group: Any = None  # the process group of the collectives: None, the default one, unless set apart
        #: The group of the collectives on CPU tensors, decided at the first (a 1-tuple; None until then): (None,) for
        #: the engine's own, or where that refuses host memory (NCCL) a gloo group of the same ranks (:meth:`_group_for`).
        self._host: tuple[Any] | None = None
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
            attempt_store = PrefixStore(f"spdkfac/attempt_{attempt}", store)
            dist.init_process_group(
                backend=engine, store=attempt_store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
            )
            self._timeout_s = timeout_s
            if size > 1:
                self._liveness = Liveness(attempt_store, rank, size, interval_s=min(1.0, timeout_s / 10))
                self._liveness.start()
            atexit.register(_shut_down_process_group, timeout_s, self._liveness)
            _OWN_GROUP.update(timeout_s=timeout_s, liveness=self._liveness)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def _timed_out(self, collective: str) -> str:
        """The message for ``collective`` timing out here (asks the other ranks' heartbeats who stopped)."""
        silent = self._liveness.silent_ranks() if self._liveness is not None else None
        return timeout_message(collective, self.rank, self.size, self._timeout_s, silent)

    def apart_from_default_group(self) -> None:
        """Issue every collective from now on on a process group of this engine's own (the same ranks; made once).

        torch.distributed pairs the collectives of a group by the order each
        rank issues them in. On the default group, those of a
        ``DistributedDataParallel(find_unused_parameters=True)`` and the
        factors' would interleave differently on a worker where a layer did not
        run (its factors held back while DDP's buckets go out), and pair an
        all-reduce of one with one of the other: gloo aborts the process, NCCL
        may hang or mix the data. On a group of their own the factors keep the
        collective order's pairing (:mod:`spdkfac.step.collective_order`).
        """
        if self._group is not None or self.size == 1:
            return
        timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
        self._group = dist.new_group(list(range(self.size)), timeout=timeout)

    def _group_for(self, tensor: torch.Tensor) -> Any:
        """The process group that moves ``tensor``. NCCL refuses host memory, and a few of the optimizer's
        collectives carry small CPU tensors (each step's agreement on the all-reduce order, a profile's numbers):
        on an NCCL group those go through a gloo group of the same ranks, made at the first of them (a collective,
        which every rank reaches at the same point), apart from the GPU's stream (no wait for its work)."""
        if tensor.device.type != "cpu":
            return self._group
        if self._host is None:
            if moves_device_tensors_only(dist.get_backend(self._group)):
                timeout = None if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
                self._host = (dist.new_group(list(range(self.size)), timeout=timeout, backend="gloo"),)
            else:
                self._host = (None,)
        return self._group if self._host[0] is None else self._host[0]  # (the group as it is now: it may be set apart)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group_for(tensor), async_op=True)
        return _TorchHandle(work, tensor, self.size, name, self._timed_out)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        # (the group's ranks are the global ones)
        work = dist.broadcast(tensor, src=root, group=self._group_for(tensor), async_op=True)
        return _TorchHandle(work, tensor, 1, name, self._timed_out)

    native_subgroups = True

    def broadcast_within_async(self, tensor: torch.Tensor, root: int, members: Sequence[int], name: str) -> Handle:
        """A broadcast on a process group of ``members`` (made on first use, by every rank, in the same order)."""
        key = tuple(members)
        if root not in key:
            raise ValueError(f"broadcast {name!r}: root {root} is not among its members {list(key)}")
        if len(key) == self.size:
            return self.broadcast_async(tensor, root, name)
        host = self._group_for(tensor) is not self._group  # a CPU tensor on NCCL: a gloo sub-group
        group = self._subgroups.get((key, host))
        if group is None:  # every rank calls this, so every rank creates the groups in the same order
            group = self._subgroups[key, host] = dist.new_group(list(key), backend="gloo" if host else None)
        if self.rank not in key:
            return CompletedHandle()
        work = dist.broadcast(tensor, src=root, group=group, async_op=True)
        return _TorchHandle(work, tensor, 1, name, self._timed_out)

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        offsets = check_gather_counts(tensor, counts, self.size, name)
        width = max(counts)  # all_gather moves equal blocks: pad every segment to the longest
        mine = tensor.new_zeros(width)
        mine[: counts[self.rank]].copy_(tensor[offsets[self.rank] : offsets[self.rank] + counts[self.rank]])
        blocks = [tensor.new_empty(width) for _ in range(self.size)]
        work = dist.all_gather(blocks, mine, group=self._group_for(tensor), async_op=True)
        return _TorchGatherHandle(work, blocks, tensor, offsets, counts, name, self._timed_out)

    def barrier(self) -> None:
        work = dist.barrier(group=self._group, async_op=True)
        if work is not None:
            _wait(work, "spdkfac.barrier", self._timed_out)
