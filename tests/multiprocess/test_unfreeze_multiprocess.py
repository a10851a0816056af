"""A layer unfrozen at a step on real workers (torchrun/gloo, horovodrun): the ranks stay bitwise replicas after
every step, and the parameters are those of one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from launch import run_rank_workers
from unit.step.test_unfreezing import WORKER, check_workers, unfreeze


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_a_layer_unfrozen_on_real_workers_trains_as_one_process(tmp_path, engine):
    ranks = run_rank_workers(engine, WORKER, tmp_path)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        for config, options in unfreeze.CONFIGS.items():
            check_workers([rank[config] for rank in ranks], unfreeze.train(False, options), config)
    finally:
        torch.set_default_dtype(old)
