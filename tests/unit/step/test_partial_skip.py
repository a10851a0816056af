"""A layer that runs on some workers only in a step (in-process ranks): the workers agree through the step's
all-reduce order, stay bitwise replicas after every step, and the layer gets the mean of the factors of the
workers that ran it, as one worker on the whole batch has them (docs/shared-layers.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, worker_module
from nets import assert_bitwise_equal, batch, shared_net

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

WORKER = ROOT / "tests" / "workers" / "partial_skip_check.py"


def check_partial_skip(ranks: list[Any], module: Any, names: list[str] | None = None) -> None:
    """Bitwise replicas after every step, and the aux head's running factors the rule's: the decayed average
    updated with the mean of the batch factors of the ranks that ran it, G scaled by (k/P)² (kept where none did)."""
    decay = module.BASE["factor_decay"]
    for name in module.CONFIGS if names is None else names:
        previous = None
        for s, ran in enumerate(module.RUNS):
            step = [rank[name][s] for rank in ranks]
            # (with distribute_preconditioning a rank holds only the decompositions it preconditions with)
            parts = ("params", "aux") if module.CONFIGS[name].get("distribute_preconditioning") else ("params", "kfac", "aux")
            for r in range(1, len(ranks)):
                for part in parts:
                    assert_bitwise_equal(step[r][part], step[0][part], f"{name}, step {s}: {part} of rank {r} vs rank 0")
            assert step[0]["skipped"] == ([] if ran else ["aux"]), (name, s)
            a, g = step[0]["aux"]
            if not ran:
                expected = (
                    previous if previous is not None else (torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=a.dtype))
                )
            else:
                local = [step[r]["local"] for r in ran]
                assert all(item is not None for item in local)
                assert all(step[r]["local"] is None for r in range(len(ranks)) if r not in ran)
                batch_a = torch.stack([item[0] for item in local]).mean(0)
                # G as one worker on the whole batch has it: its loss averages over every worker's samples, so each
                # output gradient is k/P of a worker's where k of the P workers ran the head
                batch_g = torch.stack([item[1] for item in local]).mean(0) * (len(ran) / len(ranks)) ** 2
                before = previous if previous is not None else (torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=a.dtype))
                expected = (decay * before[0] + (1 - decay) * batch_a, decay * before[1] + (1 - decay) * batch_g)
            torch.testing.assert_close(a, expected[0], rtol=1e-10, atol=1e-12, msg=lambda m, n=name, s=s: f"{n}, step {s}, A: {m}")
            torch.testing.assert_close(g, expected[1], rtol=1e-10, atol=1e-12, msg=lambda m, n=name, s=s: f"{n}, step {s}, G: {m}")
            previous = (a, g)


MODULE = worker_module(WORKER)


@pytest.mark.parametrize("name", list(MODULE.CONFIGS))
def test_a_layer_skipped_on_some_workers_only_trains_alike_on_every_worker(name):
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        models = [{name: shared_net()} for _ in range(2)]
        ranks = run_ranks(2, lambda b: MODULE.run(b, models[b.rank], [name]), timeout=120)
    finally:
        torch.set_default_dtype(old)
    assert all(set(rank) == {name} for rank in ranks)
    check_partial_skip(ranks, MODULE, [name])


def test_a_layer_used_a_different_number_of_times_on_two_workers_is_refused_on_both(float64):
    """Use counts that differ between the workers that ran a layer cannot be averaged alike: every worker raises."""
    models = [shared_net() for _ in range(2)]

    def run(backend: Any) -> None:
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, backend=backend, lr=0.05, damping=0.01)
        x, y = batch(8)
        opt.zero_grad()
        out = model(x, aux=True)
        if backend.rank == 0:
            out = out + model.aux(model.encode(x))  # a second use of the aux head on rank 0 only
        F.cross_entropy(out, y).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"layer '(conv|aux)' ran a different number of times on different workers"):
        run_ranks(2, run, timeout=30)
