"""Shared, checkpointed and skipped layers over real workers (torchrun, gloo): 2 workers give the parameters of one
process on the whole batch, and both ranks hold bitwise the same parameters and K-FAC state."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, run_rank_workers, worker_module
from nets import assert_bitwise_equal, shared_net

from spdkfac.comm import SingleProcessBackend

WORKER = ROOT / "tests" / "workers" / "shared_layers_check.py"


@pytest.mark.multiprocess
def test_two_workers_equal_one_with_shared_checkpointed_and_skipped_layers(tmp_path):
    ranks = run_rank_workers("torch", WORKER, tmp_path)
    module = worker_module(WORKER)
    old = torch.get_default_dtype()
    try:
        ref = module.run(SingleProcessBackend())
    finally:
        torch.set_default_dtype(old)
    for name in module.TIED_CONFIGS:  # an output layer tied to its embedding
        init = module.TiedLM().state_dict()
        for key, value in ref[name]["params"].items():
            assert not torch.allclose(value, init[key].to(value.dtype)), f"{name}/{key} did not train"
            torch.testing.assert_close(
                ranks[0][name]["params"][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key, n=name: f"{n}/{k}: {m}"
            )
        assert_bitwise_equal(ranks[0][name]["params"], ranks[1][name]["params"], f"{name}/params")
        # (with grad_worker_fraction < 1 each rank holds its own layers' decompositions: the factors are compared)
        factors = [{n: {k: e[k] for k in ("A", "G")} for n, e in rank[name]["kfac"]["layers"].items()} for rank in ranks[:2]]
        assert_bitwise_equal(factors[0], factors[1], f"{name}/factors")
        if "grad_worker_fraction" not in module.TIED_CONFIGS[name]:
            assert_bitwise_equal(ranks[0][name]["kfac"], ranks[1][name]["kfac"], f"{name}/kfac")
    init = shared_net().state_dict()
    for name in module.CONFIGS:
        assert ranks[0][name]["skipped"] == ["aux"], name  # the last factor step (4) ran without the aux head
        for key, value in ref[name]["params"].items():
            assert not torch.allclose(value, init[key].to(value.dtype)), f"{name}/{key} did not train"
            torch.testing.assert_close(
                ranks[0][name]["params"][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key, n=name: f"{n}/{k}: {m}"
            )
        assert_bitwise_equal(ranks[0][name]["params"], ranks[1][name]["params"], f"{name}/params")
        assert_bitwise_equal(ranks[0][name]["kfac"], ranks[1][name]["kfac"], f"{name}/kfac")
