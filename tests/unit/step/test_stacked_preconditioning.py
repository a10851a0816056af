"""Same-shape layers preconditioned stacked (spdkfac.step.stacked_preconditioning) equal the layer-by-layer computation.

The reference is the same optimizer with the grouping switched off (every
layer alone, the path every other layer takes), which the float64 reference
tests check against the definition. The two agree to rounding: a batched
product rounds as the per-matrix ones on some CPUs, not on all (MKL's
AVX-512 kernels differ for some shapes), so the tolerance is float64's or
float32's rounding over a few steps, far below what a wrong slice would change.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from nets import batch, mixed_net, small_transformer, train

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac import linalg
from spdkfac.perfmodels import PerfModel
from spdkfac.step import gradient_views, preconditioning
from spdkfac.step.gradient_views import StackedGradients
from spdkfac.step.stacked_preconditioning import StackedDecompositions, stack_key

HYPER = dict(
    lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single", perf_model=PerfModel.default()
)


class RepeatedNet(nn.Module):
    """Three residual blocks of one shape (two Linears each), an Embedding, a Linear of another shape, a head."""

    def __init__(self, skip_block: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.inp = nn.Linear(72, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3))
        self.head = nn.Linear(8, 5, bias=False)
        self.skip_block = skip_block  # run this block on even calls only: a group with a layer absent on some steps
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x[:, 0, 0, :].detach().abs() * 3).long().clamp(max=9)
        h = torch.tanh(self.inp(x.flatten(1))) + self.embed(tokens).mean(1)
        for i, block in enumerate(self.blocks):
            if i == self.skip_block and self.calls % 2:
                continue
            h = h + block(h)
        self.calls += 1
        return self.head(h)


def run(stacked: bool | None, steps: int = 6, dtype=torch.float64, skip_block=None, **options):
    """Train RepeatedNet; with ``stacked=False`` every layer is preconditioned alone (the reference)."""
    torch.manual_seed(0)
    model = RepeatedNet(skip_block).to(dtype)
    opt = SPDKFACOptimizer(model, **{**HYPER, **options})
    opt.kfac_step.preconditioner.stack_groups = stacked
    x, y = batch(16)
    train(model, opt, x.to(dtype), y, steps)
    return model, opt


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_trained_alike(reference: dict[str, torch.Tensor], stacked: dict[str, torch.Tensor]) -> None:
    """The parameters after stacked training equal layer-by-layer training's to the rounding of a few steps."""
    assert reference.keys() == stacked.keys()
    for name, value in reference.items():
        tolerance = dict(rtol=1e-12, atol=1e-14) if value.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stacked[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(factor_update_freq=2, inv_update_freq=4), dict(kl_clip=None)],
    ids=["every-step", "freq-2-4", "no-clip"],
)
def test_stacked_equals_layer_by_layer(dtype, options):
    ref_model, _ = run(stacked=False, dtype=dtype, **options)
    model, opt = run(stacked=True, dtype=dtype, **options)
    groups = [g for g in StackedDecompositions.group(opt.layers) if len(g) > 1]
    names = sorted(sorted(opt.layers[i].name for i in g) for g in groups)
    assert names == [["blocks.0.0", "blocks.1.0", "blocks.2.0"], ["blocks.0.2", "blocks.1.2", "blocks.2.2"]]
    assert_trained_alike(params(ref_model), params(model))
    assert any(not torch.equal(p, q) for p, q in zip(params(model).values(), params(RepeatedNet().to(dtype)).values()))


def test_a_group_shares_one_stack_and_keeps_no_copy():
    _, opt = run(stacked=True)
    by_name = {layer.name: layer for layer in opt.layers}
    for kind in ("A", "G"):
        held = [by_name[f"blocks.{b}.0"].decomposition(kind) for b in range(3)]
        storages = {t.untyped_storage().data_ptr() for t in held}
        assert len(storages) == 1, "each layer's decomposition is a slice of its group's stack"
        assert held[0].untyped_storage().nbytes() == 3 * held[0].numel() * held[0].element_size()
    assert stack_key(by_name["embed"]) is None  # a diagonal A: alone
    assert stack_key(by_name["inp"]) != stack_key(by_name["blocks.0.0"])


def test_new_decompositions_are_restacked():
    """A decomposition step replaces the inverses: the next preconditioning uses the new ones, not the stack's."""
    ref_model, _ = run(stacked=False, steps=7, factor_update_freq=1, inv_update_freq=2)
    model, opt = run(stacked=True, steps=7, factor_update_freq=1, inv_update_freq=2)
    assert_trained_alike(params(ref_model), params(model))
    layer = next(layer for layer in opt.layers if layer.name == "blocks.1.2")
    stack_a, _ = opt.kfac_step.preconditioner.stacks.stacked([next(x for x in opt.layers if x.name == f"blocks.{b}.2") for b in range(3)])
    assert layer.decomposition("A") is not None
    assert torch.equal(stack_a[1], layer.decomposition("A"))


def test_a_layer_absent_on_some_steps():
    """A group with a layer that did not run this step is preconditioned layer by layer, and gives the same result."""
    ref_model, _ = run(stacked=False, steps=6, skip_block=1)
    model, _ = run(stacked=True, steps=6, skip_block=1)
    assert_trained_alike(params(ref_model), params(model))


def test_checkpoint_of_stacked_decompositions_resumes_bitwise_and_is_not_larger():
    model, opt = run(stacked=True, steps=4)
    state = opt.state_dict()
    stacked_bytes = io.BytesIO()
    torch.save(state, stacked_bytes)
    _, plain_opt = run(stacked=False, steps=4)
    plain_bytes = io.BytesIO()
    torch.save(plain_opt.state_dict(), plain_bytes)
    assert stacked_bytes.getbuffer().nbytes <= plain_bytes.getbuffer().nbytes * 1.01

    resumed_model = RepeatedNet().double()
    resumed_model.load_state_dict(model.state_dict())
    resumed = SPDKFACOptimizer(resumed_model, **HYPER)
    resumed.kfac_step.preconditioner.stack_groups = True  # the same computation as the saved one's, so bitwise
    stacked_bytes.seek(0)
    resumed.load_state_dict(torch.load(stacked_bytes))
    x, y = batch(16, seed=3)
    for m, o in ((model, opt), (resumed_model, resumed)):
        train(m, o, x.double(), y, 3)
    for name, value in params(model).items():
        assert torch.equal(params(resumed_model)[name], value), name


def test_the_grouping_follows_a_changed_decomposition():
    """The groups are kept between steps; setting a decomposition (here: another dtype) regroups."""
    _, opt = run(stacked=True, steps=2)
    stacks = opt.kfac_step.preconditioner.stacks
    names = lambda: sorted(sorted(opt.layers[i].name for i in g) for g in stacks.groups(opt.layers) if len(g) > 1)  # noqa: E731
    assert names()[0] == ["blocks.0.0", "blocks.1.0", "blocks.2.0"]
    assert stacks.groups(opt.layers) is stacks.groups(opt.layers)  # kept
    layer = next(x for x in opt.layers if x.name == "blocks.1.0")
    for kind in ("A", "G"):
        layer.set_decomposition(kind, layer.decomposition(kind).float())
    assert names()[0] == ["blocks.0.0", "blocks.2.0"]


def test_by_default_layers_are_stacked_on_a_gpu_only():
    """On the CPU (where stacking measured slower) the default preconditions layer by layer, with the same result."""
    model, opt = run(stacked=None, steps=3)
    assert opt.kfac_step.preconditioner.stack_groups is None
    assert not opt.kfac_step.preconditioner.stacks._stacks  # nothing stacked
    forced, _ = run(stacked=True, steps=3)
    assert_trained_alike(params(model), params(forced))


class MixedBiases(nn.Module):
    """Two groups of one gradient shape (4, 7): Linear(6, 4) with a bias and Linear(7, 4) without, alternating."""

    def __init__(self) -> None:
        super().__init__()
        self.with_bias = nn.ModuleList(nn.Linear(6, 4) for _ in range(2))
        self.without = nn.ModuleList(nn.Linear(7, 4, bias=False) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x[:, :6], x[:, :7]
        return self.head(torch.cat([self.with_bias[0](a) + self.without[0](b), self.with_bias[1](a) * self.without[1](b)], dim=1))


def test_a_group_of_one_shape_with_and_without_biases_is_stacked_and_equals_layer_by_layer():
    results = []
    for stacked in (False, True):
        torch.manual_seed(0)
        model = MixedBiases().double()
        opt = SPDKFACOptimizer(model, **HYPER)
        opt.kfac_step.preconditioner.stack_groups = stacked
        train(model, opt, torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,)), 4)
        results.append(params(model))
        if stacked:
            groups = [g for g in StackedDecompositions.group(opt.layers) if len(g) > 1]
            assert [sorted(opt.layers[i].name for i in g) for g in groups] == [["with_bias.0", "with_bias.1", "without.0", "without.1"]]
            assert StackedGradients.of([opt.layers[i] for i in groups[0]]) is None  # read layer by layer, then stacked
    assert_trained_alike(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kl_clip_sums_a_stack_at_once_off_the_cpu(monkeypatch, dtype):
    """On a GPU a stack's per-layer products are summed by one reduction (to rounding the per-layer sums; the
    CPU keeps those, bitwise). Forced here on the CPU: the clip binds, and training matches layer by layer."""
    reductions = []

    def at_once(device: torch.device) -> bool:
        reductions.append(device)
        return True

    ref_model, _ = run(stacked=False, dtype=dtype, kl_clip=1e-4)
    monkeypatch.setattr(preconditioning, "sums_stacks_at_once", at_once)
    model, _opt = run(stacked=True, dtype=dtype, kl_clip=1e-4)
    assert len(reductions) >= 2 * 6  # two groups, every step
    tolerance = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, value in params(ref_model).items():
        torch.testing.assert_close(params(model)[name], value, **tolerance, msg=name)
    unclipped, _ = run(stacked=True, dtype=dtype, kl_clip=None)
    assert not torch.allclose(params(unclipped)["head.weight"], params(model)["head.weight"], rtol=1e-3)  # it binds


def test_kl_clip_scale_of_stacks_equals_the_per_layer_one(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    grads, updates = torch.randn(4, 6, 9, generator=gen), torch.randn(4, 6, 9, generator=gen) * 1e-2
    single_g, single_u = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    layer_grads = [grads[0], grads[1], single_g, grads[2], grads[3]]  # a stack's layers need not be adjacent
    layer_updates = [updates[0], updates[1], single_u, updates[2], updates[3]]
    stacks = [([0, 1, 3, 4], grads, updates)]
    per_layer = preconditioning.kl_clip_scale(layer_grads, layer_updates, lr=0.1, kl_clip=1e-6)
    assert float(per_layer) < 1
    assert torch.equal(preconditioning.kl_clip_scale(layer_grads, layer_updates, lr=0.1, kl_clip=1e-6, stacks=stacks), per_layer)
    monkeypatch.setattr(preconditioning, "sums_stacks_at_once", lambda device: True)
    at_once = preconditioning.kl_clip_scale(layer_grads, layer_updates, lr=0.1, kl_clip=1e-6, stacks=stacks)
    torch.testing.assert_close(at_once, per_layer, rtol=1e-6, atol=0)
    every = [([0, 1, 2, 3], grads, updates)]  # every layer in a stack: nothing left to sum layer by layer
    torch.testing.assert_close(
        preconditioning.kl_clip_scale(list(grads), list(updates), lr=0.1, kl_clip=1e-6, stacks=every),
        preconditioning.kl_clip_scale(list(grads), list(updates), lr=0.1, kl_clip=1e-6),
        rtol=1e-6,
        atol=0,
    )
    wrong = [([0, 1, 2, 3], grads, updates)]  # the positions are read: the single layer's product would be lost
    assert not torch.allclose(preconditioning.kl_clip_scale(layer_grads, layer_updates, lr=0.1, kl_clip=1e-6, stacks=wrong), per_layer)


class OneShape(nn.Module):
    """Every layer of one shape: all of them in one stack, none left alone (8 logits for the 5 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)[:, :8]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def _one_shape() -> nn.Module:
    torch.manual_seed(0)
    return OneShape().double()


@pytest.mark.parametrize("net", ["one-shape", "repeated", "transformer", "mixed"])
def test_the_gpu_choices_forced_on_the_cpu_train_as_layer_by_layer(monkeypatch, net):
    """What a GPU runs differently in a plain step (stacked groups, the KL clip's sums per stack, the finiteness check
    by norms, the write-back's copies sorted by layout), forced on the CPU: the layer-by-layer parameters to rounding."""
    make = {
        "one-shape": _one_shape,
        "repeated": lambda: RepeatedNet().double(),
        "transformer": lambda: small_transformer().double(),
        "mixed": lambda: mixed_net().double(),
    }[net]
    results = []
    for gpu in (False, True):
        if gpu:
            monkeypatch.setattr(preconditioning, "sums_stacks_at_once", lambda device: True)
            monkeypatch.setattr(linalg, "checks_by_norm", lambda device: True)
            monkeypatch.setattr(gradient_views, "copies_by_layout", lambda device: True)
        torch.manual_seed(0)
        model = make()
        opt = SPDKFACOptimizer(model, **{**HYPER, "kl_clip": 1e-4, "factor_update_freq": 2, "inv_update_freq": 4})
        opt.kfac_step.preconditioner.stack_groups = gpu
        x, y = batch(16)
        train(model, opt, x.double(), y, 6)
        results.append(params(model))
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-10, atol=1e-12, msg=name)
