"""Bind each worker of a node to its own share of the node's cores (opt-in).

On CPU nodes that run one worker per core, the operating system otherwise
moves the workers' compute threads and their communication threads (Horovod's
background thread, gloo's) across all cores, so a worker now and then computes
on a core another worker is using. The ranks then drift apart by seconds per
iteration, and whoever is ahead waits for the slowest in the next collective.
Binding worker ``r`` of ``n`` on a node to the ``r``-th of ``n`` equal blocks
of the cores keeps each worker, with every thread it starts later, on its
own cores. It binds the process's threads that exist, and should run before
the communication engine starts its threads (``hvd.init()``,
``init_process_group``), which then inherit it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from collections.abc import Collection

from ..comm.device import local_rank_and_size

__all__ = ["add_bind_cores_option", "bind_cores_if_asked", "bind_to_local_cores", "core_share"]


def core_share(cores: Collection[int], local_rank: int, local_size: int) -> list[int]:
    """The block of ``cores`` for worker ``local_rank`` of ``local_size``: equal contiguous blocks.

    With more cores than workers the first ``len(cores) % local_size`` workers
    get one core more. With more workers than cores each gets one core,
    round-robin (workers then share cores; a warning says so).
    """
    if not cores:
        raise ValueError("no cores to share")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not within local size {local_size}")
    ordered = sorted(cores)
    if local_size > len(ordered):
        warnings.warn(f"{local_size} workers on {len(ordered)} cores: workers share cores", stacklevel=2)
        return [ordered[local_rank % len(ordered)]]
    base, extra = divmod(len(ordered), local_size)
    start = local_rank * base + min(local_rank, extra)
    return ordered[start : start + base + (1 if local_rank < extra else 0)]


def bind_to_local_cores() -> list[int] | None:
    """Restrict this worker (and every thread it starts from now on) to its share of the cores it may use.

    Returns the cores, or None in a run that no launcher started (nothing is
    changed; the launcher is read as :func:`spdkfac.comm.device.local_rank_and_size` reads it). Raises on platforms without ``os.sched_setaffinity`` (Linux has it).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("binding workers to cores needs os.sched_setaffinity (Linux)")
    local = local_rank_and_size()
    if local is None:
        return None
    share = core_share(os.sched_getaffinity(0), *local)
    for tid in _thread_ids():  # threads already started (importing torch starts some) as well as this one
        with contextlib.suppress(ProcessLookupError):  # that thread may have exited meanwhile
            os.sched_setaffinity(tid, share)
    return share


def _thread_ids() -> list[int]:
    """This process's threads (Linux ``/proc``), or just the calling thread where that is not available."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def add_bind_cores_option(parser: argparse.ArgumentParser) -> None:
    """The ``--bind-cores`` switch every program of the project that runs workers offers (see :func:`bind_to_local_cores`)."""
    parser.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each worker of a node to its own share of the cores (CPU nodes; see spdkfac.runtime.affinity)",
    )


def bind_cores_if_asked(args: argparse.Namespace) -> list[int] | None:
    """:func:`bind_to_local_cores` when ``args`` asked for it (``--bind-cores``), else None.

    Call it before the communication engine starts its threads, so that they inherit the binding.
    """
    return bind_to_local_cores() if getattr(args, "bind_cores", False) else None
