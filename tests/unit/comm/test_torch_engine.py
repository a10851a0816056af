"""Which torch.distributed backends refuse CPU tensors (the engine then stages them on the GPU)."""

from __future__ import annotations

import pytest

from spdkfac.comm.torch_backend import moves_device_tensors_only


@pytest.mark.parametrize(
    ("name", "device_only"),
    [
        ("nccl", True),
        ("NCCL", True),
        ("cuda:nccl", True),
        ("gloo", False),
        ("mpi", False),
        ("ucc", False),
        ("cpu:gloo,cuda:nccl", False),
        ("cuda:nccl, cpu:gloo", False),
    ],
)
def test_nccl_alone_refuses_cpu_tensors(name: str, device_only: bool) -> None:
    assert moves_device_tensors_only(name) is device_only
