"""A layer skipped on one real worker only (torchrun/gloo, horovodrun): the ranks stay bitwise replicas after every step,
the aux head gets the factors of the rule (docs/shared-layers.md), and the result is the in-process engine's."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module
from nets import shared_net
from unit.step.test_partial_skip import check_partial_skip

from spdkfac.comm.inprocess import run_ranks

WORKER = ROOT / "tests" / "workers" / "partial_skip_check.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_layer_skipped_on_one_real_worker_trains_alike_on_both(tmp_path, engine, float64):
    ranks = run_rank_workers(engine, WORKER, tmp_path)
    module = worker_module(WORKER)
    check_partial_skip(ranks, module)
    models = [{name: shared_net() for name in module.CONFIGS} for _ in range(2)]
    inprocess = run_ranks(2, lambda b: module.run(b, models[b.rank]), timeout=120)
    for name in module.CONFIGS:
        for s in range(len(module.RUNS)):
            for key, value in inprocess[0][name][s]["params"].items():
                torch.testing.assert_close(
                    ranks[0][name][s]["params"][key], value, rtol=1e-12, atol=1e-14, msg=lambda m, n=name, s=s, k=key: f"{n}/{s}/{k}: {m}"
                )
