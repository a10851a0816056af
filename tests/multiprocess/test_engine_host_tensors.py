"""The torch engine's collectives on CPU tensors where its group refuses them (NCCL's): through a gloo group of the
same ranks, with the same results, and the optimizer trained that way equals the plain run, bitwise."""

from __future__ import annotations

import pytest
from launch import ROOT, run_rank_workers
from nets import assert_bitwise_equal

WORKER = ROOT / "tests" / "workers" / "host_tensors_check.py"


@pytest.mark.multiprocess
def test_cpu_tensors_go_through_a_gloo_group_where_the_engines_refuses_them(tmp_path):
    ranks = run_rank_workers("torch", WORKER, tmp_path)
    for r, rank in enumerate(ranks):
        assert rank["host_group_apart"]
        got = rank["collectives"]
        assert got["allreduce"] == [0.5, 10.5]
        assert got["broadcast"] == [2.0, 2.0]  # rank 1's
        assert got["within"] == [5.0]  # rank 0's
        assert got["alone"] == [9.0 + r]  # a sub-group of rank 0 alone: rank 1's untouched
        assert rank["gloo_subgroups"] == [True]  # (that sub-group made with gloo, for a CPU tensor on "NCCL")
        assert got["allgather"] == [1.0, 7.0, 8.0]
        assert got["gather_values"] == [[0.0, 3.0], [1.0, 4.0]]
        assert_bitwise_equal(rank["routed"], rank["plain"], "through the gloo group against plain")
    assert_bitwise_equal(ranks[0]["routed"], ranks[1]["routed"], "replicas")
