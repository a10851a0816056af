"""``torch.compile``'d models on 2 real workers (torchrun, gloo): the same training as eager, in one graph.

Float64, the small test network, factors and inverses every 2 steps, 6 steps,
``SPDKFACOptimizer`` and ``KFACPreconditioner`` (+ ``torch.optim.SGD``), the
bare model compiled (given to the optimizer, or compiled after it was built),
``torch.compile(DDP(net))`` and ``DDP(torch.compile(net))``. Per
configuration: the ranks are bitwise replicas, the parameters equal the eager
run's on the same rank and one eager process on the global batch (1e-10), the
K-FAC layers carry the bare model's names, our hooks add no graph break, and
nothing is compiled after the first step.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, run_single, run_workers
from nets import assert_bitwise_equal, small_net

from spdkfac.step.compiled_hooks import TAPS_AVAILABLE

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(not TAPS_AVAILABLE, reason="this torch has no custom ops with effects")]

WORKER = str(ROOT / "tests" / "workers" / "compile_check.py")
CONFIGS = {
    "opt-eager": {"api": "optimizer"},
    "opt-compiled": {"api": "optimizer", "compile": "wrap"},
    "opt-compiled-after": {"api": "optimizer", "compile": "after"},
    "opt-compiled-ddp": {"api": "optimizer", "ddp": "outside", "compile": "wrap"},
    "opt-ddp-compiled": {"api": "optimizer", "ddp": "inside", "compile": "wrap"},
    "pre-ddp": {"api": "preconditioner", "ddp": "outside"},
    "pre-compiled-ddp": {"api": "preconditioner", "ddp": "outside", "compile": "wrap"},
}
#: graph breaks of torch.compile(DDP(net)) itself, without spdkfac (DDP's forward: its logger and _inside_ddp_forward)
DDP_OWN_BREAKS = 4


def test_compiled_equals_eager_and_one_process_on_two_workers(tmp_path):
    args = ["--configs", json.dumps(CONFIGS), "--global-batch", "8", "--steps", "6"]
    run_workers("torch", 2, [WORKER, *args, "--out", str(tmp_path / "dist.pt")])
    run_single(WORKER, [*args, "--out", str(tmp_path / "single.pt")])
    ranks = [torch.load(tmp_path / f"dist.pt.rank{r}", weights_only=False) for r in range(2)]
    single = torch.load(tmp_path / "single.pt.rank0", weights_only=False)
    init = small_net().state_dict()
    for name, config in CONFIGS.items():
        eager = "opt-eager" if config["api"] == "optimizer" else "pre-ddp"
        result = ranks[0][name]
        assert_bitwise_equal(result["params"], ranks[1][name]["params"], f"{name}: parameters of rank 1")
        assert_bitwise_equal(result["optimizer_state"], ranks[1][name]["optimizer_state"], f"{name}: optimizer state of rank 1")
        assert_bitwise_equal(result["kfac_state"], ranks[1][name]["kfac_state"], f"{name}: K-FAC state of rank 1")
        for key, value in result["params"].items():
            assert not torch.allclose(value, init[key].to(value.dtype)), f"{name}/{key} did not train"
            for other, label in ((ranks[0][eager]["params"][key], "eager on 2 workers"), (single[eager]["params"][key], "one process")):
                torch.testing.assert_close(
                    value, other, rtol=1e-10, atol=1e-12, msg=lambda m, k=key, n=name, w=label: f"{n}/{k} vs {w}: {m}"
                )
        assert result["layers"] == ["0", "2", "4", "6"], name
        if config.get("compile"):
            allowed = DDP_OWN_BREAKS if config.get("ddp") == "outside" else 0
            assert result["graph_breaks"] <= allowed, (name, result["graph_breaks"])
            assert result["graphs"][0] >= 1, (name, result["graphs"])
            assert len(set(result["graphs"])) == 1, (name, result["graphs"])  # nothing compiled after the first step
