"""Multi-process worker (torchrun): the torch engine's collectives on CPU tensors where its group refuses them.

On an NCCL group, which refuses host memory, the engine moves CPU tensors
through a gloo group of the same ranks made at the first such collective
(:meth:`TorchDistributedBackend._group_for`). Here, on gloo, the engine is
told its group is NCCL's, so every CPU collective goes through that second
group: each collective's result, and the optimizer trained that way (its
per-step agreement, the profile's numbers) against the plain run, bitwise.

    torchrun --nproc_per_node 2 tests/workers/host_tensors_check.py --backend torch --out DIR
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import small_net, train
from rank_results import rank_shard, save_rank_results

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend, torch_backend

warnings.filterwarnings("ignore", message="no perf_model given")


def collectives(backend: Any) -> dict[str, Any]:
    r = float(backend.rank)
    reduced = torch.tensor([r, 10.0 + r])
    backend.allreduce_async(reduced, "host.allreduce").wait()
    sent = torch.tensor([r + 1.0, 2.0])
    backend.broadcast_async(sent, 1, "host.broadcast").wait()
    within = torch.tensor([r + 5.0])
    backend.broadcast_within_async(within, 0, [0, 1], "host.within").wait()
    alone = torch.tensor([r + 9.0])  # a sub-group of rank 0 alone (made by every rank; rank 1 takes no part)
    backend.broadcast_within_async(alone, 0, [0], "host.alone").wait()
    full = torch.zeros(3)  # rank 0 sends 1 value, rank 1 two
    full[0 if backend.rank == 0 else 1 :] = torch.tensor([1.0]) if backend.rank == 0 else torch.tensor([7.0, 8.0])
    backend.allgather_async(full, [1, 2], "host.allgather").wait()
    values = backend.gather_values([r, r * r + 3.0], "host.gather_values")
    return {
        "allreduce": reduced.tolist(),
        "broadcast": sent.tolist(),
        "within": within.tolist(),
        "alone": alone.tolist(),
        "allgather": full.tolist(),
        "gather_values": values,
    }


def trained(backend: CommBackend) -> list[torch.Tensor]:
    x, y = rank_shard(backend, 8)
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, backend=backend, profile_steps=1, factor_update_freq=2, inv_update_freq=2)
    train(model, opt, x, y, 4)
    opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


def run(backend: Any) -> dict[str, Any]:
    plain = trained(backend)
    assert backend._host == (None,)  # (gloo takes CPU tensors: the engine's own group)
    backend._host = None
    torch_backend.moves_device_tensors_only = lambda name: True  # as NCCL's group would say
    results = {"collectives": collectives(backend), "routed": trained(backend), "plain": plain}
    results["host_group_apart"] = backend._host is not None and backend._host[0] is not backend._group
    results["gloo_subgroups"] = [host for (_, host) in backend._subgroups]
    return results


if __name__ == "__main__":
    save_rank_results(run)
