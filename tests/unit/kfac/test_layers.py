"""The preconditioned update equals an explicit dense Kronecker computation built here independently."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.conv_gram import SharedShiftWork, conv_input_gram
from spdkfac.kfac.layer_types import conv as conv_types


def _patches(x: torch.Tensor, k: int, pad: int, stride: int) -> torch.Tensor:
    """im2col by explicit slicing (independent of F.unfold): rows (n*L, C*k*k), channel-major."""
    xp = nn.functional.pad(x, (pad, pad, pad, pad))
    n, _c, h, w = xp.shape
    rows = []
    for b in range(n):
        for i in range(0, h - k + 1, stride):
            for j in range(0, w - k + 1, stride):
                rows.append(xp[b, :, i : i + k, j : j + k].reshape(-1))
    return torch.stack(rows)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2, stride=1, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        self.conv_out = self.conv(x)
        self.conv_out.retain_grad()
        h = torch.tanh(self.conv_out).flatten(1)
        self.fc_in = h
        self.fc_out = self.fc(h)
        self.fc_out.retain_grad()
        return self.fc_out


def _dense_update(a_rows, g_rows, n, grad, damping, decay):
    """((A+γI) ⊗ (G+γI))^-1 vec(grad) with column-stacking vec, as an explicit dense solve.

    A and G are the first running averages: ``decay*I + (1-decay)*F_batch`` with the batch factors
    ``Σ (a/S)(a/S)^T / n`` and ``Σ (n*S*g)(n*S*g)^T / (n*S)`` (S positions per sample).
    """
    s = a_rows.shape[0] // n
    a = a_rows / s
    gs = g_rows * (n * s)
    A = decay * torch.eye(a.shape[1]) + (1 - decay) * a.T @ a / n
    G = decay * torch.eye(gs.shape[1]) + (1 - decay) * gs.T @ gs / (n * s)
    F = torch.kron(A + damping * torch.eye(A.shape[0], dtype=A.dtype), G + damping * torch.eye(G.shape[0], dtype=G.dtype))
    vec = grad.T.reshape(-1)
    sol = torch.linalg.solve(F, vec)
    return sol.reshape(grad.shape[1], grad.shape[0]).T


def test_preconditioned_update_equals_dense_kronecker_solve(float64):
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    n, damping, lr = 6, 0.05, 0.5
    x = torch.randn(n, 2, 3, 3)
    y = torch.randint(0, 4, (n,))

    # Reference gradients and activations from an independent copy.
    loss = nn.functional.cross_entropy(ref(x), y)
    loss.backward()
    conv_a = torch.cat([_patches(x, 2, 1, 1), torch.ones(n * 16, 1)], 1)
    conv_g = ref.conv_out.grad.permute(0, 2, 3, 1).reshape(-1, 3)
    conv_grad = torch.cat([ref.conv.weight.grad.reshape(3, -1), ref.conv.bias.grad[:, None]], 1)
    fc_a = torch.cat([ref.fc_in.detach(), torch.ones(n, 1)], 1)
    fc_g = ref.fc_out.grad
    fc_grad = torch.cat([ref.fc.weight.grad, ref.fc.bias.grad[:, None]], 1)
    decay = 0.8
    conv_upd = _dense_update(conv_a, conv_g, n, conv_grad, damping, decay)
    fc_upd = _dense_update(fc_a, fc_g, n, fc_grad, damping, decay)

    opt = SPDKFACOptimizer(net, lr=lr, momentum=0.0, damping=damping, factor_decay=decay, kl_clip=None, backend="single")
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()

    torch.testing.assert_close(net.conv.weight, ref.conv.weight - lr * conv_upd[:, :-1].reshape(3, 2, 2, 2))
    torch.testing.assert_close(net.conv.bias, ref.conv.bias - lr * conv_upd[:, -1])
    torch.testing.assert_close(net.fc.weight, ref.fc.weight - lr * fc_upd[:, :-1])
    torch.testing.assert_close(net.fc.bias, ref.fc.bias - lr * fc_upd[:, -1])
    # The update really is preconditioned (differs from the plain gradient step).
    assert not torch.allclose(net.fc.weight, ref.fc.weight - lr * ref.fc.weight.grad, atol=1e-6)


def test_kl_clip_scales_update(float64):
    torch.manual_seed(0)
    base = Net()
    x = torch.randn(8, 2, 3, 3)
    y = torch.randint(0, 4, (8,))
    deltas = {}
    for clip in (None, 1e-6):
        net = copy.deepcopy(base)
        opt = SPDKFACOptimizer(net, lr=0.1, momentum=0.0, kl_clip=clip, backend="single")
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        deltas[clip] = (net.fc.weight - base.fc.weight).detach()
    ratio = deltas[1e-6] / deltas[None]
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-6)
    assert 0 < ratio.flatten()[0] < 1


def _patches_general(x, kernel, stride, padding, dilation):
    """im2col with stride, dilation and rectangular kernels, by explicit slicing (independent of the library)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    xp = nn.functional.pad(x, (pw, pw, ph, ph))
    n, _, h, w = xp.shape
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    rows = []
    for b in range(n):
        for i in range(0, h - span_h + 1, sh):
            for j in range(0, w - span_w + 1, sw):
                rows.append(xp[b, :, i : i + span_h : dh, j : j + span_w : dw].reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation"),
    [
        ((3, 3), (1, 1), (1, 1), (1, 1)),
        ((1, 1), (2, 2), (0, 0), (1, 1)),
        ((3, 3), (2, 2), (1, 1), (1, 1)),
        ((2, 3), (1, 2), (0, 1), (1, 1)),
        ((3, 3), (1, 1), (2, 2), (2, 2)),
        ((7, 7), (2, 2), (3, 3), (1, 1)),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_input_rows_match_explicit_im2col(kernel, stride, padding, dilation, channels_last):
    from spdkfac.kfac.layers import make_helper

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation)
    x = torch.randn(2, 3, 9, 10)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    rows = make_helper(conv).input_rows(x)
    expected = _patches_general(x, kernel, stride, padding, dilation)
    assert torch.equal(rows, expected)
    # The rows reproduce the convolution: output = rows @ W^T + b.
    out = conv(x).permute(0, 2, 3, 1).reshape(-1, 4)
    torch.testing.assert_close(rows @ conv.weight.reshape(4, -1).T + conv.bias, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "padding", "dilation", "size"),
    [
        ((3, 3), (1, 1), (1, 1), (7, 7)),
        ((3, 3), (0, 0), (1, 1), (6, 5)),
        ((2, 3), (0, 1), (1, 1), (5, 8)),
        ((3, 3), (2, 2), (2, 2), (6, 6)),
        ((5, 5), (2, 2), (1, 1), (3, 4)),
        ((3, 1), (4, 0), (1, 1), (2, 5)),
        ((7, 7), (3, 3), (1, 1), (9, 9)),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_stride1_conv_factor_from_shared_shifts_equals_explicit_im2col_gram(
    kernel, padding, dilation, size, bias, channels_last, monkeypatch
):
    """The A factor of a stride-1 conv (built from shifted sums, never from im2col rows) is the rows' mean Gram."""
    from spdkfac.kfac.layers import KFACLayer, make_helper

    monkeypatch.setattr(SharedShiftWork, "pays", lambda self, threads=1: True)  # these inputs are small: im2col otherwise
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel, padding=padding, dilation=dilation, bias=bias).double()
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    layer = KFACLayer("conv", make_helper(conv))
    assert layer.helper.shared_gram(x) is not None  # the shared-shift path is the one under test
    rows = _patches_general(x, kernel, (1, 1), padding, dilation)
    if bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
    gram, _ = layer.helper.input_gram(x, torch.float64)
    assert torch.equal(gram, gram.T)
    a = layer.shape("A").unpack(layer.compute_a(x))
    s = rows.shape[0] // x.shape[0]  # output positions per sample
    torch.testing.assert_close(a, (rows / s).T @ (rows / s) / x.shape[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kernel", "channels", "size", "batch", "shared"),
    [
        (3, 4, 6, 8, (False, False)),
        (5, 3, 28, 16, (False, False)),
        (3, 128, 4, 16, (False, False)),
        (3, 32, 16, 16, (True, False)),
        (5, 16, 24, 8, (True, False)),
        (3, 64, 32, 2, (True, True)),
    ],
)
def test_a_stride1_conv_takes_the_shared_shifts_where_they_pay_and_counts_their_work(kernel, channels, size, batch, shared):
    """The route follows SharedShiftWork.pays at torch's thread count (``shared``: on 1 and on 2 threads); its
    multiply-adds are those conv_input_gram's products do, the im2col ones the rows' Gram; both routes give the rows'
    Gram."""
    from spdkfac.kfac.layers import make_helper

    torch.manual_seed(0)
    conv = nn.Conv2d(channels, 8, kernel, padding=kernel // 2).double()
    helper = make_helper(conv)
    x = torch.randn(batch, channels, size, size, dtype=torch.float64)
    rows = _patches_general(x, (kernel, kernel), (1, 1), (kernel // 2, kernel // 2), (1, 1))
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
    work = helper.shared_shift_work(x)
    assert work is not None
    assert work.im2col_multiply_adds == rows.shape[0] * rows.shape[1] ** 2
    with FlopCounterMode(display=False) as flops:
        conv_input_gram(x, (kernel, kernel), (kernel // 2, kernel // 2), (1, 1), with_bias=True)
    assert 2 * work.multiply_adds == flops.get_total_flops()
    assert (work.pays(1), work.pays(2)) == shared
    assert work.cost(1) < work.cost(2) < work.cost(4)  # the fixed costs grow with the threads, the products' do not
    before = torch.get_num_threads()
    try:
        for threads, expected in zip((1, 2), shared):
            torch.set_num_threads(threads)
            assert (helper.shared_gram(x) is not None) == expected
    finally:
        torch.set_num_threads(before)
    gram, count = helper.input_gram(x, torch.float64)
    assert count == rows.shape[0]
    torch.testing.assert_close(gram, rows.T @ rows, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize(
    ("module", "size"),
    [
        (nn.Conv2d(3, 4, 3, stride=2, padding=1), (9, 8)),
        (nn.Conv2d(4, 6, 3, stride=(2, 1), padding=(0, 2), bias=False), (7, 9)),
        (nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), (9, 9)),
        (nn.Conv1d(3, 5, 4, stride=3, padding=2), (11,)),
        (nn.Conv3d(2, 3, 3, stride=2, padding=1), (5, 4, 5)),
        (nn.Conv3d(4, 4, (2, 3, 3), padding=(0, 1, 2), groups=2, padding_mode="reflect"), (3, 4, 5)),
    ],
    ids=["strided", "no-bias", "grouped", "1d", "3d", "3d-grouped-reflect"],
)
def test_im2col_rows_are_built_a_few_samples_at_a_time_and_give_the_whole_gram(module, size, monkeypatch):
    """With a rows budget of two samples the Gram is summed over parts of at most two samples: the rows' Gram."""
    from spdkfac.kfac.layers import KFACLayer, make_helper

    torch.manual_seed(0)
    module = copy.deepcopy(module).double()
    x = torch.randn(5, module.in_channels, *size, dtype=torch.float64)
    layer = KFACLayer("conv", make_helper(module))
    whole = layer.compute_a(x)
    built: list[int] = []
    helper = layer.helper
    original = type(helper).input_rows

    def spy(self, part):
        built.append(part.shape[0])
        return original(self, part)

    blocks: list[int] = []
    original_block_gram = conv_types.block_gram

    def block_spy(rows):
        blocks.append(rows.shape[1])
        return original_block_gram(rows)

    monkeypatch.setattr(type(helper), "input_rows", spy)
    monkeypatch.setattr(conv_types, "block_gram", block_spy)
    _, rows = helper.input_gram(x, torch.float64)
    positions = rows // x.shape[0]
    width = math.prod(helper.kernel_size) * module.in_channels + helper.groups * int(helper.has_bias)
    built.clear()
    blocks.clear()
    monkeypatch.setattr(conv_types, "IM2COL_ROWS_BYTES", 2 * positions * width * 8)
    chunked = layer.compute_a(x)
    if helper.groups == 1 or not isinstance(helper, conv_types.ConvHelper):
        assert built == [2, 2, 1], built  # parts of two samples, never the whole batch
    else:
        assert blocks == [2 * positions, 2 * positions, positions], blocks
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("stride", "size"), [((1, 1), (12, 12)), ((2, 2), (24, 23)), ((1, 2), (5, 6))])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_factors_from_channel_grams_equal_explicit_rows(stride, size, bias, channels_last):
    """1x1 conv A factors and conv G factors come from the NCHW tensors directly; they equal the rows' Gram."""
    from spdkfac.kfac.layers import KFACLayer, make_helper

    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, 1, stride=stride, bias=bias).double()
    x = torch.randn(3, 6, *size, dtype=torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    layer = KFACLayer("conv", make_helper(conv))
    assert layer.helper.shared_gram(x) is not None  # not the im2col route
    rows = _patches_general(x, (1, 1), stride, (0, 0), (1, 1))
    if bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
    gram, _ = layer.helper.input_gram(x, torch.float64)
    assert torch.equal(gram, gram.T)
    a = layer.shape("A").unpack(layer.compute_a(x))
    s = rows.shape[0] // x.shape[0]  # output positions per sample
    torch.testing.assert_close(a, (rows / s).T @ (rows / s) / x.shape[0], rtol=1e-12, atol=1e-12)
    g_out = torch.randn_like(conv(x))
    g_rows = g_out.permute(0, 2, 3, 1).reshape(-1, 5) * 3 * s  # n*S times the rows of a mean over 3 samples
    g = layer.shape("G").unpack(layer.compute_g(g_out, loss_scale=4.0))
    torch.testing.assert_close(g, (g_rows / 4.0).T @ (g_rows / 4.0) / (3 * s), rtol=1e-12, atol=1e-12)


def test_unsupported_layers_get_plain_sgd():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    ref = copy.deepcopy(net)
    opt = SPDKFACOptimizer(net, lr=0.1, momentum=0.0, backend="single")
    x = torch.randn(5, 4)
    nn.functional.mse_loss(net(x), torch.zeros(5, 2)).backward()
    nn.functional.mse_loss(ref(x), torch.zeros(5, 2)).backward()
    opt.step()
    assert len(opt.layers) == 2
    torch.testing.assert_close(net[1].weight, ref[1].weight - 0.1 * ref[1].weight.grad)


def _one_step_update(net: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool):
    """Parameter change of one K-FAC step, and the optimizer (for its factors)."""
    before = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    # Damping large enough that the bfloat16 rounding of activations is not amplified by a near-singular factor;
    # a step large next to the bfloat16 model's parameter resolution (2^-9 of 0.3), which rounds the update too.
    opt = SPDKFACOptimizer(net, lr=1.0, momentum=0.0, kl_clip=None, damping=0.1, backend="single")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return {k: v.detach().float() - before[k] for k, v in net.state_dict().items()}, opt


def test_half_precision_forward_keeps_factors_in_float32():
    """Under autocast (or a bfloat16 model) factors and inverses stay float32, and the update matches float32's."""
    torch.manual_seed(0)
    base = Net()
    x = torch.randn(8, 2, 3, 3)
    y = torch.randint(0, 4, (8,))
    ref, ref_opt = _one_step_update(copy.deepcopy(base), x, y, autocast=False)
    amp, amp_opt = _one_step_update(copy.deepcopy(base), x, y, autocast=True)
    bf16, bf16_opt = _one_step_update(copy.deepcopy(base).to(torch.bfloat16), x.to(torch.bfloat16), y, autocast=False)
    for opt in (amp_opt, bf16_opt):
        for layer in opt.layers:
            assert {t.dtype for t in (layer.A, layer.G, layer.decomposition("A"), layer.decomposition("G"))} == {torch.float32}, layer
    # The first layer sees the same float32 input under autocast: its A factor is exact.
    torch.testing.assert_close(amp_opt.layers[0].A, ref_opt.layers[0].A)
    for update in (amp, bf16):
        for k in ref:
            scale = ref[k].abs().max()
            assert (update[k] - ref[k]).abs().max() <= 0.05 * scale, (k, update[k], ref[k])


def test_running_averages_are_kept_packed_and_unpack_to_the_decayed_mean():
    from spdkfac.kfac.layers import kfac_layers
    from spdkfac.kfac.linalg import pack_upper, triangle_size

    layer = kfac_layers(nn.Linear(5, 3))[0]  # A is 6x6 (bias row), G 3x3
    torch.manual_seed(0)
    mats = []
    for _ in range(3):
        x = torch.randn(10, 6)
        mats.append(x.T @ x / 10)
    layer.update_factor("A", mats[0], 0.9)  # full matrix, as a single worker's hooks hand it over
    layer.update_factor("A", pack_upper(mats[1]), 0.9)  # packed, as the fused all-reduce delivers it
    layer.update_factor("A", pack_upper(mats[2]), 0.9)
    expected = 0.9 * (0.9 * (0.9 * torch.eye(6) + 0.1 * mats[0]) + 0.1 * mats[1]) + 0.1 * mats[2]  # from the identity
    torch.testing.assert_close(layer.A, expected)
    assert layer.packed_factor("A").shape == (triangle_size(6),)
    # A packed factor is folded in, not kept: reusing the communication buffer later cannot touch the average.
    buffer = pack_upper(mats[0][:3, :3])
    layer.update_factor("G", buffer, 0.9)
    buffer.zero_()
    torch.testing.assert_close(layer.G, 0.9 * torch.eye(3) + 0.1 * mats[0][:3, :3])
    buffer = pack_upper(mats[2][:3, :3])
    layer.set_factor("G", buffer)  # the same for a replaced average
    buffer.zero_()
    torch.testing.assert_close(layer.G, mats[2][:3, :3])
    layer.G = mats[1][:3, :3]  # the checkpoint path: a full matrix replaces the average
    torch.testing.assert_close(layer.G, mats[1][:3, :3])
    with pytest.raises(ValueError, match="expected 21"):
        layer.update_factor("A", torch.zeros(20), 0.9)
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        layer.update_factor("G", torch.zeros(4, 4), 0.9)
    layer.A = None
    assert layer.A is None
    assert layer.packed_factor("A") is None
