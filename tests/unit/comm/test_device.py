"""Which device a worker computes on, from the launcher's local-rank variables."""

from __future__ import annotations

import pytest
import torch

from spdkfac.comm import local_rank, worker_device

LOCAL_VARS = ("LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


@pytest.fixture
def clean_env(monkeypatch):
    for var in LOCAL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_local_rank_from_each_launcher(clean_env):
    assert local_rank() == 0
    for i, var in enumerate(LOCAL_VARS):
        clean_env.setenv(var, str(i + 1))
        assert local_rank() == 1  # torchrun's LOCAL_RANK wins over the others
    clean_env.delenv("LOCAL_RANK")
    assert local_rank() == 2  # then horovodrun's


@pytest.mark.parametrize("value", ["one", "-1", ""])
def test_bad_local_rank_is_reported(clean_env, value):
    clean_env.setenv("HOROVOD_LOCAL_RANK", value)
    with pytest.raises(ValueError, match="HOROVOD_LOCAL_RANK"):
        local_rank()


def test_worker_device_choices(clean_env):
    assert worker_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        worker_device("tpu")
    if torch.cuda.is_available():
        clean_env.setenv("LOCAL_RANK", str(torch.cuda.device_count() - 1))
        assert worker_device("auto") == torch.device("cuda", torch.cuda.device_count() - 1)
        assert torch.cuda.current_device() == torch.cuda.device_count() - 1
        clean_env.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
        with pytest.raises(ValueError, match="GPU"):
            worker_device("cuda")
    else:
        assert worker_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="cuda"):
            worker_device("cuda")
