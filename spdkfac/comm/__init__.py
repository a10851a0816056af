"""Communication engines behind one interface, and ``backend='auto'`` selection."""

from __future__ import annotations

import os

import torch.distributed

from .base import CommBackend, CompletedHandle, Handle, SingleProcessBackend
from .device import DEVICE_CHOICES, local_rank, local_rank_and_size, worker_device
from .errors import DEFAULT_COLLECTIVE_TIMEOUT_S, CollectiveError, CollectiveTimeoutError, WorkerLostError, check_collective_timeout
from .inprocess import InProcessBackend, InProcessGroup, run_ranks

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEVICE_CHOICES",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommBackend",
    "CompletedHandle",
    "Handle",
    "InProcessBackend",
    "InProcessGroup",
    "SingleProcessBackend",
    "WorkerLostError",
    "detect_launcher",
    "get_backend",
    "leaving_on_error",
    "local_rank",
    "local_rank_and_size",
    "run_ranks",
    "worker_device",
]

if torch.distributed.is_available():
    # The functions of torch.distributed.nn take the default process group as a default argument, read when that
    # module is first imported. torch imports it lazily (constructing the first torch optimizer imports
    # torch._dynamo, which imports it), so usually after init_process_group: the defaults then hold the group,
    # destroy_process_group cannot free it, and its gloo threads run on into interpreter shutdown. There, one that
    # drops the last reference to a Python tensor is killed as it takes the GIL, and the finished worker aborts
    # ("terminate called without an active exception", SIGABRT). Imported now, with no group yet, they hold none.
    import torch.distributed.nn

_HOROVOD_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR")
_MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def detect_launcher() -> str:
    """Guess which engine launched this process: 'horovod', 'torch' or 'single'."""
    env = os.environ
    if any(v in env for v in _HOROVOD_VARS):
        return "horovod"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return "torch"
    except Exception:  # pragma: no cover
        pass
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torch"
    if any(v in env for v in _MPI_VARS):
        return "horovod"  # mpirun-launched Horovod jobs only set MPI variables
    return "single"


def get_backend(backend: str | CommBackend = "auto", collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> CommBackend:
    """Return a communication engine.

    Args:
        backend: an engine instance (returned as is), or one of ``'auto'``
            (Horovod under ``horovodrun``/``mpirun``, torch.distributed under
            ``torchrun`` or an initialised process group, otherwise single
            process), ``'horovod'``, ``'torch'``, ``'single'``.
        collective_timeout: seconds a worker waits for the others in one
            collective before the job fails with a
            :class:`CollectiveTimeoutError` (torch.distributed) or
            :class:`WorkerLostError` (Horovod) naming who did not answer (a
            frozen worker must not hold the job for torch's 30 minutes).
            Checked always; used by the engines created here (the single-process
            engine never waits, an engine instance keeps its own).
    """
    timeout_s = check_collective_timeout(collective_timeout)
    if isinstance(backend, CommBackend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or a CommBackend, got {type(backend).__name__}")
    choice = detect_launcher() if backend == "auto" else backend
    if choice == "horovod":
        from .horovod_backend import HorovodBackend

        return HorovodBackend(collective_timeout=timeout_s)
    if choice == "torch":
        from .torch_backend import TorchDistributedBackend

        return TorchDistributedBackend(collective_timeout=timeout_s)
    if choice == "single":
        return SingleProcessBackend()
    raise ValueError(f"backend must be 'auto', 'horovod', 'torch', 'single' or a CommBackend, got {backend!r}")


def leaving_on_error() -> None:
    """This process is about to exit because of an error: do not wait for the other workers at exit.

    They may be blocked in a collective this process will never join; the
    sooner it exits with its error, the sooner the launcher stops the job.
    """
    import torch.distributed as dist

    if dist.is_available():
        from .torch_backend import skip_exit_barrier

        skip_exit_barrier()
