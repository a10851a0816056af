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

__all__ = ["local_rank", "worker_device", "DEVICE_CHOICES"]

# torchrun, horovodrun (Gloo), Open MPI, MPICH/Intel MPI, Slurm's srun
_LOCAL_RANK_VARS = ("LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def local_rank() -> int:
    """This process's index on its node, from the launcher's environment (0 when not launched)."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var)
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                raise ValueError(f"environment variable {var}={value!r} is not an integer local rank") from None
            if rank < 0:
                raise ValueError(f"environment variable {var}={value!r} is a negative local rank")
            return rank
    return 0


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
