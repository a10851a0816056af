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


#: EKFAC keeps (and updates) each layer's scaling where the layer is preconditioned only; beside it, the same run
#: with every worker preconditioning every layer.
EKFAC = dict(BASE, placement="lbp", perf_model="expensive-eigen", compute_method="ekfac", factor_update_freq=2, inv_update_freq=4)
EKFAC_CONFIGS = {"ekfac-half": dict(EKFAC, grad_worker_fraction=0.5), "ekfac-all": EKFAC}


@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_ekfac_split_over_gradient_workers_is_bitwise_the_run_on_every_worker(engine, tmp_path):
    """Splitting changes nothing: the parameters are bitwise those of every worker preconditioning every layer
    (torch; to rounding under Horovod), which equal one process to 1e-8 absolute on 4 workers (measured 2e-9: a
    batch of 16 leaves the factors rank-deficient, their null-space basis follows rounding, and EKFAC's
    per-coordinate scaling, unlike K-FAC's, depends on that basis), and bitwise the same on every rank. Each
    layer's scaling is kept where the layer is preconditioned (its 2 gradient workers; under Horovod, without
    sub-groups, the first of them), bitwise alike, and nowhere else."""
    out = tmp_path / f"{engine}.pt"
    args = ["--configs", json.dumps(EKFAC_CONFIGS), "--global-batch", str(4 * NPROC), "--steps", str(STEPS)]
    run_workers(engine, NPROC, [WORKER, "--backend", engine, *args, "--every-rank", "--out", str(out)])
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(NPROC)]
    split, everywhere = ranks[0]["ekfac-half"]["params"], ranks[0]["ekfac-all"]["params"]
    if engine == "torch":
        _assert_bitwise_equal(split, everywhere, "params: split vs every worker")
    else:  # Horovod fuses the factor all-reduces by their timing, which the split changes: 4 workers' sums round apart
        for key, value in everywhere.items():
            torch.testing.assert_close(split[key], value, rtol=1e-6, atol=1e-8)
    ref = _reference(4 * NPROC, {"ekfac-all": EKFAC}, tmp_path)
    for key, value in ref["ekfac-all"]["params"].items():
        torch.testing.assert_close(ranks[0]["ekfac-all"]["params"][key], value, rtol=1e-6, atol=1e-8)
    layers = [ranks[r]["ekfac-half"]["optimizer_state"]["kfac"]["layers"] for r in range(NPROC)]
    kept = [{n for n, e in layers[r].items() if e["method_state"] is not None} for r in range(NPROC)]
    held = [{n for n, e in layers[r].items() if e["A_eigen"] is not None} for r in range(NPROC)]
    assert all(0 < len(h) < len(layers[0]) for h in held)
    if engine == "torch":  # each gradient worker preconditions its layers
        assert kept == held
    else:  # Horovod (no sub-groups here): each group's first rank preconditions, and sends the results to all
        assert all(k <= h for k, h in zip(kept, held))
        assert set().union(*kept) == set(layers[0])
    for r in range(1, NPROC):
        _assert_bitwise_equal(ranks[0]["ekfac-half"]["params"], ranks[r]["ekfac-half"]["params"], f"params of rank {r}")
        for name in kept[0] & kept[r]:
            _assert_bitwise_equal(layers[0][name]["method_state"], layers[r][name]["method_state"], f"{name}: scaling on rank {r}")
