"""KAISA's gradient workers with real processes: 4 workers, 2 gradient workers per layer, both engines.

torch.distributed broadcasts to sub-groups (process groups made on first
use); Horovod has none here, so its decompositions go to every rank (the
others drop them) and each group's first rank sends the group's results to
all. Either way the parameters must equal one process on the global batch,
and every rank hold bitwise the same parameters and momentum, and the same
decompositions wherever two ranks both hold one.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, run_workers
from test_distributed_equivalence import BASE, STEPS, _assert_bitwise_equal, _assert_same, _held_by_both, _reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = str(ROOT / "tests" / "workers" / "train_configs.py")
NPROC = 4
CONFIGS = {
    "half-inverse-lbp": dict(BASE, placement="lbp", perf_model="expensive-inverse", grad_worker_fraction=0.5),
    "half-eigen-lbp-freq": dict(
        BASE,
        placement="lbp",
        perf_model="expensive-eigen",
        compute_method="eigen",
        grad_worker_fraction=0.5,
        factor_update_freq=2,
        inv_update_freq=4,
    ),
    "quarter-inverse-seq": dict(BASE, placement="seq", grad_worker_fraction=0.25),
}


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_gradient_worker_groups_match_one_process_and_replicas_agree(engine, tmp_path):
    out = tmp_path / f"{engine}.pt"
    args = ["--configs", json.dumps(CONFIGS), "--global-batch", str(4 * NPROC), "--steps", str(STEPS)]
    run_workers(engine, NPROC, [WORKER, "--backend", engine, *args, "--every-rank", "--out", str(out)])
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(NPROC)]
    _assert_same(ranks[0], _reference(4 * NPROC, CONFIGS, tmp_path))
    for name in CONFIGS:
        for other in range(1, NPROC):
            _assert_bitwise_equal(ranks[0][name]["params"], ranks[other][name]["params"], f"{name}/params")
            mine, theirs = _held_by_both(ranks[0][name]["optimizer_state"], ranks[other][name]["optimizer_state"])
            _assert_bitwise_equal(mine, theirs, f"{name}/optimizer_state")
        # Each rank holds the decompositions of only some layers, and every layer is held somewhere.
        suffix = "_eigen" if "eigen" in name else "_inv"
        held = [
            {n for n, e in ranks[r][name]["optimizer_state"]["kfac"]["layers"].items() if e[f"A{suffix}"] is not None} for r in range(NPROC)
        ]
        assert all(0 < len(h) < 4 for h in held), held
        assert set().union(*held) == set(ranks[0][name]["optimizer_state"]["kfac"]["layers"])
        record = ranks[0][name]["optimizer_state"]["kfac"]["grad_workers"]
        assert record["grad_workers"] == round(CONFIGS[name]["grad_worker_fraction"] * NPROC)
    owners = ranks[0]["half-inverse-lbp"]["owners"]
    assert any(o >= 0 for o in owners.values())  # some decompositions broadcast inside their group


#: A warm refresh starts from the previous basis: every rank holds every basis, the groups split the preconditioning.
#: More samples than any factor's dimension (distinct eigenvalues: within a repeated one a warm basis follows rounding).
WARM = {
    "half-eigen-warm": dict(
        BASE,
        placement="lbp",
        perf_model="expensive-eigen",
        compute_method="eigen",
        eigen_refresh="warm",
        eigen_full_every=3,
        grad_worker_fraction=0.5,
    ),
}
WARM_BATCH = 48


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_warm_refresh_with_gradient_worker_groups_matches_one_process(engine, tmp_path):
    out = tmp_path / f"{engine}.pt"
    args = ["--configs", json.dumps(WARM), "--global-batch", str(WARM_BATCH), "--steps", str(STEPS)]
    run_workers(engine, NPROC, [WORKER, "--backend", engine, *args, "--every-rank", "--out", str(out)])
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(NPROC)]
    _assert_same(ranks[0], _reference(WARM_BATCH, WARM, tmp_path))
    for other in range(1, NPROC):
        _assert_bitwise_equal(ranks[0]["half-eigen-warm"]["params"], ranks[other]["half-eigen-warm"]["params"], "params")
        _assert_bitwise_equal(
            ranks[0]["half-eigen-warm"]["optimizer_state"], ranks[other]["half-eigen-warm"]["optimizer_state"], "optimizer_state"
        )
    for r in range(NPROC):  # every rank holds every basis, with its age
        layers = ranks[r]["half-eigen-warm"]["optimizer_state"]["kfac"]["layers"]
        assert all(e["A_eigen"] is not None and e["A_eigen"].get("age") is not None for e in layers.values())
