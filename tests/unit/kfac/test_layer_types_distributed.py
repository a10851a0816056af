"""N workers equal one for a net mixing every supported layer type, on the in-process backend and under real launchers.

The in-process runs (ranks as threads, :mod:`spdkfac.comm.inprocess`) cover
both compute methods, every placement, with and without distributed
preconditioning; the multi-process runs (``torchrun``, ``horovodrun``) the
same net under each engine. Float64, tolerance 1e-9, as the other
equivalence tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, assert_params_match, require_horovod, run_single, run_workers
from nets import batch, mixed_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.perfmodels import PerfModel

STEPS = 4
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)


def _perf() -> PerfModel:
    """Decompositions dear next to broadcasts for the larger factors: some owned and broadcast, some local."""
    data = PerfModel.default().to_dict()
    data["inverse"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-5], "floor": 1e-6}
    data["eigen"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-5], "floor": 1e-6}
    data["broadcast"] = {"alpha": 1e-2, "beta": 1e-6}
    return PerfModel.from_dict(data, "mixed-test")


CONFIGS = {
    f"{method}-{placement}{'-dp' if dp else ''}": dict(BASE, compute_method=method, placement=placement, distribute_preconditioning=dp)
    for method in ("inverse", "eigen")
    for placement in ("lbp", "seq", "local")
    for dp in (False, True)
}
CONFIGS["inverse-lbp-freq-2-4"] = dict(BASE, placement="lbp", factor_update_freq=2, inv_update_freq=4)


def _train(backend, config: dict, global_batch: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Train ``model`` (built outside the rank threads: seeding is process-wide) on this rank's shard."""
    x, y = batch(global_batch)
    size = 1 if isinstance(backend, str) else backend.size
    rank = 0 if isinstance(backend, str) else backend.rank
    local = global_batch // size
    opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **config)
    train(model, opt, x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local], STEPS)
    owners = {"/".join(a.key): a.owner for a in opt.work_plan.inversion.assignments}
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "owners": owners}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_mixed_layer_types_n_workers_equal_one_in_process(workers, name, float64):
    init = mixed_net().state_dict()
    config = CONFIGS[name]
    ref = _train("single", config, 6 * workers, mixed_net())["params"]
    models = [mixed_net() for _ in range(workers)]
    ranks = run_ranks(workers, lambda b: _train(b, config, 6 * workers, models[b.rank]))
    for r, result in enumerate(ranks):
        for key, value in ref.items():
            torch.testing.assert_close(result["params"][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key: f"{name}/{k}: {m}")
            if r:
                assert torch.equal(result["params"][key], ranks[0]["params"][key]), f"{name}/{key} differs between ranks"
    assert any(not torch.equal(ref[k], init[k]) for k in init), name
    owners = ranks[0]["owners"]
    if name.endswith("-dp"):  # MEM-OPT: each layer's one gradient worker decomposes its factors, nothing is sent
        assert set(owners.values()) == {-1}, (name, owners)
        return
    if name.startswith(("inverse-lbp", "eigen-lbp")):
        assert any(o >= 0 for o in owners.values()), (name, owners)
        assert any(o == -1 for o in owners.values()), (name, owners)
    if "-seq" in name:
        assert set(owners.values()) == set(range(workers)), (name, owners)


WORKER = str(ROOT / "tests" / "workers" / "train_configs.py")
MP_CONFIGS = {
    name: dict(CONFIGS[name], model="mixed", perf_model="expensive-inverse" if name.startswith("inverse") else "expensive-eigen")
    for name in ("inverse-lbp", "eigen-seq-dp", "inverse-lbp-freq-2-4")
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_mixed_layer_types_multiprocess_equal_one(engine, tmp_path):
    if engine == "horovod":
        require_horovod()
    common = ["--configs", json.dumps(MP_CONFIGS), "--global-batch", "8", "--steps", str(STEPS)]
    ref_out, dist_out = tmp_path / "ref.pt", tmp_path / "dist.pt"
    run_single(WORKER, [*common, "--out", str(ref_out), "--no-accumulation"])
    run_workers(engine, 2, [WORKER, "--backend", engine, *common, "--out", str(dist_out)])
    ref, dist = torch.load(ref_out), torch.load(dist_out)
    assert_params_match(ref, dist, list(MP_CONFIGS))
    init = mixed_net().state_dict()
    for name in MP_CONFIGS:
        assert any(not torch.allclose(ref[name]["params"][k], init[k].to(torch.float64)) for k in init), name
