"""One torch thread count on every CPU worker: K-FAC's matrix arithmetic agrees bit for bit across workers only then.

Each worker decomposes the factors placement leaves to every worker, and
preconditions its layers, by itself. On a CPU a blocked matrix routine
(Cholesky, eigendecomposition, a matrix product) splits its sums by the
number of threads it runs on, so workers with different counts get different
last bits, and replicas that must stay identical drift apart (seen under
Lightning's FSDP2 strategy on CPUs: its own process keeps the machine's count,
the ones it starts get one). Elementwise arithmetic, the whole of a
first-order optimizer's, does not depend on it, which is why this shows up
with K-FAC only.
"""

from __future__ import annotations

import torch

from ..comm.base import CommBackend

__all__ = ["agree_on_thread_count"]


def agree_on_thread_count(backend: CommBackend, on_cpu: bool) -> str | None:
    """Collective where ``on_cpu`` on several workers: set this worker's torch thread count to the fewest any worker
    has, and return the notice to give where that lowered it (None elsewhere, and where every worker agrees).

    ``on_cpu`` must be the same on every worker (it decides whether the
    collective runs): whether K-FAC computes on the CPU.
    """
    if backend.size == 1 or not on_cpu:
        return None
    mine = torch.get_num_threads()
    counts = [int(values[0]) for values in backend.gather_values([float(mine)], "spdkfac.thread_count")]
    fewest = min(counts)
    if not 1 <= fewest < mine:  # (below 1: not a worker's count, a stand-in engine's)
        return None
    torch.set_num_threads(fewest)
    return (
        f"this worker ran {mine} torch threads and another {fewest}: set to {fewest}, the fewest, so that the matrix "
        "arithmetic every worker does alike (decompositions, preconditioning) gives the same bits everywhere and the "
        "replicas stay identical. Set torch.set_num_threads() (or OMP_NUM_THREADS) alike on every worker to keep "
        "this from happening"
    )
