"""Preconditioner and KFACStep pieces on in-process ranks (threads): distributed preconditioning without processes."""

from __future__ import annotations

import math

import pytest
import torch
from nets import small_net

from spdkfac.comm import SingleProcessBackend
from spdkfac.comm.inprocess import RankError, run_ranks
from spdkfac.kfac.eigenbasis import eigen_payload, unpack_eigen
from spdkfac.kfac.layers import kfac_layers
from spdkfac.kfac.linalg import invert_spd
from spdkfac.perfmodels import load_perf_model
from spdkfac.plan.work_plan import LayerShape, WorkPlan
from spdkfac.step.preconditioning import Preconditioner, kl_clip_scale, scale_updates_

DAMPING = 0.01


def _layers(method: str, decomposed: bool = True):
    """The small net's K-FAC layers with seeded SPD factors, their decompositions and gradients (same on every rank)."""
    model = small_net(0)
    layers = kfac_layers(model, method)
    gen = torch.Generator().manual_seed(1)
    for layer in layers:
        for kind in ("A", "G"):
            d = layer.dim(kind)
            x = torch.randn(d, 2 * d, generator=gen)
            factor = x @ x.T / (2 * d)
            layer.update_factor(kind, factor, 0.0)
            if not decomposed:
                continue
            if method == "eigen":
                layer.set_decomposition(kind, unpack_eigen(eigen_payload(layer.factor(kind)), d))
            else:
                layer.set_decomposition(kind, invert_spd(layer.factor(kind), DAMPING))
        layer.module.weight.grad = torch.randn(layer.module.weight.shape, generator=gen)
        if layer.has_bias:
            layer.module.bias.grad = torch.randn(layer.module.bias.shape, generator=gen)
    return layers


def _plan(layers, workers: int, distribute: bool) -> WorkPlan:
    perf = load_perf_model(None).scaled_to(workers)
    shapes = [LayerShape(la.name, la.a_dim, la.g_dim) for la in layers]
    return WorkPlan.make(shapes, workers, perf, "lbp", layers[0].compute_method, distribute)


def _grads(layers):
    return [layer.grad_matrix().clone() for layer in layers]


def _local_result(method: str, kl_clip):
    layers = _layers(method)
    Preconditioner(layers, SingleProcessBackend(), _plan(layers, 1, False), lambda ps: None).run(DAMPING, 0.1, kl_clip)
    return _grads(layers)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("kl_clip", [None, 1e-6])
@pytest.mark.parametrize("wait_for_grads", [False, True])
def test_distributed_preconditioning_equals_local_bitwise_on_every_rank(method, kl_clip, wait_for_grads):
    expected = _local_result(method, kl_clip)
    waited = []

    def rank(backend):
        layers = _layers(method)
        plan = _plan(layers, backend.size, True)
        assert set(plan.preconditioners.values()) == set(range(backend.size))  # every rank owns a layer
        Preconditioner(layers, backend, plan, waited.append).run(DAMPING, 0.1, kl_clip, wait_for_grads=wait_for_grads)
        return _grads(layers)

    results = run_ranks(3, rank)
    for r, grads in enumerate(results):
        for i, (got, want) in enumerate(zip(grads, expected)):
            assert torch.equal(got, want), f"rank {r}, layer {i} differs from the single-process preconditioning"
    assert bool(waited) == wait_for_grads  # waits only for gradients still in flight


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_kl_clip_binds_and_scales_every_layer_alike():
    unclipped, clipped = _local_result("inverse", None), _local_result("inverse", 1e-6)
    ratios = {round(float((c / u).flatten()[0]), 9) for c, u in zip(clipped, unclipped)}
    assert len(ratios) == 1
    assert 0 < ratios.pop() < 1


def test_kl_clip_scale_formula():
    grads = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])]
    updates = [torch.tensor([[2.0, 1.0]]), torch.tensor([[-1.0]])]  # Σ v·g = 2 + 2 - 3 = 1
    assert kl_clip_scale(grads, updates, lr=0.5, kl_clip=None) is None
    assert float(kl_clip_scale(grads, updates, lr=0.5, kl_clip=1.0)) == 1.0  # sqrt(1 / 0.25) > 1
    assert float(kl_clip_scale(grads, updates, lr=0.5, kl_clip=0.01)) == math.sqrt(0.01 / 0.25)
    zero = [torch.zeros(1, 2), torch.zeros(1, 1)]
    assert float(kl_clip_scale(grads, zero, lr=0.5, kl_clip=0.01)) == 1.0  # no product: no clip
    nan = [torch.tensor([[float("nan"), 1.0]]), torch.tensor([[1.0]])]
    assert float(kl_clip_scale(grads, nan, lr=0.5, kl_clip=0.01)) == 1.0  # (the non-finite check then skips the step)


def test_kl_clip_scale_is_the_float64_sum_in_layer_order_and_scales_as_a_python_float():
    """The device-side scale equals, bitwise, the float64 arithmetic on the host (products summed in layer order)
    that it replaces, and scaling by it equals ``mul_`` by that Python float, in float32 and float64."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 7, generator=gen) for _ in range(30)]
    updates = [torch.randn(5, 7, generator=gen) * 1e-3 for _ in range(30)]
    values = [float((u * g).sum()) for g, u in zip(grads, updates)]
    vg = abs(sum(values) * 0.3**2)
    want = min(1.0, math.sqrt(1e-4 / vg))
    scale = kl_clip_scale(grads, updates, lr=0.3, kl_clip=1e-4)
    assert scale.dtype == torch.float64
    assert float(scale) == want < 1.0
    for dtype in (torch.float32, torch.float64):
        mine = [u.to(dtype) for u in updates]
        theirs = [u.to(dtype).mul_(want) for u in updates]
        scale_updates_(mine, scale)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_kl_clip_scale_weighs_each_layer_by_its_own_learning_rate():
    grads = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])]
    updates = [torch.tensor([[2.0, 1.0]]), torch.tensor([[1.0]])]  # v·g: 4 and 3
    assert float(kl_clip_scale(grads, updates, lr=[0.5, 0.1], kl_clip=0.01)) == pytest.approx(math.sqrt(0.01 / (0.25 * 4 + 0.01 * 3)))
    assert float(kl_clip_scale(grads, updates, lr=[0.5, 0.5], kl_clip=0.01)) == pytest.approx(
        float(kl_clip_scale(grads, updates, lr=0.5, kl_clip=0.01)), rel=1e-15
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_missing_decompositions_raise_on_every_rank_before_any_broadcast():
    def rank(backend):
        layers = _layers("inverse", decomposed=False)
        Preconditioner(layers, backend, _plan(layers, backend.size, True), lambda ps: None).run(DAMPING, 0.1, None)

    with pytest.raises(RankError, match="no inverses yet"):
        run_ranks(2, rank, timeout=10)
