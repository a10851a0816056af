"""Binding workers to cores: the split of a node's cores, the launchers' variables, and real 2-worker runs."""

from __future__ import annotations

import json
import re

import pytest
from launch import ROOT, run_workers

from spdkfac.comm import local_rank, local_rank_and_size
from spdkfac.runtime.affinity import core_share


def test_core_share_splits_the_cores_into_contiguous_blocks():
    shares = [core_share(range(8), r, 3) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert core_share([5, 3, 4, 2], 1, 2) == [4, 5]  # sorted first
    assert [core_share([0, 1], r, 2) for r in range(2)] == [[0], [1]]
    with pytest.warns(UserWarning, match="share cores"):
        assert [core_share([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]
    with pytest.raises(ValueError, match="no cores"):
        core_share([], 0, 1)
    with pytest.raises(ValueError, match="not within"):
        core_share([0, 1], 2, 2)


def test_local_rank_and_size_from_each_launcher(monkeypatch):
    for var in (
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "SLURM_LOCALID",
    ):
        monkeypatch.delenv(var, raising=False)
    assert local_rank_and_size() is None
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert local_rank_and_size() is None
    assert local_rank() == 1
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
    assert local_rank_and_size() == (0, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    # torchrun's, when both are set: the same launcher the GPU choice (local_rank) trusts
    assert local_rank_and_size() == (1, 4)
    assert local_rank() == 1
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="not within"):
        local_rank_and_size()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "many")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        local_rank_and_size()


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_two_workers_bind_every_thread_to_their_own_cores(engine):
    out = run_workers(engine, 2, [str(ROOT / "tests" / "workers" / "affinity_check.py")])
    reports = {}
    for rank, available, share, threads in re.findall(r"AFFINITY rank=(\d) available=(\[.*?\]) share=(\[.*?\]) threads=(\[\[.*?\]\])", out):
        reports[int(rank)] = (json.loads(available), json.loads(share), json.loads(threads))
    assert sorted(reports) == [0, 1], out[-3000:]
    available = reports[0][0]
    shares = [reports[r][1] for r in (0, 1)]
    assert all(shares)
    assert set(shares[0]) | set(shares[1]) <= set(available)
    if len(available) >= 2:
        assert not set(shares[0]) & set(shares[1])  # a core each, at least
    for r in (0, 1):  # every thread, the engine's included, on the worker's own cores
        assert reports[r][2] == [shares[r]], (r, reports[r][2], shares[r])
