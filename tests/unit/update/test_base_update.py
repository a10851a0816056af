"""The update after preconditioning (``base='sgd' | 'adamw' | 'lamb'``): each rule against what it mirrors, its options,
its KL-clip semantics, and its state through a checkpoint.

With ``precondition=False`` the optimizer is its base optimizer on the averaged gradients, so each base is compared
with ``torch.optim.SGD``, ``torch.optim.AdamW`` and LAMB's published equations (You et al. 2020, Algorithm 2)
written here from the paper in float64.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import SPDKFACOptimizer
from spdkfac.update.rules import lamb_delta, momentum_direction, momentum_directions
from spdkfac.variants import make_optimizer, variant_config

STEPS = 5


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, start: int = 0, stop: int = STEPS) -> None:
    for s in range(start, stop):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()


def _no_kfac(model: nn.Module, **kw) -> SPDKFACOptimizer:
    return SPDKFACOptimizer(model, precondition=False, backend="single", **kw)


def test_base_sgd_is_torch_sgd_bitwise():
    x, y = batch(8)
    ours, ref = small_net(), small_net()
    _train(ours, _no_kfac(ours, lr=0.05, momentum=0.9, weight_decay=1e-3), x, y)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3), x, y)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_base_adamw_is_torch_adamw(weight_decay):
    """Bitwise without weight decay (the same operations); with it, torch scales the parameter first and we add
    ``-lr*wd*param`` to the step, so the two differ by rounding only."""
    x, y = batch(8)
    ours, ref = small_net(), small_net()
    kw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    _train(ours, _no_kfac(ours, base="adamw", **kw), x, y)
    _train(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **kw), x, y)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if weight_decay == 0:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), small_net().parameters()))


def _lamb_float64(weights: list[torch.Tensor], grads_per_step, lr, beta1, beta2, eps, wd) -> list[torch.Tensor]:
    """LAMB from the paper's Algorithm 2, per tensor ("layer"), φ the identity, in float64, with plain loops."""
    w = [t.double().clone() for t in weights]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t)
            v_hat = v[i] / (1 - beta2**t)
            r = m_hat / (torch.sqrt(v_hat) + eps)
            u = r + wd * w[i]
            w_norm = math.sqrt(float((w[i] * w[i]).sum()))
            u_norm = math.sqrt(float((u * u).sum()))
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - lr * trust * u
    return w


def test_base_lamb_follows_the_published_equations():
    """Our LAMB on fixed gradients (float64) equals Algorithm 2 written independently; a zero tensor (trust 1) included."""
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    grads_per_step = [[torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in weights] for _ in range(4)]
    lr, betas, eps, wd = 0.02, (0.9, 0.999), 1e-6, 0.01
    expected = _lamb_float64(weights, grads_per_step, lr, *betas, eps, wd)
    params = [t.clone() for t in weights]
    states: list[dict] = [{} for _ in params]
    for grads in grads_per_step:
        for p, g, st in zip(params, grads, states):
            p.add_(lamb_delta(g, p, st, lr, betas, eps, wd))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=1e-12, atol=1e-14)
    assert not torch.equal(params[1], weights[1])  # the zero tensor moved (trust ratio 1)


def test_base_lamb_in_the_optimizer_is_the_rule_on_the_averaged_gradients():
    """Without preconditioning, the optimizer's LAMB step is Algorithm 2 on the model's gradients (float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        x, y = batch(8)
        model, probe = small_net(), small_net()
        start = [p.detach().clone() for p in model.parameters()]
        opt = _no_kfac(model, base="lamb", lr=0.01, weight_decay=0.02)
        grads_per_step = []
        for s in range(STEPS):
            probe.load_state_dict(model.state_dict())
            probe.zero_grad()
            nn.functional.cross_entropy(probe(x + 0.1 * s), y).backward()
            grads_per_step.append([p.grad.clone() for p in probe.parameters()])
            _train(model, opt, x, y, s, s + 1)
        expected = _lamb_float64(start, grads_per_step, 0.01, 0.9, 0.999, 1e-6, 0.02)
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_kl_clip_scales_the_preconditioned_gradient_before_the_base_update():
    """With AdamW as the base (a negligible eps), the first step is ±lr per coordinate whatever the clip's scale:
    the clip acts on the gradient the base optimizer sees, not on the base optimizer's output."""
    x, y = batch(8)
    deltas = []
    for kl_clip in (None, 1e-12):
        model = small_net()
        before = [p.detach().clone() for p in model.parameters()]
        _train(
            model,
            SPDKFACOptimizer(model, lr=0.01, base="adamw", eps=1e-30, kl_clip=kl_clip, weight_decay=0.0, backend="single"),
            x,
            y,
            0,
            1,
        )
        deltas.append([p.detach() - b for p, b in zip(model.parameters(), before)])
    for clipped, free in zip(*deltas):
        torch.testing.assert_close(clipped, free, rtol=1e-3, atol=1e-6)
    # With momentum SGD the same clip shrinks the step itself.
    model = small_net()
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, SPDKFACOptimizer(model, lr=0.01, kl_clip=1e-12, backend="single"), x, y, 0, 1)
    first_layer = next(model.parameters())
    assert float((first_layer.detach() - before[0]).abs().max()) < 1e-4 * float(deltas[1][0].abs().max())


@pytest.mark.parametrize("base", ["adamw", "lamb"])
def test_kfac_with_an_adam_base_trains_and_keeps_adam_state(base):
    x, y = batch(16)
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.01, base=base, weight_decay=0.01, backend="single")
    with torch.no_grad():  # (a forward pass with gradients would be a second factor pass of the step)
        loss0 = float(nn.functional.cross_entropy(model(x), y))
    _train(model, opt, x, y, 0, 10)
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(model(x), y)) < loss0
    state = opt.state[next(model.parameters())]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"] == 10
    assert "momentum" not in opt.param_groups[0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt.param_groups[0]["eps"] == (1e-6 if base == "lamb" else 1e-8)
    assert f"base='{base}'" in repr(opt)


def test_bad_base_options_are_refused_naming_them():
    model = small_net()
    with pytest.raises(ValueError, match="base must be one of"):
        SPDKFACOptimizer(model, lr=0.1, base="adam", backend="single")
    with pytest.raises(ValueError, match="momentum applies to base='sgd' only"):
        SPDKFACOptimizer(model, lr=0.1, base="adamw", momentum=0.9, backend="single")
    with pytest.raises(ValueError, match="betas and eps apply to base='adamw' or 'lamb'"):
        SPDKFACOptimizer(model, lr=0.1, betas=(0.9, 0.99), backend="single")
    with pytest.raises(ValueError, match="betas must be two numbers"):
        SPDKFACOptimizer(model, lr=0.1, base="lamb", betas=(0.9, 1.0), backend="single")
    with pytest.raises(ValueError, match="eps must be a positive number"):
        SPDKFACOptimizer(model, lr=0.1, base="adamw", eps=0.0, backend="single")


def test_variant_specs_take_the_base():
    assert variant_config("spdkfac:base=lamb")["base"] == "lamb"
    with pytest.raises(ValueError, match="base must be one of"):
        variant_config("spdkfac:base=adam")
    opt = make_optimizer("spdkfac:base=adamw,factor_update_freq=10,inv_update_freq=10", small_net(), lr=1e-3, backend="single")
    assert opt.config.base == "adamw"


def _checkpointed(base: str):
    kw = dict(lr=0.01, base=base, weight_decay=1e-3, damping=0.01, factor_update_freq=2, inv_update_freq=4, backend="single")
    x, y = batch(8)
    full = small_net()
    _train(full, SPDKFACOptimizer(full, **kw), x, y, 0, 9)
    half = small_net()
    opt = SPDKFACOptimizer(half, **kw)
    _train(half, opt, x, y, 0, 5)
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return full, torch.load(buf, weights_only=True), kw, x, y


@pytest.mark.parametrize("base", ["adamw", "lamb"])
def test_resume_with_an_adam_base_is_bitwise_identical(base):
    full, ckpt, kw, x, y = _checkpointed(base)  # weights_only=True: the Adam state is tensors and plain values
    resumed = small_net(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt = SPDKFACOptimizer(resumed, **kw)
    opt.load_state_dict(ckpt["opt"])
    _train(resumed, opt, x, y, 5, 9)
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    # Guard: without the Adam moments (fresh state) the trajectory differs, so the test above can fail.
    damaged = small_net(seed=123)
    damaged.load_state_dict(ckpt["model"])
    opt = SPDKFACOptimizer(damaged, **kw)
    opt.load_state_dict({**ckpt["opt"], "state": {}})
    _train(damaged, opt, x, y, 5, 9)
    assert any(not torch.equal(a, b) for a, b in zip(full.parameters(), damaged.parameters()))


def test_a_checkpoint_of_another_base_is_refused():
    _full, ckpt, kw, _x, _y = _checkpointed("adamw")
    with pytest.raises(ValueError, match="saved with base='adamw' but this optimizer uses base='sgd'"):
        SPDKFACOptimizer(small_net(), **{**kw, "base": "sgd"}).load_state_dict(ckpt["opt"])


@pytest.mark.slow
def test_training_job_takes_the_base_and_refuses_to_change_it_on_resume(tmp_path, capsys):
    from spdkfac import train

    common = ["--data", "digits", "--backend", "single", "--quiet", "--batch-size", "128", "--epochs", "2", "--out-dir", str(tmp_path)]
    train.main([*common, "--base", "adamw", "--stop-after", "1"])
    assert "preconditioned layers, base adamw," in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--base cannot change when a run is resumed, even with --allow-changed-args"):
        train.main([*common, "--base", "sgd", "--resume", "--allow-changed-args"])
    row = train.main([*common, "--base", "adamw", "--resume"])
    assert row["test_acc"] > 0.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "sgd", "--base", "adamw"], "--base only apply to the K-FAC optimizers"),
        (["--base", "lamb", "--momentum", "0.5"], "--momentum does not apply to --base lamb"),
    ],
)
def test_training_job_refuses_a_base_where_it_does_not_apply(argv, message, capsys):
    from spdkfac.train.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_training_job_defaults_follow_the_base():
    from spdkfac.train.args import parse_args

    args = parse_args(["--base", "adamw"])
    assert (args.lr, args.weight_decay) == (1e-3, 0.05)
    args = parse_args([])
    assert (args.lr, args.weight_decay) == (0.05, 5e-4)


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 1e-3), (0.9, 0.0), (0.0, 1e-3), (0.0, 0.0)])
def test_batched_momentum_rule_is_the_one_parameter_rule_bitwise(momentum, weight_decay):
    """The multi-tensor form (fresh and kept buffers mixed, as when a parameter first gets a gradient later) gives
    each parameter the one-parameter rule's direction and buffer, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 3, 3), (7,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    one: list[dict] = [{} for _ in shapes]
    many: list[dict] = [{} for _ in shapes]
    for step in range(3):
        present = range(len(shapes)) if step else [0, 2]  # parameters 1 and 3 start with the second step
        grads = {i: torch.randn(shapes[i], generator=gen) for i in present}
        want = [momentum_direction(grads[i], params[i], one[i], momentum, weight_decay).clone() for i in present]
        got = momentum_directions(
            [grads[i] for i in present], [params[i] for i in present], [many[i] for i in present], momentum, weight_decay
        )
        for w, g in zip(want, got):
            assert torch.equal(w, g)
        for i in present:
            assert torch.equal(one[i].get("momentum_buffer", torch.empty(0)), many[i].get("momentum_buffer", torch.empty(0)))


def test_base_sgd_steps_a_sparse_gradient_beside_dense_ones():
    """A sparse Embedding (no K-FAC layer, the base update only) steps beside the dense parameters as torch's SGD."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    ref = copy.deepcopy(ours)
    x, y = torch.randint(0, 10, (6, 2)), torch.randint(0, 3, (6,))
    opt = _no_kfac(ours, lr=0.05, momentum=0.9, weight_decay=0.0)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for model, o in ((ours, opt), (ref, torch_opt)):
        for _ in range(3):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            o.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
