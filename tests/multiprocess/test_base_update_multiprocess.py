"""K-FAC with an AdamW or LAMB base across real workers (torchrun and horovodrun, gloo): N workers give the
parameters of one process on the whole batch, and every rank holds bitwise the same parameters and optimizer
state (Adam moments, factors, inverses), as for the momentum-SGD base (tests/multiprocess/test_distributed_equivalence.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, assert_params_match, run_single, run_workers
from nets import assert_bitwise_equal

pytestmark = pytest.mark.multiprocess

WORKER = str(ROOT / "tests" / "workers" / "train_configs.py")
STEPS = 6
COMMON = dict(lr=0.01, weight_decay=1e-2, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)
CONFIGS = {
    "adamw-lbp": dict(COMMON, base="adamw", placement="lbp", perf_model="expensive-inverse"),
    "adamw-eigen-dp-freq": dict(
        COMMON, base="adamw", compute_method="eigen", distribute_preconditioning=True, factor_update_freq=2, inv_update_freq=4
    ),
    "lamb-seq": dict(COMMON, base="lamb", placement="seq", betas=[0.8, 0.99]),
    "lamb-local-freq-noclip": dict(COMMON, base="lamb", placement="local", kl_clip=None, factor_update_freq=2, inv_update_freq=4),
    "adamw-no-kfac": dict(COMMON, base="adamw", precondition=False),
}


def _run(args: list[str], engine: str | None, nproc: int) -> None:
    if engine is None:
        run_single(WORKER, args)
    else:
        run_workers(engine, nproc, [WORKER, "--backend", engine, *args])


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_adam_bases_match_one_process_and_replicas_are_bitwise_identical(engine, tmp_path):
    nproc, global_batch = 2, 8
    common = ["--configs", json.dumps(CONFIGS), "--global-batch", str(global_batch), "--steps", str(STEPS)]
    _run([*common, "--out", str(tmp_path / "ref.pt")], None, 1)
    _run([*common, "--every-rank", "--out", str(tmp_path / "dist.pt")], engine, nproc)
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    ranks = [torch.load(f"{tmp_path / 'dist.pt'}.rank{r}", weights_only=False) for r in range(nproc)]
    init = __import__("nets").small_net().state_dict()
    assert_params_match(ref, ranks[0], list(CONFIGS))
    for name, config in CONFIGS.items():
        assert any(not torch.allclose(ref[name]["params"][k], init[k].to(torch.float64)) for k in init), name
        split = config.get("distribute_preconditioning", False)
        for part in ("params", "optimizer_state"):
            a, b = ranks[0][name][part], ranks[1][name][part]
            if split and part == "optimizer_state":  # MEM-OPT: a layer's decompositions live on its gradient worker only
                a, b = _without_decompositions(a), _without_decompositions(b)
            assert_bitwise_equal(a, b, f"{name}/{part}")
        moments = ranks[0][name]["optimizer_state"]["state"]
        assert moments, name
        assert all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in moments.values()), name


def _without_decompositions(state: dict) -> dict:
    """The optimizer state without the per-layer decompositions (``*_inv``, ``*_eigen``), everything else kept."""
    kfac = dict(state["kfac"])
    kfac["layers"] = {
        name: {k: v for k, v in layer.items() if not k.endswith(("_inv", "_eigen"))} for name, layer in kfac["layers"].items()
    }
    return {**state, "kfac": kfac}
