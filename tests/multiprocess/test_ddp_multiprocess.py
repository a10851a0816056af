"""``SPDKFACOptimizer(DistributedDataParallel(model))`` is the optimizer on the bare model.

Two and three real ``torchrun`` gloo workers, float64, the small test network,
factors and inverses every 3 steps, 8 steps. Per configuration: the DDP-wrapped
run equals the bare run on the same rank (bitwise with 2 workers, where DDP's
divide-then-sum and the optimizer's sum-then-divide are the same numbers; to
1e-12 with 3), both equal one process on the global batch (1e-9), the ranks are bitwise
replicas (parameters and optimizer state), and the K-FAC layers carry the
bare model's names (checkpoints interchangeable). ``no_sync()`` accumulation
equals ``accumulation_steps`` without DDP. An optimizer built on the bare model
that DDP wraps afterwards (accelerate's ``prepare()``) lets DDP average: the
same numbers, and no gradient all-reduce of its own.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, assert_params_match, run_single, run_workers
from nets import assert_bitwise_equal

pytestmark = pytest.mark.multiprocess

WORKER = str(ROOT / "tests" / "workers" / "ddp_check.py")
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, factor_update_freq=3, inv_update_freq=3)
ACCUM = dict(BASE, accumulation_steps=2)
#: name -> (configuration, the bare configuration it must equal)
CONFIGS = {
    "bare": dict(BASE, ddp=None),
    "ddp": dict(BASE, ddp={}),
    "ddp-static-graph": dict(BASE, ddp={"static_graph": True}),
    "ddp-bucket-view": dict(BASE, ddp={"gradient_as_bucket_view": True}),
    "ddp-find-unused": dict(BASE, ddp={"find_unused_parameters": True}),
    "ddp-small-buckets": dict(BASE, ddp={"bucket_cap_mb": 0.0001}),
    "ddp-counted": dict(BASE, ddp={}, count=True),
    "ddp-eigen-dp": dict(BASE, compute_method="eigen", distribute_preconditioning=True, ddp={}),
    "bare-eigen-dp": dict(BASE, compute_method="eigen", distribute_preconditioning=True, ddp=None),
    "ddp-forward-fusion": dict(BASE, kl_clip=None, update_fusion="forward", ddp={}),
    "bare-forward-fusion": dict(BASE, kl_clip=None, update_fusion="forward", ddp=None),
    "ddp-grad-scaler": dict(BASE, ddp={}, amp=True),
    "bare-grad-scaler": dict(BASE, ddp=None, amp=True),
    "bare-accum": dict(ACCUM, ddp=None),
    "ddp-no-sync": dict(ACCUM, ddp={}, no_sync=True),
    "ddp-accum-every-pass-averaged": dict(ACCUM, ddp={}),  # without no_sync(): DDP averages each micro-batch
    # The optimizer built on the bare model, DDP wrapped around it afterwards (accelerate's prepare()): adopted.
    "ddp-after": dict(BASE, ddp={}, ddp_after=True),
    "ddp-after-no-sync": dict(ACCUM, ddp={}, no_sync=True, ddp_after=True),
    "ddp-after-forward-fusion": dict(BASE, kl_clip=None, update_fusion="forward", ddp={}, ddp_after=True),
}
SAME_AS = {name: "bare" for name in CONFIGS if name.startswith("ddp") and name != "ddp-accum-every-pass-averaged"}
SAME_AS.update(
    {
        "ddp-grad-scaler": "bare-grad-scaler",
        "ddp-eigen-dp": "bare-eigen-dp",
        "ddp-forward-fusion": "bare-forward-fusion",
        "ddp-no-sync": "bare-accum",
        "ddp-after-no-sync": "bare-accum",
        "ddp-after-forward-fusion": "bare-forward-fusion",
    }
)


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_wrapped_equals_bare_and_one_process(nproc, tmp_path):
    args = ["--configs", json.dumps(CONFIGS), "--global-batch", str(4 * nproc), "--steps", "8"]
    run_workers("torch", nproc, [WORKER, *args, "--out", str(tmp_path / "dist.pt")])
    run_single(WORKER, [*args, "--out", str(tmp_path / "single.pt")])
    ranks = [torch.load(tmp_path / f"dist.pt.rank{r}", weights_only=False) for r in range(nproc)]
    single = torch.load(tmp_path / "single.pt.rank0", weights_only=False)
    for name, config in CONFIGS.items():
        assert ranks[0][name]["steps"] == 8, name
        states = [ranks[r][name]["optimizer_state"] for r in range(nproc)]
        if "distribute_preconditioning" in config:  # each rank holds the decompositions of its own layers only
            states = [{"state": st["state"], "factors": {k: (v["A"], v["G"]) for k, v in st["kfac"]["layers"].items()}} for st in states]
        for r in range(1, nproc):
            assert_bitwise_equal(ranks[0][name]["params"], ranks[r][name]["params"], f"{name}: parameters of rank {r}")
            assert_bitwise_equal(states[0], states[r], f"{name}: optimizer state of rank {r}")
        assert ranks[0][name]["layers"] == single[name]["layers"] == ["0", "2", "4", "6"], name  # the bare model's names
    for name, bare in SAME_AS.items():
        if nproc == 2:  # DDP's sum of g/2 is bitwise the optimizer's (sum of g)/2
            assert_bitwise_equal(ranks[0][bare]["params"], ranks[0][name]["params"], f"{name} vs {bare}: parameters")
            assert_bitwise_equal(
                ranks[0][bare]["optimizer_state"]["state"], ranks[0][name]["optimizer_state"]["state"], f"{name} vs {bare}"
            )
        else:  # g/3 rounds: the same to the last bits
            assert_params_match({name: ranks[0][bare]}, ranks[0], [name], rtol=1e-12, atol=1e-14)
    assert_params_match(single, ranks[0], list(CONFIGS))
    # Accumulation without no_sync(): the sum of averages, the average of the sums to rounding.
    assert_params_match({"a": ranks[0]["bare-accum"]}, {"a": ranks[0]["ddp-accum-every-pass-averaged"]}, ["a"], rtol=1e-12, atol=1e-14)
    # Each gradient all-reduced once: by DDP alone, as many bytes as the optimizer sends on the bare model.
    model_bytes = sum(v.numel() * v.element_size() for v in ranks[0]["bare"]["params"].values())
    assert ranks[0]["bare"]["gradient_bytes"] == {"optimizer": 8 * model_bytes, "ddp": 0}
    assert ranks[0]["ddp-counted"]["gradient_bytes"] == {"optimizer": 0, "ddp": 8 * model_bytes}
    for name, config in CONFIGS.items():
        if config["ddp"] is not None:
            assert ranks[0][name]["gradient_bytes"]["optimizer"] == 0, name
