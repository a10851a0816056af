"""``norm_layers='kfac'`` with ``damping='adaptive'`` over real workers (torchrun and horovodrun, gloo): 2 workers
give one process's parameters and dampings on the whole batch, and both ranks hold bitwise the same."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, require_horovod, run_rank_workers, worker_module
from nets import assert_bitwise_equal

from spdkfac.comm import SingleProcessBackend

WORKER = ROOT / "tests" / "workers" / "norm_damping_check.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_two_workers_equal_one_with_the_same_damping(engine, tmp_path):
    if engine == "horovod":
        require_horovod()
    ranks = run_rank_workers(engine, WORKER, tmp_path)
    old = torch.get_default_dtype()
    try:
        ref = worker_module(WORKER).run(SingleProcessBackend())
    finally:
        torch.set_default_dtype(old)
    assert ranks[0]["dampings"] == ranks[1]["dampings"]
    assert ranks[0]["dampings"] == pytest.approx(ref["dampings"], rel=1e-9)
    assert len(set(ref["dampings"])) > 1  # the rule acted
    for key, value in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=1e-9, atol=1e-11)
    assert_bitwise_equal(ranks[0]["params"], ranks[1]["params"], "params")
