"""The memory check at construction: K-FAC's state that cannot fit the device is said before the first factor step.

The estimate per layer must be what ``memory_usage()`` counts once the state
is allocated (else the warning is wrong in one direction or the other), and
the warning must name the layer to leave out.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from nets import batch, mixed_net, small_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.methods import get_method
from spdkfac.perfmodels import PerfModel
from spdkfac.plan import memory_check
from spdkfac.plan.memory_check import LayerMemory, available_bytes, fitting_max_factor_dim, layer_memory, memory_warning
from spdkfac.plan.work_plan import LayerShape, WorkPlan

BASE = dict(lr=0.05, damping=0.01, kl_clip=0.01, profile_steps=1)


def _sizes(opt: SPDKFACOptimizer) -> dict[str, int]:
    return {layer.name: layer.factor_dtype.itemsize for layer in opt.layers}


@pytest.mark.parametrize("method", ["inverse", "eigen", "ekfac"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_estimate_is_what_memory_usage_counts_once_allocated(method, dtype):
    model = mixed_net().to(dtype)  # grouped, depthwise, transposed and 3-D convolutions, an embedding, attention
    opt = SPDKFACOptimizer(model, backend="single", compute_method=method, **BASE)
    predicted = layer_memory(opt.work_plan, opt.method, 0, _sizes(opt))
    assert [la.name for la in predicted] == [layer.name for layer in opt.layers]
    x, y = batch(8)
    train(model, opt, x.to(dtype), y, 1)
    assert sum(la.bytes for la in predicted) == sum(opt.memory_usage().values())


def test_with_grad_workers_each_rank_counts_the_decompositions_it_holds():
    models = [small_net() for _ in range(2)]
    x, y = batch(16)

    def rank(backend):
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, backend=backend, grad_worker_fraction=0.5, **BASE)
        predicted = sum(la.bytes for la in layer_memory(opt.work_plan, opt.method, backend.rank, _sizes(opt)))
        half = slice(8 * backend.rank, 8 * backend.rank + 8)
        train(model, opt, x[half], y[half], 1)
        return predicted, sum(opt.memory_usage().values())

    results = run_ranks(2, rank)
    for predicted, used in results:
        assert predicted == used
    assert results[0][0] != results[1][0]  # the ranks hold different decompositions


def test_a_layer_too_wide_for_the_machine_is_named_at_construction_without_allocating():
    """A 300,000-wide output layer: G alone is 335 GiB in float32. The warning comes from the constructor, names the
    layer and the skip_layers that leaves it out; nothing that large is allocated (the address space is capped)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 300_000))
    with pytest.warns(UserWarning, match=r"the first factor step will likely run out of memory") as record:
        SPDKFACOptimizer(model, backend="single", **BASE)
    found = next(w for w in record if "run out of memory" in str(w.message))
    text = str(found.message)
    assert "The largest: '2' " in text
    assert "(G 300000x300000)" in text
    assert "skip_layers=['2']" in text
    assert "'0'" not in text  # a layer with a negligible share is not named
    assert "max_factor_dim=d (max_factor_dim=17 fits: about " in text  # the other remedy, sized: that G kept diagonal
    assert found.filename == __file__  # points at the construction in the user's script
    with warnings.catch_warnings():  # taken: the diagonal G (300,000 entries) fits, and nothing is said
        warnings.simplefilter("error")
        opt = SPDKFACOptimizer(model, backend="single", max_factor_dim=4096, **BASE)
    assert opt.layers[1].diagonal_by_width == frozenset("G")


def test_a_model_that_fits_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SPDKFACOptimizer(small_net(), backend="single", perf_model="perfmodels/reference-cpu-gloo-2.json", **BASE)


def _layers(*sizes: int) -> list[LayerMemory]:
    return [LayerMemory(f"l{i}", n, f"A {i}x{i}", n // 4) for i, n in enumerate(sizes)]


def test_the_warning_counts_the_working_memory_and_the_workers_sharing_the_host():
    layers = _layers(600, 300, 100)  # state 1000, working 5 * 150 = 750
    assert memory_warning(layers, 1750, "cpu") is None
    assert memory_warning(layers, 1749, "cpu") is not None
    assert memory_warning(layers, 1750 * 3 - 1, "cpu", sharing=3) is not None
    assert "for each of the 3 workers on it" in memory_warning(layers, 1, "cpu", sharing=3)
    assert memory_warning(layers, None, "cpu") is None  # unknown: nothing said
    named = memory_warning(layers, 1, "cuda:0")
    assert "skip_layers=['l0', 'l1', 'l2']" in named
    assert "kernel" not in named  # the CPU's silent kill is said only for the CPU
    assert "skip_layers=['l0']" in memory_warning(_layers(950, 40, 10), 1, "cpu")  # under a tenth: not named


def test_the_host_memory_is_read(monkeypatch):
    free = available_bytes(torch.device("cpu"))
    assert free is None or free > 0
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 1)
    with pytest.warns(UserWarning, match=r"run out of memory"):
        SPDKFACOptimizer(small_net(), backend="single", **BASE)


def test_the_largest_max_factor_dim_that_fits_is_found():
    """Factors 4000, 1000, 300 and 20 wide: each limit keeps the narrower ones dense; the largest that fits wins."""
    shapes = [LayerShape("wide", 300, 4000), LayerShape("mid", 20, 1000)]
    method, sizes = get_method("inverse"), {"wide": 4, "mid": 4}

    def fit(available: int):
        return fitting_max_factor_dim(shapes, lambda name: True, method, sizes, available)

    def state(limit: int) -> int:  # the state with the factors wider than limit diagonal, by layer_memory's count
        narrowed = [replace(s, g_diagonal=s.g_dim > limit, a_diagonal=s.a_dim > limit) for s in shapes]
        plan = WorkPlan.make(narrowed, 1, PerfModel.default(), "lbp", method)
        return sum(la.bytes for la in layer_memory(plan, method, 0, sizes))

    squares = {1000: 1000**2 * 4, 300: 300**2 * 4}  # the working memory: five squares of the widest dense factor
    for limit in (1000, 300):
        need = state(limit) + 5 * squares[limit]
        assert fit(need) == (limit, state(limit))
        assert fit(need - 1) != (limit, state(limit))
    assert fit(state(20) + 5 * 20**2 * 4 - 1) is None  # not even with everything but the 20-wide factor diagonal
