"""The torch engine's collectives on CPU tensors, staged on a device (as under NCCL): their results reach the
caller's tensors, and the optimizer trained through them equals the same run without staging, bitwise."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_workers
from nets import assert_bitwise_equal

WORKER = ROOT / "tests" / "workers" / "staging_check.py"


@pytest.mark.multiprocess
def test_cpu_tensors_staged_on_a_device_return_their_results(tmp_path):
    run_workers("torch", 2, [str(WORKER), "--backend", "torch", "--out", str(tmp_path)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in ranks:
        got = rank["collectives"]
        assert got["allreduce"] == [0.5, 10.5]
        assert got["broadcast"] == [2.0, 2.0]  # rank 1's
        assert got["within"] == [5.0]  # rank 0's
        assert got["allgather"] == [1.0, 7.0, 8.0]
        assert got["gather_values"] == [[0.0, 3.0], [1.0, 4.0]]
        assert_bitwise_equal(rank["staged"], rank["plain"], "staged against plain")
    assert_bitwise_equal(ranks[0]["staged"], ranks[1]["staged"], "replicas")
