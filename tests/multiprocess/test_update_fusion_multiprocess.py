"""Update fusion on the real engines: fused runs give bitwise the unfused parameters, and bitwise replicas.

``torchrun`` and ``horovodrun --gloo`` with 2 workers, float32 (where layouts
matter); every rank saves its parameters and optimizer state, read through
``state_dict()`` (which applies what forward fusion still holds).
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = str(ROOT / "tests" / "workers" / "train_configs.py")
NPROC = 2
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=None, profile_steps=2)
KINDS = {
    "sgd": dict(BASE, precondition=False),
    "kfac": dict(BASE, factor_update_freq=1, inv_update_freq=2),  # odd steps keep the inverses: updated in backward
    "eigen-accum": dict(BASE, compute_method="eigen", factor_update_freq=2, inv_update_freq=4, accumulation_steps=2),
}
CONFIGS = {f"{kind}-{fusion}": dict(cfg, update_fusion=fusion) for kind, cfg in KINDS.items() for fusion in ("none", "forward", "backward")}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_fused_runs_equal_unfused_bitwise_on_every_rank(engine, tmp_path):
    out = tmp_path / f"{engine}.pt"
    args = ["--backend", engine, "--configs", json.dumps(CONFIGS), "--global-batch", "8", "--steps", "6"]
    run_workers(engine, NPROC, [WORKER, *args, "--dtype", "float32", "--every-rank", "--out", str(out)])
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(NPROC)]
    for name in CONFIGS:
        assert _equal(ranks[0][name]["params"], ranks[1][name]["params"]), f"{name}: replicas differ"
        assert _equal(ranks[0][name]["optimizer_state"]["state"], ranks[1][name]["optimizer_state"]["state"]), name
    for kind in KINDS:
        ref = ranks[0][f"{kind}-none"]
        for fusion in ("forward", "backward"):
            got = ranks[0][f"{kind}-{fusion}"]
            assert _equal(ref["params"], got["params"]), f"{kind}-{fusion}: parameters differ from the unfused run"
            assert _equal(ref["optimizer_state"]["state"], got["optimizer_state"]["state"]), f"{kind}-{fusion}: momentum differs"
            assert got["steps"] == ref["steps"] == 6
