"""Grouped and depthwise Conv2d, Conv1d, Embedding and every padding mode: factors and update against a float64 reference.

Each case runs one K-FAC step (lr 1, no momentum, no KL clip) on a single
layer and compares the running averages and the parameter change with
:mod:`layer_reference` (explicit per-group im2col, one-hot rows, a dense
Kronecker solve per group). The reference's rows are themselves checked
against autograd: ``Σ g ⊗ a`` is the weight gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from layer_reference import conv_grad_rows, conv_rows, factors, one_hot_rows, update
from one_step import kfac_step

DAMPING, DECAY = 0.05, 0.5

CONVS = {
    "grouped": lambda bias: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=bias),
    "grouped-stride-dilation": lambda bias: nn.Conv2d(4, 4, 3, stride=2, dilation=2, padding=2, groups=2, bias=bias),
    "depthwise-x1": lambda bias: nn.Conv2d(3, 3, 3, padding=1, groups=3, bias=bias),
    "depthwise-x2": lambda bias: nn.Conv2d(3, 6, 3, stride=2, padding=1, groups=3, bias=bias),
    "depthwise-dilated-5x5": lambda bias: nn.Conv2d(4, 4, 5, padding=3, dilation=2, groups=4, bias=bias),
    "depthwise-x2-valid": lambda bias: nn.Conv2d(2, 4, (3, 2), groups=2, bias=bias),
    "reflect": lambda bias: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect", bias=bias),
    "replicate-grouped": lambda bias: nn.Conv2d(4, 4, (3, 2), padding=(1, 2), padding_mode="replicate", groups=2, bias=bias),
    "circular-stride": lambda bias: nn.Conv2d(2, 3, 3, stride=2, padding=2, padding_mode="circular", bias=bias),
    "same-even-kernel": lambda bias: nn.Conv2d(2, 3, (2, 4), padding="same", bias=bias),
    "same-reflect-dilated": lambda bias: nn.Conv2d(2, 3, 3, padding="same", dilation=2, padding_mode="reflect", bias=bias),
    "conv1d": lambda bias: nn.Conv1d(3, 4, 3, padding=1, bias=bias),
    "conv1d-grouped-stride-dilation": lambda bias: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1, groups=2, bias=bias),
    "conv1d-depthwise-circular": lambda bias: nn.Conv1d(3, 6, 3, padding=1, groups=3, padding_mode="circular", bias=bias),
    "conv1d-replicate-same": lambda bias: nn.Conv1d(3, 2, 4, padding="same", padding_mode="replicate", bias=bias),
}


def _step(module: nn.Module, x: torch.Tensor, method: str):
    return kfac_step(module, x, method, DAMPING, DECAY)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", list(CONVS))
def test_conv_factors_and_update_match_the_reference(case, bias, method, float64):
    torch.manual_seed(0)
    module = CONVS[case](bias).double()
    size = (2, module.in_channels, 7) if isinstance(module, nn.Conv1d) else (2, module.in_channels, 6, 7)
    x = torch.randn(*size)
    grad_out, grads, change, opt = _step(module, x, method)
    layer = opt.layers[0]
    groups = module.groups
    a_rows, g_rows = conv_rows(module, x), conv_grad_rows(module, grad_out)
    og = module.out_channels // groups
    weight_grad = grads["weight"].reshape(groups, og, -1)
    A_blocks, G_blocks, expected_w, expected_b = [], [], [], []
    for grp in range(groups):
        # The reference rows reproduce autograd's weight gradient: Σ g ⊗ a.
        torch.testing.assert_close(g_rows[grp].T @ a_rows[grp], weight_grad[grp], rtol=1e-10, atol=1e-10)
        A, G = factors(a_rows[grp], g_rows[grp], x.shape[0], bias)
        A = DECAY * torch.eye(A.shape[0]) + (1 - DECAY) * A
        G = DECAY * torch.eye(G.shape[0]) + (1 - DECAY) * G
        A_blocks.append(A)
        G_blocks.append(G)
        grad = weight_grad[grp]
        if bias:
            grad = torch.cat([grad, grads["bias"].reshape(groups, og, 1)[grp]], dim=1)
        u = update(A, G, grad, DAMPING, method)
        expected_w.append(u[:, :-1] if bias else u)
        if bias:
            expected_b.append(u[:, -1])
    got_a, got_g = layer.A, layer.G
    if groups == 1:
        got_a, got_g = got_a.unsqueeze(0), got_g.unsqueeze(0)
    assert layer.shape("A").blocks == groups
    torch.testing.assert_close(got_a, torch.stack(A_blocks), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, torch.stack(G_blocks), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(change["weight"], torch.stack(expected_w).reshape(module.weight.shape), rtol=1e-8, atol=1e-10)
    if bias:
        torch.testing.assert_close(change["bias"], torch.cat(expected_b), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_factors_and_update_match_one_hot_reference(padding_idx, method, float64):
    torch.manual_seed(0)
    module = nn.Embedding(7, 4, padding_idx=padding_idx).double()
    tokens = torch.tensor([[0, 1, 1, 3, 6], [2, 2, 2, 0, 3], [1, 5, 3, 3, 0]])  # token 4 never appears
    grad_out, grads, change, opt = _step(module, tokens, method)
    layer = opt.layers[0]
    a_rows = one_hot_rows(module, tokens)
    g_rows = grad_out.reshape(-1, 4)
    kept = a_rows if padding_idx is None else a_rows * (tokens.reshape(-1, 1) != padding_idx)
    torch.testing.assert_close(g_rows.T @ kept, grads["weight"].T)  # Σ g ⊗ onehot is the gradient (padding: none)
    A, G = factors(a_rows, g_rows, tokens.shape[0], bias=False, shared=False)
    assert torch.equal(A, torch.diag(A.diagonal()))  # one-hot rows: a diagonal A
    A = DECAY * torch.eye(7) + (1 - DECAY) * A
    G = DECAY * torch.eye(4) + (1 - DECAY) * G
    assert layer.shape("A").diagonal
    assert layer.packed_factor("A").shape == (7,)  # kept (and all-reduced) as a vector
    torch.testing.assert_close(layer.A, A.diagonal(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.G, G, rtol=1e-12, atol=1e-12)
    expected = update(A, G, grads["weight"].T, DAMPING, method).T
    torch.testing.assert_close(change["weight"], expected, rtol=1e-8, atol=1e-10)
    assert torch.equal(change["weight"][4], torch.zeros(4))  # an unseen token's row does not move
    if padding_idx is not None:
        assert torch.equal(change["weight"][padding_idx], torch.zeros(4))  # nor the padding row


def test_unsupported_modules_get_plain_sgd():
    from spdkfac.kfac.layers import kfac_layers

    net = nn.Sequential(nn.Embedding(5, 3, sparse=True), nn.Linear(3, 2))
    assert [layer.name for layer in kfac_layers(net)] == ["1"]


def test_block_diagonal_decompositions_are_one_batched_payload():
    """A grouped layer's blocks travel as one buffer, and its placement cost follows the batched rule."""
    from spdkfac.kfac.factor_shape import FactorShape
    from spdkfac.kfac.methods import get_method
    from spdkfac.perfmodels import PerfModel

    shape = FactorShape(10, blocks=6)
    perf = PerfModel.default()
    for name, per_block in (("inverse", 55), ("eigen", 110)):
        method = get_method(name)
        assert method.payload_size(shape) == 6 * per_block
        one = method.curve(perf)(10)
        assert method.cost(perf, shape) == pytest.approx(one + 5 * (one - method.curve(perf)(1)))
        assert method.cost(perf, FactorShape(10)) == one
    diag = FactorShape(7, diagonal=True)
    assert get_method("inverse").payload_size(diag) == get_method("eigen").payload_size(diag) == 7


def test_batched_model_is_fitted_saved_and_used_by_the_methods():
    from spdkfac.kfac.factor_shape import FactorShape
    from spdkfac.kfac.methods import get_method
    from spdkfac.perfmodels import PerfModel
    from spdkfac.perfmodels.fitting import fit_batched
    from spdkfac.perfmodels.models import BatchedModel

    points = [(32, 9), (384, 9), (144, 25), (32, 36), (32, 144)]
    truth = BatchedModel(5e-5, 2e-6, 4e-10)
    (call, c0, c1, c2, c3), worst = fit_batched(points, [truth.fitted(b, d) for b, d in points])
    assert (call, c0, c1, c2, c3) == pytest.approx((5e-5, 2e-6, 0, 0, 4e-10), rel=1e-6, abs=1e-15)
    assert worst < 1e-9
    # A block time far from cubic at small d (per-matrix overhead, O(d^2) copies) is fitted by the lower powers.
    quadratic = BatchedModel(1e-4, 1e-6, 0.0, c2=2e-7)
    more = [*points, (96, 9), (672, 25)]
    coeffs, worst = fit_batched(more, [quadratic.fitted(b, d) for b, d in more])
    assert coeffs == pytest.approx((1e-4, 1e-6, 0, 2e-7, 0), rel=1e-6, abs=1e-15)
    old_file = {"call": 1e-4, "c0": 1e-6, "c3": 1e-9, "measured": {}}  # written before c1 and c2 existed
    assert BatchedModel.from_dict(old_file).fitted(2, 10) == pytest.approx(1e-4 + 2 * (1e-6 + 1e-6))
    data = PerfModel.default().to_dict()
    data["batched"] = {"eigen": BatchedModel(call, c0, c3, {(32, 9): 1e-3}).to_dict()}
    perf = PerfModel.from_dict(data)
    assert perf.to_dict()["batched"] == data["batched"]
    eigen, inverse = get_method("eigen"), get_method("inverse")
    assert eigen.cost(perf, FactorShape(9, blocks=32)) == 1e-3  # a measured shape as measured
    assert eigen.cost(perf, FactorShape(10, blocks=6)) == pytest.approx(call + 6 * (c0 + c3 * 1000))
    rule = BatchedModel.rule(inverse.curve(perf), 6, 10)  # no batched inverse measurements: the rule
    assert inverse.cost(perf, FactorShape(10, blocks=6)) == rule


@pytest.mark.parametrize("bias", [False, True])
def test_depthwise_gram_is_the_same_one_channel_at_a_time_and_exactly_symmetric(bias, monkeypatch):
    from spdkfac.kfac.layer_types import conv as conv_module
    from spdkfac.kfac.layer_types import make_helper

    module = nn.Conv2d(5, 10, 3, stride=2, padding=1, groups=5, bias=bias)
    helper = make_helper(module)
    x = torch.randn(4, 5, 9, 9, dtype=torch.float64)
    whole, count = helper.input_gram(x, torch.float64)
    monkeypatch.setattr(conv_module, "DEPTHWISE_ROWS_BYTES", 1)  # one channel per batched product
    per_channel, _ = helper.input_gram(x, torch.float64)
    rows = conv_rows(module, x)  # the reference's per-group im2col rows, then a ones column with a bias
    rows = [torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype)], 1) if bias else r for r in rows]
    assert count == 4 * 5 * 5
    torch.testing.assert_close(whole, per_channel, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole, torch.stack([r.T @ r for r in rows]), rtol=1e-10, atol=1e-10)
    assert torch.equal(whole, whole.transpose(1, 2))
