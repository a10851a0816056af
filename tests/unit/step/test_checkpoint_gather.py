"""consolidate_state_dict(): a checkpoint of split decompositions that resumes bit for bit (2 in-process workers).

With ``grad_worker_fraction`` 1/2 each worker keeps its own layers'
decompositions; rank 0's checkpoint gathered first holds every one, so a
resume between two refreshes goes on with them (the uninterrupted run, bit
for bit), where rank 0's plain checkpoint makes every worker recompute them
at its first step. The real torchrun/horovodrun run is
tests/multiprocess/test_checkpoint_gather_multiprocess.py.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import run_ranks
from spdkfac.comm.inprocess import RankError
from spdkfac.kfac.factor_shape import FactorShape
from spdkfac.kfac.methods import METHODS, DecompositionMethod, EigenMethod, InverseMethod, get_method
from spdkfac.step.checkpoint_gather import gather_decompositions
from spdkfac.train.checkpoint import content_digest

pytestmark = [
    pytest.mark.filterwarnings("ignore:no perf_model given"),
    pytest.mark.filterwarnings("ignore:this state_dict\\(\\) holds this worker's share"),  # (saved without the gather on purpose)
]

OPTIONS = dict(lr=0.05, momentum=0.9, damping=0.01, factor_update_freq=1, inv_update_freq=3, grad_worker_fraction=0.5)
GLOBAL, STEPS, RESUME_AT = 12, 6, 4  # refreshes at steps 0 and 3: the resumed steps 4, 5 use step 3's


def _step(model, optimizer, s, rank, size):
    x, y = batch(GLOBAL, seed=100 + s)
    per = GLOBAL // size
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
    optimizer.step()


def _build(model, backend, options, attached: bool):
    """The optimizer to step and save, and what detaches it: ours, or SGD with the preconditioner attached (KAISA's
    option names), saved through SGD's own state_dict()."""
    if not attached:
        optimizer = SPDKFACOptimizer(model, backend=backend, **options)
        return optimizer, optimizer.remove_hooks
    sgd = torch.optim.SGD(model.parameters(), lr=options["lr"], momentum=options["momentum"])
    kaisa = {"factor_update_steps": options["factor_update_freq"], "inv_update_steps": options["inv_update_freq"]}
    rest = {"compute_method": "inverse", **{k: v for k, v in options.items() if k in ("damping", "grad_worker_fraction", "compute_method")}}
    preconditioner = KFACPreconditioner(model, optimizer=sgd, backend=backend, **kaisa, **rest)
    return sgd, preconditioner.remove_hooks


def _run(options, consolidate: bool | None, attached: bool = False):
    """Every rank's parameters after STEPS steps: uninterrupted (``consolidate`` None), or resumed at RESUME_AT
    from rank 0's checkpoint (gathered first or not), loaded by every worker into a new model and optimizer."""
    models = [small_net() for _ in range(4)]  # built here: torch.manual_seed in threads would race
    saved: dict[str, dict] = {}

    def first(backend):
        model = models[backend.rank]
        optimizer, detach = _build(model, backend, options, attached)
        for s in range(RESUME_AT if consolidate is not None else STEPS):
            _step(model, optimizer, s, backend.rank, 2)
        if consolidate is None:
            return model.state_dict()
        saved[f"own{backend.rank}"] = optimizer.state_dict()
        if consolidate:
            optimizer.consolidate_state_dict()  # (attached: the method the preconditioner adds to SGD, Lightning's call)
        if backend.rank == 0:
            saved["checkpoint"] = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        detach()
        return None

    out = run_ranks(2, first)
    if consolidate is None:
        return out, saved

    def second(backend):
        model = models[2 + backend.rank]
        optimizer, _ = _build(model, backend, options, attached)
        model.load_state_dict(copy.deepcopy(saved["checkpoint"]["model"]))
        optimizer.load_state_dict(copy.deepcopy(saved["checkpoint"]["optimizer"]))
        for s in range(RESUME_AT, STEPS):
            _step(model, optimizer, s, backend.rank, 2)
        return model.state_dict()

    return run_ranks(2, second), saved


def _held(kfac, suffix):
    return {name for name, entry in kfac["layers"].items() if entry[f"A{suffix}"] is not None}


#: EKFAC keeps each layer's scaling (Adam's moments) where the layer is preconditioned: gathered too.
METHOD_OPTIONS = {
    "inverse": {},
    "eigen": {"compute_method": "eigen"},
    "ekfac": {"compute_method": "ekfac"},
    "ekfac-adam": {"compute_method": "ekfac", "ekfac_update": "adam", "base": "adamw", "lr": 0.01, "momentum": None},
}


def _options(method: str) -> dict:
    return {k: v for k, v in {**OPTIONS, **METHOD_OPTIONS[method]}.items() if v is not None}


@pytest.mark.parametrize("method", list(METHOD_OPTIONS))
def test_a_gathered_checkpoint_resumes_the_uninterrupted_run_bitwise(float64, method):
    options = _options(method)
    suffix = "_inv" if method == "inverse" else "_eigen"
    uninterrupted, _ = _run(options, None)
    resumed, saved = _run(options, True)
    assert content_digest(resumed[0]) == content_digest(resumed[1])  # bitwise replicas
    assert content_digest(resumed[0]) == content_digest(uninterrupted[0])
    gathered = saved["checkpoint"]["optimizer"]["kfac"]
    own = [_held(saved[f"own{r}"]["kfac"], suffix) for r in range(2)]
    assert own[0]
    assert own[1]
    assert not own[0] & own[1]
    assert _held(gathered, suffix) == own[0] | own[1] == set(gathered["layers"])
    for name in own[1]:  # rank 0 got rank 1's bits, and holds them on the CPU
        for kind in "AG":
            mine, theirs = gathered["layers"][name][f"{kind}{suffix}"], saved["own1"]["kfac"]["layers"][name][f"{kind}{suffix}"]
            assert content_digest(mine) == content_digest(theirs)
            assert all(t.device.type == "cpu" for t in (mine.values() if isinstance(mine, dict) else [mine]) if isinstance(t, torch.Tensor))
        if method.startswith("ekfac"):  # the scaling too, kept where the layer is preconditioned only
            assert content_digest(gathered["layers"][name]["method_state"]) == content_digest(
                saved["own1"]["kfac"]["layers"][name]["method_state"]
            )
            assert saved["own0"]["kfac"]["layers"][name]["method_state"] is None


def test_without_the_gather_the_resume_refreshes_early(float64):
    """The contrast the gather removes: rank 0's own checkpoint lacks rank 1's decompositions, so the resumed run
    recomputes them all at step 4 (from newer factors) and leaves the uninterrupted run."""
    uninterrupted, _ = _run(OPTIONS, None)
    resumed, saved = _run(OPTIONS, False)
    assert content_digest(resumed[0]) == content_digest(resumed[1])
    assert content_digest(resumed[0]) != content_digest(uninterrupted[0])
    assert _held(saved["checkpoint"]["optimizer"]["kfac"], "_inv") != set(saved["checkpoint"]["optimizer"]["kfac"]["layers"])


def test_an_ekfac_checkpoint_without_every_layers_scaling_is_refused(float64):
    """Unlike a decomposition, EKFAC's scaling cannot be recomputed: rank 0's own checkpoint lacks rank 1's layers'
    and every worker refuses it alike, naming the layers and the fix."""
    with pytest.raises(RankError, match=r"lacks compute_method='ekfac''s per-layer state of layers \[.*consolidate_state_dict"):
        _run(_options("ekfac"), False)


@pytest.mark.parametrize("attached", [False, True])
def test_each_workers_own_ekfac_state_loads_back_before_the_first_step(float64, attached):
    """accelerate's prepare() (Hugging Face's Trainer) loads each worker's own state_dict() back before training:
    every scaling is fresh then, so the layers others keep are no loss, and the run is the untouched one bit for
    bit."""
    options = _options("ekfac")
    untouched, _ = _run(options, None, attached=attached)
    models = [small_net() for _ in range(2)]

    def worker(backend):
        model = models[backend.rank]
        optimizer, _ = _build(model, backend, options, attached)
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for s in range(STEPS):
            _step(model, optimizer, s, backend.rank, 2)
        return model.state_dict()

    reloaded = run_ranks(2, worker)
    assert content_digest(reloaded[0]) == content_digest(untouched[0])


def test_the_gather_is_dropped_by_the_next_step_and_sends_nothing_before_the_first(float64):
    models = [small_net(), small_net()]

    def worker(backend):
        model = models[backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
        optimizer.consolidate_state_dict()  # nothing decomposed yet: nothing to send, nothing added
        before = _held(optimizer.state_dict()["kfac"], "_inv")
        _step(model, optimizer, 0, backend.rank, 2)
        optimizer.consolidate_state_dict()
        gathered = _held(optimizer.state_dict()["kfac"], "_inv")
        _step(model, optimizer, 1, backend.rank, 2)
        after = _held(optimizer.state_dict()["kfac"], "_inv")
        return before, gathered, after, {layer.name for layer in optimizer.layers}

    (before, gathered, after, names), (_, gathered1, after1, _) = run_ranks(2, worker)
    assert before == set()
    assert gathered == names  # rank 0: all
    assert after != names
    assert after1 != names
    assert not after & after1
    assert gathered1 == after1  # rank 1 was not the one gathered to


@pytest.mark.parametrize("method", ["inverse", "ekfac"])
def test_the_attached_optimizers_gather_resumes_bitwise(float64, method):
    """SGD with the preconditioner attached gains ``consolidate_state_dict()`` (what Lightning calls on every worker
    before each checkpoint of an optimizer that has it): rank 0's SGD.state_dict() then holds every worker's K-FAC
    state, and the resume is the uninterrupted run bit for bit; without it, EKFAC's checkpoint is refused."""
    options = _options(method)
    uninterrupted, _ = _run(options, None, attached=True)
    resumed, saved = _run(options, True, attached=True)
    assert content_digest(resumed[0]) == content_digest(resumed[1])
    assert content_digest(resumed[0]) == content_digest(uninterrupted[0])
    suffix = "_inv" if method == "inverse" else "_eigen"
    gathered = saved["checkpoint"]["optimizer"]["kfac_preconditioner"]["kfac"]
    assert _held(gathered, suffix) == set(gathered["layers"]) != _held(saved["own0"]["kfac_preconditioner"]["kfac"], suffix)
    if method == "ekfac":
        with pytest.raises(RankError, match="lacks compute_method='ekfac''s per-layer state"):
            _run(options, False, attached=True)


def test_the_preconditioner_gathers_to_any_rank(float64):
    models = [small_net(), small_net()]

    def worker(backend):
        model = models[backend.rank]
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        preconditioner = KFACPreconditioner(model, optimizer=sgd, backend=backend, grad_worker_fraction=0.5, damping=0.01)
        x, y = batch(GLOBAL, seed=1)
        per = GLOBAL // 2
        sgd.zero_grad()
        nn.functional.cross_entropy(model(x[backend.rank * per : (backend.rank + 1) * per]), y[:per]).backward()
        sgd.step()
        preconditioner.consolidate_state_dict(to=1)
        return _held(sgd.state_dict()["kfac_preconditioner"]["kfac"], "_eigen"), {layer.name for layer in preconditioner.layers}

    (rank0, names), (rank1, _) = run_ranks(2, worker)
    assert rank1 == names
    assert rank0 != names


def test_a_rank_outside_the_job_is_refused():
    model = small_net()
    optimizer = SPDKFACOptimizer(model, backend="single", **OPTIONS)
    with pytest.raises(ValueError, match="to=1 is not a rank of this job"):
        gather_decompositions(optimizer.layers, optimizer.work_plan.holders, 1, optimizer.backend)


def _factor(shape: FactorShape, seed: int) -> torch.Tensor:
    """A random SPD factor of ``shape`` in its full form (the method's input)."""
    g = torch.Generator().manual_seed(seed)
    if shape.diagonal:
        return torch.rand(shape.dim, generator=g, dtype=torch.float64) + 0.1
    x = torch.randn(shape.blocks, shape.dim, 3 * shape.dim, generator=g, dtype=torch.float64)
    full = x @ x.transpose(-1, -2) / (3 * shape.dim)
    return full[0] if shape.blocks == 1 else full


@pytest.mark.parametrize("name", [*sorted(METHODS), "eigen-warm"])
@pytest.mark.parametrize("shape", [FactorShape(7), FactorShape(5, blocks=3), FactorShape(6, diagonal=True)], ids=str)
@pytest.mark.parametrize("placed", ["owned", "local"])
def test_every_method_sends_what_rebuilds_its_kept_value_bitwise(name, shape, placed):
    """What a holder sends (``payload``) rebuilds, on the rank gathered to, bitwise the value the holder keeps: for
    a decomposition it broadcast and for one it made alone (placed on every holder)."""
    method = EigenMethod("warm", full_every=4) if name == "eigen-warm" else get_method(name)
    kept = None
    for seed in (1, 2):  # (a second decomposition, from the first: the warm methods' path)
        factor = _factor(shape, seed)
        kept = method.owned(shape, factor, 0.01, kept)[0] if placed == "owned" else method.local(shape, factor, 0.01, kept)
    payload = method.payload(kept, shape)
    assert payload.numel() == method.payload_size(shape)
    rebuilt = method.received(payload.clone(), shape)
    want, got = method.tensors(kept), method.tensors(rebuilt)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert content_digest(method.save(rebuilt)) == content_digest(method.save(kept))


def test_a_method_keeping_another_form_than_it_sends_must_say_how():
    class Halved(InverseMethod):  # keeps the full inverse but sends half of it: the default cannot know how
        def payload_size(self, shape):
            return math.prod(shape.full_shape) // 2

    method, shape = Halved(), FactorShape(4)
    with pytest.raises(NotImplementedError, match=r"Halved keeps 16 elements .* sends 8: it must define payload"):
        DecompositionMethod.payload(method, torch.eye(4), shape)


def test_a_checkpoint_without_the_gather_is_warned_about_once_per_worker(float64):
    models = [small_net(), small_net()]

    def worker(backend):
        model = models[backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
        optimizer.state_dict()  # before the first step: nothing decomposed, nothing to say
        _step(model, optimizer, 0, backend.rank, 2)
        optimizer.consolidate_state_dict()
        optimizer.state_dict()  # gathered (on rank 1 too, which was not gathered to): nothing to say
        _step(model, optimizer, 1, backend.rank, 2)
        optimizer.state_dict()
        optimizer.state_dict()  # said once

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ranks(2, worker)
    said = [w for w in caught if "holds this worker's share of the K-FAC state only" in str(w.message)]
    assert len(said) == 2  # once on each worker
    assert "consolidate_state_dict() on every worker" in str(said[0].message)


def test_the_gather_between_backward_and_step_is_refused(float64):
    model = small_net()
    optimizer = SPDKFACOptimizer(model, backend="single", **OPTIONS)
    x, y = batch(4, seed=0)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(\) between backward\(\) and step\(\)"):
        optimizer.consolidate_state_dict()
    optimizer.step()
    optimizer.consolidate_state_dict()  # (one worker: nothing to send)


def test_a_warm_ekfac_checkpoint_without_the_gather_is_warned_about(float64):
    """A warm basis is held by every worker, but EKFAC's scaling only where its layer is preconditioned."""
    models = [small_net(), small_net()]
    options = _options("ekfac") | {"eigen_refresh": "warm"}

    def worker(backend):
        model = models[backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **options)
        _step(model, optimizer, 0, backend.rank, 2)
        optimizer.state_dict()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ranks(2, worker)
    said = [str(w.message) for w in caught if "holds this worker's share of the K-FAC state only" in str(w.message)]
    assert len(said) == 2
    assert "is refused (ekfac's per-layer state cannot be recomputed)" in said[0]
