"""Workers started with different torch thread counts keep bit-identical replicas (real torchrun/gloo workers)."""

from __future__ import annotations

import pytest
from launch import ROOT, run_rank_workers
from nets import assert_bitwise_equal

WORKER = ROOT / "tests" / "workers" / "thread_count_check.py"


@pytest.mark.multiprocess
def test_workers_with_different_thread_counts_hold_identical_replicas(tmp_path):
    ranks = run_rank_workers("torch", WORKER, tmp_path)
    assert [rank["threads"] for rank in ranks] == [1, 1]  # the fewest, on both
    assert ranks[0]["said"] == []
    assert len(ranks[1]["said"]) == 1
    assert "ran 2 torch threads and another 1: set to 1" in ranks[1]["said"][0]
    for s, (mine, theirs) in enumerate(zip(ranks[0]["after"], ranks[1]["after"], strict=True)):
        assert_bitwise_equal(theirs, mine, f"step {s}")
