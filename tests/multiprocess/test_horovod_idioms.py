"""Horovod's start-of-training idioms (``broadcast_parameters``, ``broadcast_optimizer_state``) on 2 horovodrun
workers: a fresh optimizer and a resumed one train bitwise as without them, and the ranks stay replicas."""

from __future__ import annotations

import pytest
from launch import ROOT, run_rank_workers
from nets import assert_bitwise_equal

WORKER = ROOT / "tests" / "workers" / "horovod_idioms_check.py"


@pytest.mark.multiprocess
def test_broadcasting_the_optimizer_state_changes_nothing_and_works(tmp_path):
    ranks = run_rank_workers("horovod", WORKER, tmp_path)
    for rank in ranks:
        assert_bitwise_equal(rank["broadcast"], rank["plain"], "after broadcast_optimizer_state on a fresh optimizer")
        assert_bitwise_equal(rank["resumed"], rank["plain"][1:], "after broadcast_optimizer_state on a resumed one")
    assert_bitwise_equal(ranks[1], ranks[0], "rank 1 against rank 0")
