"""Which device a worker computes on: its own GPU on a multi-GPU node, otherwise the CPU.

Launchers tell each process its index on its node (its *local rank*) in an
environment variable; a worker uses GPU ``local_rank``. Making that GPU the
current device matters beyond placing tensors: NCCL (torch.distributed) and
Horovod's GPU collectives work on the current device, and with every process
on GPU 0 they fail or serialise.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEVICE_CHOICES", "local_rank", "local_rank_and_size", "worker_device"]

# (local rank, local size) variables of torchrun, horovodrun (Gloo), Open MPI, MPICH/Intel MPI, Slurm's srun
# (which names no local size), in the order they are trusted.
_LAUNCHER_VARS: tuple[tuple[str, str | None], ...] = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_LOCALID", None),
)
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def _launcher_vars() -> tuple[str, str | None] | None:
    """The (rank, size) variable names of the launcher that started this process, or None."""
    return next(((r, s) for r, s in _LAUNCHER_VARS if r in os.environ), None)


def _env_int(var: str, what: str) -> int:
    value = os.environ[var]
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"environment variable {var}={value!r} is not an integer {what}") from None
    if number < 0:
        raise ValueError(f"environment variable {var}={value!r} is a negative {what}")
    return number


def local_rank() -> int:
    """This process's index on its node, from the launcher's environment (0 when not launched)."""
    names = _launcher_vars()
    return 0 if names is None else _env_int(names[0], "local rank")


def local_rank_and_size() -> tuple[int, int] | None:
    """This process's index on its node and the number of processes there, from the launcher's environment.

    None when no launcher set them (a plain single-process run, or a launcher
    that names no local size).
    """
    names = _launcher_vars()
    if names is None or names[1] is None or names[1] not in os.environ:
        return None
    rank, size = _env_int(names[0], "local rank"), _env_int(names[1], "local size")
    if rank >= size:
        raise ValueError(f"{names[0]}={rank} is not within {names[1]}={size}")
    return rank, size


def worker_device(choice: str = "auto") -> torch.device:
    """The device this worker should compute on, made current if it is a GPU.

    Args:
        choice: ``'auto'`` (GPU ``local_rank`` when CUDA is available, else
            the CPU), ``'cpu'``, or ``'cuda'`` (an error without CUDA).

    Raises:
        ValueError: an unknown choice, or more processes on this node than GPUs.
        RuntimeError: ``'cuda'`` asked for where CUDA is not available.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False (a CPU build of torch, or no GPU)")
    index, count = local_rank(), torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"local rank {index} but only {count} GPU(s) visible on this node: start at most {count} "
            "processes per node, or pass device 'cpu'"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
