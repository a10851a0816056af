"""A routed layer taking a different number of samples on each real worker (torchrun/gloo, horovodrun; the model
bare or in DDP): bitwise replicas, and the parameters one process on the whole batch has."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module

from spdkfac.comm import get_backend

WORKER = ROOT / "tests" / "workers" / "uneven_samples_check.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_routed_layer_on_real_workers_equals_one_process(tmp_path, engine, float64):
    ranks = run_rank_workers(engine, WORKER, tmp_path)
    module = worker_module(WORKER)
    single = module.run(get_backend("single"))
    expected = [n for n in module.CONFIGS if engine == "torch" or "ddp" not in n]
    assert sorted(ranks[0]) == sorted(expected)
    for name in expected:
        for a, b, s in zip(ranks[0][name], ranks[1][name], single[name]):
            assert torch.equal(a, b), name
            torch.testing.assert_close(a, s, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
