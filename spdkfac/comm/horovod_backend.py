"""Horovod engine: ``allreduce_async_`` / ``broadcast_async_`` (the paper's choice)."""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

import torch

from .base import CommBackend, Handle, check_gather_counts
from .errors import DEFAULT_COLLECTIVE_TIMEOUT_S, WorkerLostError, check_collective_timeout, lost_message, timeout_message
from .liveness import Liveness
from .watchdog import WaitWatchdog

__all__ = ["HorovodBackend"]

_GLOO_TIMEOUT_VAR = "HOROVOD_GLOO_TIMEOUT_SECONDS"
_ELASTIC_VAR = "HOROVOD_ELASTIC"  # "1" under horovodrun's elastic mode
_HOROVOD_DEFAULT_GLOO_TIMEOUT_S = 30  # what hvd.init() uses when the variable is not set
#: The longest a worker tries to reach the heartbeat store on rank 0 before going without naming ranks.
_STORE_CONNECT_S = 30.0


class _HorovodHandle:
    __slots__ = ("_handle", "_hvd", "_name", "_synchronize")

    def __init__(self, hvd: ModuleType, handle: int | None, name: str, synchronize: Callable[[int, str], None]) -> None:
        self._hvd = hvd  # horovod.torch
        self._handle = handle  # its request id
        self._name = name
        self._synchronize = synchronize

    def wait(self) -> None:
        if self._handle is not None:
            self._synchronize(self._handle, self._name)
            self._handle = None

    def done(self) -> bool:
        return self._handle is None or bool(self._hvd.poll(self._handle))


class _HorovodGatherHandle:
    """Horovod's all-gather returns a new tensor: copied into the caller's on ``wait()``."""

    __slots__ = ("_handle", "_hvd", "_name", "_out", "_synchronize")

    def __init__(self, hvd: ModuleType, handle: int, out: torch.Tensor, name: str, synchronize: Callable[[int, str], Any]) -> None:
        self._hvd = hvd
        self._handle: int | None = handle
        self._out = out
        self._name = name
        self._synchronize = synchronize

    def wait(self) -> None:
        if self._handle is not None:
            self._out.copy_(self._synchronize(self._handle, self._name))
            self._handle = None

    def done(self) -> bool:
        return self._handle is None or bool(self._hvd.poll(self._handle))


class HorovodBackend(CommBackend):
    """Collectives through Horovod (initialised here if the user has not).

    ``collective_timeout`` (seconds), at most Horovod's default 30 s, becomes
    ``HOROVOD_GLOO_TIMEOUT_SECONDS`` when this engine initialises Horovod (a
    value exported by the user or ``horovodrun --gloo-timeout-seconds``
    wins): a worker whose Horovod thread stops answering (a frozen process,
    an unreachable host) then shuts Horovod down on every other worker after
    that long, and the first failed collective raises
    :class:`~spdkfac.comm.errors.WorkerLostError` naming the ranks whose
    heartbeats stopped (a small store on rank 0; not named if it cannot be
    reached within 30 s at start-up). A worker that is alive but never
    issues the collective is not noticed by Horovod: a watchdog ends a worker
    whose wait lasts longer than ``collective_timeout`` (exit status 1, the
    error printed first).

    Under ``horovodrun --min-np/--max-np`` (``HOROVOD_ELASTIC=1``) a failed
    collective raises Horovod's ``HorovodInternalError`` instead, the error
    ``hvd.elastic.run`` restores the committed state from (no heartbeats:
    their store lives on a rank 0 that may leave); :attr:`rank` and
    :attr:`size` are read from Horovod each time, so they follow its
    re-initialisations (:mod:`spdkfac.train.elastic`).
    """

    name = "horovod"

    def __init__(self, collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        timeout_s = check_collective_timeout(collective_timeout)
        try:
            import horovod.torch as hvd
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "backend='horovod' needs Horovod with PyTorch support; run scripts/setup.sh or pip install 'spdkfac[horovod]'"
            ) from exc
        if not hvd.is_initialized():
            # Never longer than Horovod's default: its background threads answer each other every cycle, so a
            # longer wait only delays noticing a frozen worker (and the start-up rendezvous rarely needs more).
            os.environ.setdefault(_GLOO_TIMEOUT_VAR, str(min(math.ceil(timeout_s), _HOROVOD_DEFAULT_GLOO_TIMEOUT_S)))
            hvd.init()
        self._hvd = hvd
        self._timeout_s = float(os.environ.get(_GLOO_TIMEOUT_VAR, _HOROVOD_DEFAULT_GLOO_TIMEOUT_S))
        self._collective_timeout_s = timeout_s
        #: Under ``horovodrun --min-np/--max-np`` Horovod is re-initialised at other sizes in the same process.
        self.elastic = os.environ.get(_ELASTIC_VAR) == "1"
        # Elastic: no heartbeat store (it lives on a rank 0 that may leave), and a failed collective stays a
        # HorovodInternalError, the error hvd.elastic.run recovers from.
        self._liveness = _start_liveness(hvd, timeout_s) if self.size > 1 and not self.elastic else None
        watch = self.size > 1 or self.elastic  # an elastic job may grow
        self._watchdog = WaitWatchdog(timeout_s, self._overdue, interval_s=min(1.0, timeout_s / 10)) if watch else None

    @property
    def rank(self) -> int:
        return int(self._hvd.rank())

    @property
    def size(self) -> int:
        return int(self._hvd.size())

    def _synchronize(self, handle: int, collective: str) -> Any:
        """Wait for ``handle`` (under the watchdog) and return Horovod's result; a failure that lost a worker says which."""
        try:
            if self._watchdog is None:
                return self._hvd.synchronize(handle)
            with self._watchdog.watching(collective):
                return self._hvd.synchronize(handle)
        except Exception as exc:
            self._failed(collective, exc)
            raise

    def _overdue(self, collective: str) -> str:
        """The watchdog's message for a wait on ``collective`` longer than the timeout."""
        silent = self._liveness.silent_ranks() if self._liveness is not None else None
        return timeout_message(collective, self.rank, self.size, self._collective_timeout_s, silent)

    def _failed(self, collective: str, exc: Exception) -> None:
        """Raise a WorkerLostError from ``exc`` when another worker's heartbeat stopped; else let ``exc`` be.

        After Horovod shut down, issuing a collective raises HorovodInternalError
        and waiting on one issued before may raise ValueError (its handle was
        cleared): any error qualifies, the heartbeats decide.
        """
        if self.elastic:
            from horovod.common.exceptions import HorovodInternalError

            if not isinstance(exc, HorovodInternalError):  # e.g. a handle Horovod cleared when it shut down
                raise HorovodInternalError(f"collective {collective!r} failed: {type(exc).__name__}: {exc}") from exc
            return
        if self._liveness is None:
            return
        silent = self._liveness.silent_ranks()
        if silent is None and self.size == 2:  # the store on rank 0 does not answer either: rank 0 stopped
            silent = [1 - self.rank]
        if silent:
            why = f"Horovod shut down (it gives up on a worker that does not answer for {self._timeout_s:g} s, collective_timeout)"
            raise WorkerLostError(lost_message(collective, self.rank, silent, why)) from exc

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        try:
            handle = self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Average)
        except Exception as exc:  # Horovod shut down before this collective was issued
            self._failed(name, exc)
            raise
        return _HorovodHandle(self._hvd, handle, name, self._synchronize)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        try:
            handle = self._hvd.broadcast_async_(tensor, root_rank=root, name=name)
        except Exception as exc:
            self._failed(name, exc)
            raise
        return _HorovodHandle(self._hvd, handle, name, self._synchronize)

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        offsets = check_gather_counts(tensor, counts, self.size, name)
        mine = tensor[offsets[self.rank] : offsets[self.rank] + counts[self.rank]]  # segments may differ in size
        try:
            handle = self._hvd.allgather_async(mine, name=name)
        except Exception as exc:
            self._failed(name, exc)
            raise
        return _HorovodGatherHandle(self._hvd, handle, tensor, name, self._synchronize)

    def barrier(self) -> None:
        self.allreduce_async(torch.zeros(1), "spdkfac.barrier").wait()


#: The heartbeats of this process, started by the first engine built (a second one must not issue start-up collectives).
_SHARED_LIVENESS: dict[str, Liveness | None] = {}


def _start_liveness(hvd: ModuleType, timeout_s: float) -> Liveness | None:
    """Heartbeats through a TCP store served by rank 0 (Horovod has no store of its own to lend); None if unreachable."""
    if "liveness" not in _SHARED_LIVENESS:
        _SHARED_LIVENESS["liveness"] = _connect_liveness(hvd, timeout_s)
    return _SHARED_LIVENESS["liveness"]


def _connect_liveness(hvd: ModuleType, timeout_s: float) -> Liveness | None:
    from torch._C._distributed_c10d import TCPStore

    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    store: TCPStore | None = None
    if hvd.rank() == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    host, port = hvd.broadcast_object((host, store.port if store is not None else 0), root_rank=0, name="spdkfac.liveness")
    try:
        if store is None:
            store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=min(timeout_s, _STORE_CONNECT_S)))
    except (RuntimeError, OSError):  # rank 0's host name does not resolve here: go without naming ranks
        store = None
    ok = hvd.allreduce(torch.tensor([0.0 if store is None else 1.0]), op=hvd.Min, name="spdkfac.liveness.ok")
    if store is None or float(ok) < 1:
        return None
    liveness = Liveness(store, hvd.rank(), hvd.size(), interval_s=min(1.0, timeout_s / 10))
    liveness.start()
    return liveness
