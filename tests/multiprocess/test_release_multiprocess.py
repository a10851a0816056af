"""Optimizers on real workers (torchrun/gloo, horovodrun): one let go of is freed with its model, and a second
optimizer on the same model takes it over (bitwise replicas, one process's parameters on the whole batch)."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module
from nets import assert_bitwise_equal, batch

WORKER = ROOT / "tests" / "workers" / "release_check.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_optimizers_on_real_workers_are_freed_and_taken_over(tmp_path, engine):
    release = worker_module(WORKER)
    ranks = run_rank_workers(engine, WORKER, tmp_path)
    for rank in ranks:
        assert rank["freed"] == dict.fromkeys(release.LET_GO, True)  # before: none freed on N workers
        assert rank["first_refused"]
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        single, _ = release.two_stages("single", *batch(release.BATCH))
    finally:
        torch.set_default_dtype(old)
    for s, (mine, theirs) in enumerate(zip(ranks[0]["two_stages"], single, strict=True)):
        assert_bitwise_equal(ranks[1]["two_stages"][s], mine, f"step {s}")
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, s=s: f"step {s}: {m}")
