"""benchmarks/gpu_check.py's interleaved runs: every run built is closed when the measurement ends, and when it fails."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.gpu_check import _inputs, _interleaved


@pytest.mark.slow  # two ResNet-20 runs: the whole suite's, not the fast loop's
def test_interleaved_runs_are_closed_on_leaving_and_on_an_error():
    cpu = torch.device("cpu")
    x, y = _inputs(2, 8, cpu)
    with _interleaved(["sgd", "kfac-inverse-amortised"], "cifar_resnet20", cpu, x, y, 1, 1, math.inf, "test") as runs:
        assert [len(r.seconds) for r in runs] == [1, 1]  # the warm-up iteration is not kept
        model = runs[1].model
        assert any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # K-FAC's hooks while it runs
    assert not any(hasattr(r, "opt") or hasattr(r, "model") for r in runs)
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())  # removed
    with (
        pytest.raises(RuntimeError, match="out of memory"),
        _interleaved(["sgd"], "cifar_resnet20", cpu, x, y, 0, 1, math.inf, "test") as runs,
    ):
        raise RuntimeError("out of memory")  # as a CUDA allocation failing in a measured step
    assert not hasattr(runs[0], "opt")
