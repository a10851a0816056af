"""``SPDKFACOptimizer`` on a model sharded by FSDP2 (``fully_shard``) is the optimizer on the bare model.

Two and three real ``torchrun`` gloo workers (three: uneven shards, a worker
holding fewer rows or none), float64, 6 steps, factors and decompositions
every 2. Per configuration: the sharded run's parameters and base-optimizer
state (gathered whole) equal the bare model's on the same workers (bitwise
on the convolutional net with 2 workers, where FSDP's reduce-scatter and the
optimizer's all-reduce add the same two numbers; to rounding otherwise), both
equal one process on the global batch (1e-9), and the K-FAC state every
worker holds whole is bitwise the same on every worker (each preconditions
its own rows with it). Covered: the inverse and eigen methods (the latter
with each layer preconditioned on one worker and broadcast), accumulation
(FSDP's reduce-scatter on every micro-batch, or on the last only: its
``set_requires_gradient_sync(False)``), AdamW as the base, the GradScaler
loop (FSDP's ``ShardedGradScaler``), a
``KFACPreconditioner`` attached to ``torch.optim.AdamW``, a language
model's embedding, attention (q, k, v rows of one sharded parameter), norm
layers and MLP, the same with its output layer tied to the embedding,
blocks of several layers sharded whole with an adversarial example's input
gradient taken before each training pass (left out of the factors), and a
model sharded after the optimizer was built (accelerate's order: its
parameters swapped for the shards, or left), FSDP's CPU offloading
(its policy's code paths only: the shards are on the CPU already), and a
checkpoint (the model's and the optimizer's
``state_dict()``, sharded base state and whole K-FAC state) resumed halfway
into a new sharded model and optimizer, also through
``torch.distributed.checkpoint`` with rank 0's ``kfac_state_dict()`` beside
it (momentum SGD and AdamW), and ``torch.compile`` (each layer compiled
before the sharding, or the sharded model compiled), and a layer frozen
until halfway, then unfrozen. Hybrid sharding (HSDP)
on 4 workers, a 2 x 2 mesh.
"""

from __future__ import annotations

import json

import pytest
import torch
from launch import ROOT, assert_params_match, run_single, run_workers
from nets import assert_bitwise_equal

pytestmark = pytest.mark.multiprocess

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("no FSDP2 (fully_shard) in this torch", allow_module_level=True)

WORKER = str(ROOT / "tests" / "workers" / "fsdp_check.py")
SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, factor_update_freq=2, inv_update_freq=2)
ADAMW = dict(SGD, lr=0.01, base="adamw")
del ADAMW["momentum"]
#: KFACPreconditioner's names (KAISA's) for the update frequencies; the AdamW it is attached to.
ATTACHED = dict(
    damping=0.01, factor_decay=0.9, factor_update_steps=2, inv_update_steps=2, preconditioner={"lr": 0.01, "weight_decay": 1e-3}
)
VARIANTS = {
    "plain": SGD,
    "eigen-distributed": dict(SGD, compute_method="eigen", distribute_preconditioning=True),
    "accum": dict(SGD, accumulation_steps=2),
    "accum-no-sync": dict(SGD, accumulation_steps=2, no_sync=True),
    "adamw": ADAMW,
    "grad-scaler": dict(SGD, amp=True),
    "preconditioner": ATTACHED,
    "language": dict(SGD, model="language", norm_layers="kfac"),
    "tied": dict(SGD, model="tied"),
    "blocks-attacked": dict(SGD, model="blocks", attack=True),
    "resumed": dict(SGD, compute_method="eigen", resume=True),
    "resumed-dcp": dict(SGD, resume="dcp"),
    "resumed-dcp-adamw": dict(ADAMW, resume="dcp"),
    "compiled-layers": dict(SGD, compile="layers"),
    "compiled-root": dict(SGD, compute_method="eigen", compile="root"),
    "unfrozen-halfway": dict(SGD, unfreeze=True),
    "sharded-later": dict(SGD, shard_later="swapped"),
    "sharded-later-left": dict(SGD, compute_method="eigen", shard_later="left"),
    "sharded-later-language": dict(SGD, model="language", norm_layers="kfac", shard_later="swapped"),
    "sharded-later-preconditioner": dict(ATTACHED, shard_later="swapped"),
    "cpu-offload": dict(SGD, offload=True),
}
CONFIGS = {f"{kind}-{name}": dict(options, fsdp=kind == "fsdp") for name, options in VARIANTS.items() for kind in ("bare", "fsdp")}
#: Bitwise the bare run's with 2 workers; the others add their averages in another order (FSDP averages each
#: micro-batch's gradient) or differ in the last bits (the language model).
BITWISE = {"plain", "eigen-distributed", "accum-no-sync", "adamw", "grad-scaler", "preconditioner"}
BITWISE |= {"resumed", "resumed-dcp", "resumed-dcp-adamw", "blocks-attacked", "unfrozen-halfway"}
BITWISE |= {"sharded-later", "sharded-later-left", "sharded-later-preconditioner", "cpu-offload"}


def test_hybrid_sharding_equals_bare_and_one_process(tmp_path):
    """HSDP: 4 workers, a 2 x 2 mesh (rows over each replica group of 2, replicated across the groups); FSDP then
    adds 4 workers' gradients in another order than the optimizer's all-reduce: equal to rounding."""
    configs = {
        f"{kind}-{name}": dict(VARIANTS[name], fsdp=kind == "fsdp", hybrid=True)
        for name in ("plain", "language", "eigen-distributed")
        for kind in ("bare", "fsdp")
    }
    args = ["--configs", json.dumps(configs), "--global-batch", "16", "--steps", "6"]
    run_workers("torch", 4, [WORKER, *args, "--out", str(tmp_path / "dist.pt")])
    run_single(WORKER, [*args, "--out", str(tmp_path / "single.pt")])
    ranks = [torch.load(tmp_path / f"dist.pt.rank{r}", weights_only=False) for r in range(4)]
    single = torch.load(tmp_path / "single.pt.rank0", weights_only=False)
    for name in configs:
        for r in range(1, 4):
            factors = [{k: (v["A"], v["G"]) for k, v in ranks[q][name]["kfac_state"]["layers"].items()} for q in (0, r)]
            assert_bitwise_equal(factors[0], factors[1], f"{name}: K-FAC factors of rank {r}")
    for name in ("plain", "language", "eigen-distributed"):
        assert_params_match({name: ranks[0][f"bare-{name}"]}, {name: ranks[0][f"fsdp-{name}"]}, [name], rtol=1e-12, atol=1e-14)
    assert_params_match(single, ranks[0], list(configs))


def test_a_model_sharded_after_the_first_step_or_a_load_is_refused_with_the_remedy(tmp_path):
    """The base state then belongs to the parameters FSDP replaced: the next step raises, naming the sharding and
    saying to build the optimizer on the sharded model (the forward passes after the first training pass no longer
    look for a wrapper); after a load, the first forward pass raises."""
    configs = {
        "fsdp-late": dict(SGD, fsdp=True, shard_later="after-a-step"),
        "fsdp-loaded": dict(SGD, fsdp=True, shard_later="after-a-load"),
    }
    args = ["--configs", json.dumps(configs), "--global-batch", "8", "--steps", "3"]
    run_workers("torch", 2, [WORKER, *args, "--out", str(tmp_path / "dist.pt")])
    for r in range(2):
        results = torch.load(tmp_path / f"dist.pt.rank{r}", weights_only=False)
        refused = results["fsdp-late"]["refused"]
        assert "'0.weight' was sharded by fully_shard() after this optimizer took its first step" in refused
        assert "build the optimizer on the sharded model" in refused
        refused = results["fsdp-loaded"]["refused"]  # (found at the forward pass: no training pass before it)
        assert "sharded by fully_shard() after this optimizer took or loaded 1 step(s)" in refused
        assert "load the checkpoint into it" in refused


@pytest.mark.parametrize("nproc", [2, 3])
def test_fully_sharded_model_equals_bare_and_one_process(nproc, tmp_path):
    args = ["--configs", json.dumps(CONFIGS), "--global-batch", str(4 * nproc), "--steps", "6"]
    run_workers("torch", nproc, [WORKER, *args, "--out", str(tmp_path / "dist.pt")])
    run_single(WORKER, [*args, "--out", str(tmp_path / "single.pt")])
    ranks = [torch.load(tmp_path / f"dist.pt.rank{r}", weights_only=False) for r in range(nproc)]
    single = torch.load(tmp_path / "single.pt.rank0", weights_only=False)
    for name, config in CONFIGS.items():
        assert ranks[0][name]["steps"] == 6, name
        states = [ranks[r][name]["kfac_state"] for r in range(nproc)]
        if "distribute_preconditioning" in config:  # each rank holds the decompositions of its own layers only
            states = [{k: (v["A"], v["G"]) for k, v in st["layers"].items()} for st in states]
        for r in range(1, nproc):
            assert_bitwise_equal(states[0], states[r], f"{name}: K-FAC state of rank {r}")
        assert ranks[0][name]["layers"] == single[name]["layers"], name
    for variant in VARIANTS:
        bare, sharded = ranks[0][f"bare-{variant}"], ranks[0][f"fsdp-{variant}"]
        if nproc == 2 and variant in BITWISE:
            assert_bitwise_equal(bare["params"], sharded["params"], f"{variant}: parameters")
            assert_bitwise_equal(bare["base_state"], sharded["base_state"], f"{variant}: base optimizer state")
        else:
            assert_params_match({variant: bare}, {variant: sharded}, [variant], rtol=1e-12, atol=1e-14)
    assert_params_match(single, ranks[0], list(CONFIGS))
