"""Loss scaling (torch.amp.GradScaler) with the optimizer: unscaled factors, skipped steps, synchronize()."""

from __future__ import annotations

import warnings

import pytest
import torch
from nets import batch, small_net, train

from spdkfac import SPDKFACOptimizer

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loss_scale_does_not_change_the_update(float64):
    """A power-of-two loss scale is exact: with the scale removed from G, the trajectory is unchanged."""
    x, y = batch(8)
    plain = small_net()
    train(plain, SPDKFACOptimizer(plain, **KW), x, y, 4)
    scaled = small_net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = SPDKFACOptimizer(scaled, grad_scaler=scaler, **KW)
    train(scaled, opt, x, y, 4, scaler=scaler)
    assert opt.steps == 4
    for k, v in _params(plain).items():
        torch.testing.assert_close(_params(scaled)[k], v, rtol=1e-12, atol=1e-14)


def test_skipped_step_is_discarded(float64):
    """A step the scaler skips (NaN gradients) leaves no trace: same result as never seeing that batch."""
    x, y = batch(8)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[3] = True
    skipped = small_net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = SPDKFACOptimizer(skipped, grad_scaler=scaler, **KW)
    train(skipped, opt, x, y, 4, scaler=scaler, poisoned={1: mask})
    assert opt.steps == 3
    assert scaler.get_scale() == 2.0**7
    assert all(torch.isfinite(layer.A).all() and torch.isfinite(layer.G).all() for layer in opt.layers)

    ref = small_net()
    ref_opt = SPDKFACOptimizer(ref, **KW)
    for s in (0, 2, 3):  # the same batches without the poisoned step
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x + 0.1 * s), y).backward()
        ref_opt.step()
    for k, v in _params(ref).items():
        torch.testing.assert_close(_params(skipped)[k], v, rtol=1e-12, atol=1e-14)


def test_float16_autocast_with_grad_scaler_trains():
    torch.manual_seed(0)
    x, y = batch(16)
    model = small_net()
    scaler = torch.amp.GradScaler("cpu")
    opt = SPDKFACOptimizer(model, grad_scaler=scaler, **dict(KW, lr=0.1))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
    assert 6 <= opt.steps <= 8
    assert losses[-1] < losses[0]
    assert {layer.G.dtype for layer in opt.layers} == {torch.float32}


def test_bad_grad_scaler_is_an_error():
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch.amp.GradScaler"):
        SPDKFACOptimizer(small_net(), grad_scaler=2.0, **KW)


def test_zero_grad_between_forward_and_backward_keeps_the_step(float64):
    """The common ``out = model(x); opt.zero_grad(); loss.backward(); opt.step()`` order loses nothing."""
    x, y = batch(8)
    results = []
    for late_zero_grad in (False, True):
        model = small_net()
        opt = SPDKFACOptimizer(model, **KW)
        for s in range(3):
            if not late_zero_grad:
                opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x + 0.1 * s), y)
            if late_zero_grad:
                opt.zero_grad()
            loss.backward()
            opt.step()
        results.append(_params(model))
    for k, v in results[0].items():
        torch.testing.assert_close(results[1][k], v, rtol=0, atol=0)


NO_SCALER = "float16 autocast but the optimizer was given no grad_scaler"


@pytest.mark.parametrize(
    ("dtype", "with_scaler", "said"), [(torch.float16, False, 1), (torch.float16, True, 0), (torch.bfloat16, False, 0)]
)
def test_float16_autocast_without_a_grad_scaler_is_said_once(dtype, with_scaler, said):
    """Lightning's '16-mixed' and Hugging Face's fp16=True scale the loss with their own GradScaler: not given it, the
    optimizer would hold G times the scale squared. Said once, at the first factor step; bfloat16 needs no scaler."""

    x, y = batch(8)
    model = small_net()
    scaler = torch.amp.GradScaler("cpu")
    opt = SPDKFACOptimizer(model, grad_scaler=scaler if with_scaler else None, **KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if with_scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    assert sum(NO_SCALER in str(w.message) for w in caught) == said
