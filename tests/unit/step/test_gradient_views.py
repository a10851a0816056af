"""The layers' gradients read and written through views (spdkfac.step.gradient_views): what each layer's own
grad_matrix() reads and write_grad() leaves, bitwise, for every layer type; the others keep their own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from nets import batch, mixed_net, small_transformer

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.layer_types.linear import LinearHelper
from spdkfac.perfmodels import PerfModel
from spdkfac.step import gradient_views as gradient_views_module
from spdkfac.step.gradient_views import GradientWrites, StackedGradients, _views_are_its_gradient, gradient_views, same_layout

HYPER = dict(lr=0.05, damping=0.01, backend="single", perf_model=PerfModel.default())


class Repeated(nn.Module):
    """Three modules of one type and shape side by side on one input (or one attention module: its q, k, v)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.parts = nn.ModuleList(make() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(part(x).pow(2).sum() for part in self.parts)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0].pow(2).sum()


VIEW_CASES = {  # name -> (model, input, whether its layers' gradients are views)
    "linear": (lambda: Repeated(lambda: nn.Linear(6, 4)), (5, 6), True),
    "linear-no-bias": (lambda: Repeated(lambda: nn.Linear(6, 4, bias=False)), (5, 6), True),
    "conv2d": (lambda: Repeated(lambda: nn.Conv2d(3, 4, 3)), (2, 3, 6, 6), True),
    "conv2d-channels-last": (lambda: Repeated(lambda: nn.Conv2d(3, 4, 3)).to(memory_format=torch.channels_last), (2, 3, 6, 6), False),
    "conv1d": (lambda: Repeated(lambda: nn.Conv1d(3, 4, 3, bias=False)), (2, 3, 7), True),
    "conv-transpose": (lambda: Repeated(lambda: nn.ConvTranspose2d(3, 4, 3)), (2, 3, 5, 5), False),
    "grouped-conv": (lambda: Repeated(lambda: nn.Conv2d(4, 4, 3, groups=2)), (2, 4, 6, 6), False),
    "attention-qkv": (Attention, (2, 5, 6), True),
}


@pytest.mark.parametrize("case", list(VIEW_CASES))
@pytest.mark.parametrize("bias_grad", ["present", "missing"])
def test_gradient_views_read_and_write_what_each_layer_does(case, bias_grad, float64):
    """Read as a stack: each layer's grad_matrix(); written (from a stack, and layer by layer): what each layer's
    write_grad() leaves, bitwise."""
    make, shape, views = VIEW_CASES[case]
    torch.manual_seed(0)
    model = make().double()
    opt = SPDKFACOptimizer(model, **HYPER)
    model(torch.randn(shape, dtype=torch.float64)).backward()
    layers = [layer for layer in opt.layers if not layer.name.endswith("out_proj")]
    assert len(layers) == 3
    biases = [layer.helper.bias for layer in layers if layer.helper.bias is not None]
    if bias_grad == "missing":
        if not biases:
            pytest.skip("no bias")
        for bias in biases:
            bias.grad = None  # (a bias frozen, or not used this step): its column reads as zeros
    expected_read = torch.stack([layer.grad_matrix() for layer in layers])
    gradients = StackedGradients.of(layers)
    if not views:
        assert gradients is None
        return
    assert gradients is not None
    assert torch.equal(gradients.read(), expected_read)
    updates = torch.randn(expected_read.shape, dtype=torch.float64)
    params_ = list(dict.fromkeys(p for layer in layers for p in layer.params()))
    before = [p.grad.clone() for p in params_]
    for layer, update in zip(layers, updates):
        layer.write_grad(update)
    expected = [p.grad.clone() for p in params_]
    for how in ("stacked", "layer by layer"):
        for p, grad in zip(params_, before):
            p.grad.copy_(grad)
        writes = GradientWrites()
        if how == "stacked":
            writes.add_stack(gradients, updates)
        else:
            for layer, update in zip(layers, updates):
                writes.add(layer, update)
        writes.write()
        for p, grad, old in zip(params_, expected, before):
            assert torch.equal(p.grad, grad), how
            assert not torch.equal(p.grad, old), how


def test_a_helper_that_reads_or_writes_otherwise_keeps_its_own_read_and_write():
    class Halving(LinearHelper):  # a subclass that changes the write, with its parent's views
        def write_grad(self, update: torch.Tensor) -> None:
            super().write_grad(update / 2)

    class HalvingWithViews(Halving):
        def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
            return None

    assert _views_are_its_gradient(LinearHelper)
    assert not _views_are_its_gradient(Halving)
    assert _views_are_its_gradient(HalvingWithViews)
    model = Repeated(lambda: nn.Linear(6, 4))
    opt = SPDKFACOptimizer(model, **HYPER)
    model(torch.randn(5, 6)).backward()
    assert StackedGradients.of(opt.layers) is not None
    opt.layers[1].helper.__class__ = Halving
    assert StackedGradients.of(opt.layers) is None
    writes = GradientWrites()
    for layer in opt.layers:
        writes.add(layer, torch.ones(layer.grad_shape))
    writes.write()
    assert torch.equal(model.parts[0].weight.grad, torch.ones(4, 6))
    assert torch.equal(model.parts[1].weight.grad, torch.full((4, 6), 0.5))  # its own write
    assert torch.equal(model.parts[1].bias.grad, torch.full((4,), 0.5))


@pytest.mark.parametrize("by_layout", [False, True], ids=["one-copy", "sorted-by-layout"])
@pytest.mark.parametrize("net", ["mixed", "mixed-channels-last", "transformer"])
def test_writes_of_every_layer_type_leave_what_each_layer_writes(net, by_layout, monkeypatch):
    """Every layer of a model written in one GradientWrites (views where the type has them, else its own write),
    in one copy (the CPU's) or sorted by layout (a GPU's, forced): each layer's own write_grad(), bitwise."""
    monkeypatch.setattr(gradient_views_module, "copies_by_layout", lambda device: by_layout)
    model = small_transformer() if net == "transformer" else mixed_net()
    if net == "mixed-channels-last":  # the 2-D convolutions' weights (and so their gradients)
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)
    x = batch(8)[0]
    runs = []
    for _ in range(2):
        copied = copy.deepcopy(model)
        opt = SPDKFACOptimizer(copied, **HYPER)
        out = copied(x)
        (out if isinstance(out, torch.Tensor) else out[0]).pow(2).mean().backward()
        runs.append((copied, opt))
    (ours, opt), (theirs, ref) = runs
    g = torch.Generator().manual_seed(3)
    updates = [torch.randn(layer.grad_shape, generator=g) for layer in opt.layers]
    viewed = {layer.name for layer in opt.layers if gradient_views(layer) is not None}
    assert "head" in viewed
    assert ("conv" in viewed) == (net == "mixed")  # (a channels-last gradient has no views: its own write)
    assert len(viewed) < len(opt.layers) or net == "transformer"  # (mixed_net: embedding, grouped convolutions)
    writes = GradientWrites()
    for layer, update in zip(opt.layers, updates):
        writes.add(layer, update)
    writes.write()
    for layer, update in zip(ref.layers, updates):
        layer.write_grad(update)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_same_layout_is_what_a_gpu_copies_in_one_kernel():
    base = torch.randn(4, 7)
    assert same_layout(torch.randn(4, 6), torch.randn(4, 6))
    assert not same_layout(torch.randn(4, 6), base[:, :-1])  # a weight part that skips the bias column: gaps
    assert not same_layout(torch.randn(4, 1).expand(4, 6), torch.randn(4, 6))  # overlapping
    assert not same_layout(torch.randn(6, 4).T, torch.randn(4, 6))  # dense, laid out otherwise
    assert same_layout(torch.randn(6, 4).T, torch.randn(6, 4).T)
    assert same_layout(torch.randn(4, 1, 6)[:, :, :], torch.randn(4, 6, 1).transpose(1, 2))  # a size-1 dimension's stride is free
    assert not same_layout(torch.randn(4, 6), torch.randn(6, 4))


@pytest.mark.parametrize("bias", [True, False])
def test_a_stacked_groups_parts_are_laid_out_as_their_gradients(bias):
    """A stacked group's update parts are dense and laid out as the gradients they go to (on a GPU: one kernel for
    the group's copies); a layer written alone has a weight part that skips its bias column."""
    model = Repeated(lambda: nn.Linear(6, 4, bias=bias))
    opt = SPDKFACOptimizer(model, **HYPER)
    model(torch.randn(5, 6)).backward()
    stacked = StackedGradients.of(opt.layers)
    updates = torch.randn(stacked.read().shape)
    writes = GradientWrites()
    writes.add_stack(stacked, updates)
    assert len(writes._targets) == (6 if bias else 3)
    assert all(same_layout(t, s) for t, s in zip(writes._targets, writes._sources))
    alone = GradientWrites()
    alone.add(opt.layers[0], updates[0])
    assert all(same_layout(t, s) for t, s in zip(alone._targets, alone._sources)) == (not bias)
