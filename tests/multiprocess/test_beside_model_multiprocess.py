"""A loss's own weights beside the model: averaged by the optimizer under DDP (at ``step()``) and for a preconditioner
in KAISA's usage (found at the optimizer's first step), so the workers stay bitwise replicas and equal one process
(before: refused, or left to drift, with a warning under DDP and silently in KAISA's usage)."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, run_single
from nets import assert_bitwise_equal

WORKER = ROOT / "tests" / "workers" / "beside_model_check.py"


@pytest.mark.multiprocess
def test_a_losss_weights_beside_the_model_are_averaged(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    run_single(str(WORKER), ["--out", str(single)])
    reference = torch.load(single / "rank0.pt")
    ranks = run_rank_workers("torch", WORKER, tmp_path)
    for wiring, want in reference.items():
        assert_bitwise_equal(ranks[0][wiring], ranks[1][wiring], f"{wiring}: rank 1 vs rank 0")
        assert not torch.equal(want["loss.scale"], torch.tensor(2.0, dtype=want["loss.scale"].dtype))  # (it trained)
        for name, value in want.items():
            torch.testing.assert_close(
                ranks[0][wiring][name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name, w=wiring: f"{w}/{n}: {m}"
            )
