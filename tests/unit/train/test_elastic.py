"""ElasticState (Horovod's elastic mode) in one process, and SPDKFACOptimizer.replan() at another size in-process.

The real ``horovodrun --min-np/--max-np`` run is tests/multiprocess/test_elastic_horovod.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import KFACParamScheduler, KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import run_ranks
from spdkfac.train.checkpoint import content_digest

pytest.importorskip("horovod.common.elastic")

from spdkfac.train.elastic import ElasticState

OPTIONS = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, kl_clip=0.01, factor_update_freq=1, inv_update_freq=2)
GLOBAL = 12


def _step(model, optimizer, s, rank=0, size=1, call_step=True):
    x, y = batch(GLOBAL, seed=100 + s)
    per = GLOBAL // size
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
    if call_step:
        optimizer.step()


def _digest(model, optimizer, *others):
    return content_digest({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "others": [o.state_dict() for o in others]})


def _state(model, optimizer, **values):
    return ElasticState(model, optimizer, bcast_object=lambda obj: obj, get_rank=lambda: 0, **values)


def test_restore_gives_back_the_commit_bit_for_bit_twice(float64):
    model = small_net()
    optimizer = SPDKFACOptimizer(model, backend="single", **OPTIONS)
    scheduler = KFACParamScheduler(optimizer, damping_alpha=0.5, damping_schedule=[1])
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.9**e)
    state = _state(model, optimizer, kfac_scheduler=scheduler, lr_scheduler=lr, step=0, seen=[])
    for s in range(3):
        _step(model, optimizer, s)
        state.step += 1
        state.seen.append(s)
    scheduler.step()
    lr.step()
    state.commit()
    committed = _digest(model, optimizer, scheduler, lr)
    for attempt in range(2):  # the live objects never alias the commit: a second restore gives it back as well
        for s in range(3, 5):
            _step(model, optimizer, s)
            state.step += 1
            state.seen.append(s)
        scheduler.step()
        lr.step()
        assert _digest(model, optimizer, scheduler, lr) != committed
        state.restore()
        assert _digest(model, optimizer, scheduler, lr) == committed, attempt
        assert (state.step, state.seen) == (3, [0, 1, 2])


def test_a_step_abandoned_mid_way_is_dropped_and_training_continues_as_if_it_never_ran(float64):
    """A worker lost between backward() and step(): restore() drops the step in progress, its collectives in flight."""
    models = [small_net() for _ in range(4)]  # built here: torch.manual_seed in two threads at once would race

    def worker(backend):
        model = models[backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
        state = _state(model, optimizer)
        for s in range(2):
            _step(model, optimizer, s, backend.rank, 2)
        state.commit()
        _step(model, optimizer, 2, backend.rank, 2, call_step=False)  # factors and gradients sent, the step never taken
        state.restore()
        for s in range(2, 5):
            _step(model, optimizer, s, backend.rank, 2)
        return content_digest(model.state_dict())

    def uninterrupted(backend):
        model = models[2 + backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **OPTIONS)
        for s in range(5):
            _step(model, optimizer, s, backend.rank, 2)
        return content_digest(model.state_dict())

    assert run_ranks(2, worker) == run_ranks(2, uninterrupted)


def test_values_that_are_names_of_the_state_are_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'commit' is a name of ElasticState"):
        _state(model, torch.optim.SGD(model.parameters(), lr=0.1), commit=1)
    with pytest.raises(TypeError, match="optimizer must have state_dict"):
        _state(model, object())


SPLIT = {"distribute_preconditioning": True}


@pytest.mark.parametrize(
    ("options", "committed_at", "consolidate", "continues"),
    [({}, 4, False, True), (SPLIT, 4, False, True), (SPLIT, 5, True, True), (SPLIT, 5, False, False)],
    ids=["lbp", "decompositions-split", "split-gathered-between-refreshes", "split-between-refreshes"],
)
def test_replan_at_another_size_continues_the_one_process_computation(float64, options, committed_at, consolidate, continues):
    """2 workers, committed after ``committed_at`` steps, then 3 (two re-planned in place, one new): as one process on
    the same global batches.

    With the decompositions split over the workers (fraction 1/P) rank 0's commit holds only its own, so every
    worker recomputes them all at the next step (``load_state_dict``): the same run where that step refreshes them
    anyway (after step 4; every 2), one early refresh otherwise (after step 5), as after a torchrun restart, which
    leaves the one-process computation; unless ``consolidate_state_dict()`` gave rank 0 every worker's before the
    commit.
    """
    config = {**OPTIONS, **options, "profile_steps": 1}
    models = [small_net(), small_net(), small_net(seed=1)]  # built here: torch.manual_seed in threads would race

    def first(backend):
        model = models[backend.rank]
        optimizer = SPDKFACOptimizer(model, backend=backend, **config)
        for s in range(committed_at):
            _step(model, optimizer, s, backend.rank, 2)
        if consolidate:
            optimizer.consolidate_state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the notice of a commit that holds this worker's decompositions only)
            commit = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        return model, optimizer, commit

    before = run_ranks(2, first)
    commit = before[0][2]  # rank 0's, as ElasticState.sync sends it

    def second(backend):
        if backend.rank < 2:  # the same objects, re-planned (as after hvd.elastic's reset; the engine object there stays)
            model, optimizer, _ = before[backend.rank]
            optimizer.backend = backend
            optimizer.replan()
            assert optimizer.fusion_plan() == {"A": None, "G": None}  # 'optimal' fusion is profiled again
        else:  # a worker that joins
            model = models[2]
            optimizer = SPDKFACOptimizer(model, backend=backend, **config)
        assert optimizer.work_plan.workers == 3
        model.load_state_dict(copy.deepcopy(commit["model"]))
        optimizer.load_state_dict(copy.deepcopy(commit["optimizer"]))
        for s in range(committed_at, committed_at + 3):
            _step(model, optimizer, s, backend.rank, 3)
        return content_digest(model.state_dict()), {k: v.clone() for k, v in model.state_dict().items()}

    after = run_ranks(3, second)
    assert len({digest for digest, _ in after}) == 1  # bitwise replicas (each rank holds only its own decompositions when split)

    ref_model = small_net()
    ref = SPDKFACOptimizer(ref_model, backend="single", **config)
    for s in range(committed_at + 3):
        _step(ref_model, ref, s)
    gap = max((after[0][1][name] - value).abs().max().item() for name, value in ref_model.state_dict().items())
    if continues:
        for name, value in ref_model.state_dict().items():
            torch.testing.assert_close(after[0][1][name], value, rtol=1e-9, atol=1e-11)
    else:
        assert gap > 1e-6


@pytest.mark.parametrize("attached", [False, True])
def test_ekfac_with_split_preconditioning_is_refused(attached):
    """Its per-layer scaling lives where each layer is preconditioned: a restored or re-planned worker would lack it."""
    model = small_net()
    options = dict(compute_method="ekfac", grad_worker_fraction=0.5, backend="single")
    optimizer = KFACPreconditioner(model, **options) if attached else SPDKFACOptimizer(model, lr=0.1, **options)
    with pytest.raises(ValueError, match="not supported in Horovod's elastic mode; use grad_worker_fraction=1"):
        _state(model, optimizer)
    optimizer.remove_hooks()
    _state(model, SPDKFACOptimizer(model, lr=0.1, compute_method="ekfac", backend="single"))  # every worker keeps all


def test_replan_refuses_a_ddp_model():
    model = small_net()
    optimizer = SPDKFACOptimizer(model, backend="single", **OPTIONS)
    optimizer.wrapping.ddp = object()  # what a DistributedDataParallel model sets (no process group needed to refuse)
    with pytest.raises(ValueError, match=r"DistributedDataParallel \(or fully_shard\) model's process group cannot change size"):
        optimizer.replan()


def test_a_preconditioner_and_its_torch_optimizer_are_committed_and_restored_together(float64):
    """KAISA's usage: KFACPreconditioner (re-planned, its K-FAC state) plus the user's torch optimizer (its state)."""
    model = small_net()
    preconditioner = KFACPreconditioner(model, lr=0.05, damping=0.01, backend="single")
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = _state(model, preconditioner, sgd=sgd, step=0)

    def step(s):
        x, y = batch(GLOBAL, seed=100 + s)
        sgd.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        preconditioner.step()
        sgd.step()

    for s in range(2):
        step(s)
    state.commit()
    committed = _digest(model, preconditioner, sgd)
    for s in range(2, 4):
        step(s)
    assert _digest(model, preconditioner, sgd) != committed
    state.restore()
    assert _digest(model, preconditioner, sgd) == committed
    assert preconditioner.steps == 2
