"""DHO2 in real processes: the distributed Lanczos and a few steps over horovodrun and torchrun (gloo), 2 workers.

Each worker saves its results; they must be bitwise the same on both workers
and equal (to rounding) to one process on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module

from spdkfac.comm import SingleProcessBackend

WORKER = ROOT / "tests" / "workers" / "dho2_check.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("engine", "rule"), [("torch", "code"), ("horovod", "code"), ("torch", "lagrangian"), ("horovod", "proximal")])
def test_two_workers_equal_one_and_agree_bitwise(engine, rule, tmp_path):
    ranks = run_rank_workers(engine, WORKER, tmp_path, "--admm-rule", rule)
    old = torch.get_default_dtype()
    try:
        ref = worker_module(WORKER).run(SingleProcessBackend(), admm_rule=rule)
    finally:
        torch.set_default_dtype(old)
    for key in ("values", "vectors", "tridiagonal", "params"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        assert torch.allclose(ranks[0][key], ref[key], rtol=0, atol=1e-9), key
    assert torch.equal(ranks[0]["state"]["basis"]["vectors"], ranks[1]["state"]["basis"]["vectors"])
    assert torch.equal(ranks[0]["state"]["admm"]["multiplier"], ranks[1]["state"]["admm"]["multiplier"])
    # The basis D is split by rows: 43 rows as 22 + 21.
    assert [r["basis_rows"] for r in ranks] == [22, 21]
    assert ranks[0]["memory"]["lanczos_basis"] < ref["memory"]["lanczos_basis"]
