"""KFACPreconditioner over real workers (torchrun, gloo): 2 workers with torch's SGD, AdamW and AdamW sharded by
ZeroRedundancyOptimizer give the parameters of one process on the whole batch, and both ranks hold bitwise the same parameters, optimizer state and K-FAC state."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module
from nets import assert_bitwise_equal, small_net

from spdkfac.comm import SingleProcessBackend

WORKER = ROOT / "tests" / "workers" / "preconditioner_check.py"


def _held_everywhere(kfac: dict) -> dict:
    """The K-FAC state without the decompositions, which MEM-OPT keeps on a layer's gradient worker only."""
    layers = {name: {k: v for k, v in layer.items() if not k.endswith(("_inv", "_eigen"))} for name, layer in kfac["layers"].items()}
    return {**kfac, "layers": layers}


@pytest.mark.multiprocess
def test_two_workers_equal_one_and_replicas_are_bitwise_identical(tmp_path):
    ranks = run_rank_workers("torch", WORKER, tmp_path)
    module = worker_module(WORKER)
    old = torch.get_default_dtype()
    try:
        ref = module.run(SingleProcessBackend())
    finally:
        torch.set_default_dtype(old)
    init = small_net().state_dict()
    for name in module.CONFIGS:
        for key, value in ref[name]["params"].items():
            assert not torch.allclose(value, init[key].to(value.dtype)), f"{name}/{key} did not train"
            torch.testing.assert_close(
                ranks[0][name]["params"][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key, n=name: f"{n}/{k}: {m}"
            )
        assert_bitwise_equal(ranks[0][name]["params"], ranks[1][name]["params"], f"{name}/params")
        assert_bitwise_equal(ranks[0][name]["optimizer"], ranks[1][name]["optimizer"], f"{name}/optimizer")
        assert_bitwise_equal(_held_everywhere(ranks[0][name]["kfac"]), _held_everywhere(ranks[1][name]["kfac"]), f"{name}/kfac")
        assert ranks[0][name]["kfac"]["steps"] == module.STEPS
        if name == "kaisa-vision-example":  # (the LambdaParamScheduler's intervals, doubled at step 3, in force)
            assert [int(f) for f in ranks[0][name]["kfac"]["update_freqs"]] == [2, 2]
        if name.startswith("attached"):  # (ZeroRedundancyOptimizer's consolidated state_dict too)
            assert ranks[0][name]["optimizer"]["kfac_preconditioner"]["kfac"]["steps"] == module.STEPS
