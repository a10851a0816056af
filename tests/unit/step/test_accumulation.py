"""Gradient accumulation: k micro-batches of b give one batch of k*b, with one round of communication per step."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.base import CommBackend, CompletedHandle, Handle

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_close(a, b):
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(
    ("k", "extra"),
    [
        (2, {}),
        (4, {}),
        (8, dict(kl_clip=None)),  # micro-batches of one sample
        (2, dict(factor_update_freq=2, inv_update_freq=4)),  # non-factor steps accumulate gradients only
        (4, dict(factor_update_freq=3, inv_update_freq=3, pipelining=False)),
        (2, dict(damping=lambda s: 0.02 / (1 + s), factor_update_freq=lambda s: 1 if s < 3 else 2, inv_update_freq=2)),
    ],
)
def test_micro_batches_give_the_full_batch(float64, k, extra):
    x, y = batch(8)
    kw = dict(KW, **extra)
    full = small_net()
    train(full, SPDKFACOptimizer(full, **kw), x, y, 6)
    accumulated = small_net()
    opt = SPDKFACOptimizer(accumulated, accumulation_steps=k, **kw)
    train(accumulated, opt, x, y, 6, accumulate=k)
    assert opt.steps == 6
    _assert_close(_params(full), _params(accumulated))
    assert any(not torch.equal(v, small_net().state_dict()[n]) for n, v in _params(full).items())


def test_factors_are_the_full_batch_factors(float64):
    x, y = batch(8)
    full, accumulated = small_net(), small_net()
    opt1 = SPDKFACOptimizer(full, **dict(KW, factor_decay=0.5))
    opt2 = SPDKFACOptimizer(accumulated, accumulation_steps=4, **dict(KW, factor_decay=0.5))
    train(full, opt1, x, y, 1)
    train(accumulated, opt2, x, y, 1, accumulate=4)
    for a, b in zip(opt1.layers, opt2.layers):
        torch.testing.assert_close(b.A, a.A, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(b.G, a.G, rtol=1e-12, atol=1e-14)


def test_grad_scaler_with_a_skipped_step_discards_the_accumulated_factors(float64):
    """A NaN in the second micro-batch of step 1: the scaler skips, zero_grad drops both micro-batches' factors."""
    x, y = batch(8)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[6] = True
    model = small_net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = SPDKFACOptimizer(model, grad_scaler=scaler, accumulation_steps=2, **KW)
    train(model, opt, x, y, 4, scaler=scaler, poisoned={1: mask}, accumulate=2)
    assert opt.steps == 3
    assert scaler.get_scale() == 2.0**7
    ref = small_net()
    ref_opt = SPDKFACOptimizer(ref, **KW)
    for s in (0, 2, 3):  # the same batches, whole, without the poisoned step
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x + 0.1 * s), y).backward()
        ref_opt.step()
    _assert_close(_params(ref), _params(model))


def test_resume_between_accumulated_steps(float64):
    x, y = batch(8)
    kw = dict(KW, factor_update_freq=2, inv_update_freq=4, accumulation_steps=2)
    full = small_net()
    train(full, SPDKFACOptimizer(full, **kw), x, y, 6, accumulate=2)
    first = small_net()
    opt1 = SPDKFACOptimizer(first, **kw)
    train(first, opt1, x, y, 3, accumulate=2)
    second = small_net(seed=5)
    second.load_state_dict(first.state_dict())
    opt2 = SPDKFACOptimizer(second, **kw)
    opt2.load_state_dict(opt1.state_dict())
    for s in range(3, 6):
        opt2.zero_grad()
        for xm, ym in zip((x + 0.1 * s).chunk(2), y.chunk(2)):
            (nn.functional.cross_entropy(second(xm), ym) / 2).backward()
        opt2.step()
    for k, v in _params(full).items():
        assert torch.equal(_params(second)[k], v), k


# ----------------------------------------------------------------- errors
def _backward(model, x, y, k):
    (nn.functional.cross_entropy(model(x), y) / k).backward()


@pytest.mark.parametrize("factor_step", [True, False])
def test_too_few_backward_passes_twice_in_a_row_is_an_error(factor_step):
    """One step after fewer passes is a short last window (tests/unit/step/test_short_window.py); a second in a row
    says accumulation_steps does not match the loop."""
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, accumulation_steps=3, factor_update_freq=2, inv_update_freq=2, **KW)
    if not factor_step:  # one good step first: step 1 accumulates gradients only
        for _ in range(3):
            _backward(model, x, y, 3)
        opt.step()
    _backward(model, x, y, 3)
    _backward(model, x, y, 3)
    opt.step()  # a short window
    opt.zero_grad()
    _backward(model, x, y, 3)
    _backward(model, x, y, 3)
    with pytest.raises(RuntimeError, match=r"step\(\) after 2 backward pass\(es\) twice in a row, but accumulation_steps is 3"):
        opt.step()
    assert opt.steps == (1 if factor_step else 2)
    # zero_grad discards the partial accumulation; a full one then steps.
    opt.zero_grad()
    for _ in range(3):
        _backward(model, x, y, 3)
    opt.step()
    assert opt.steps == (2 if factor_step else 3)


def test_too_many_backward_passes_is_an_error():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, accumulation_steps=2, factor_update_freq=2, inv_update_freq=2, **KW)
    for _ in range(2):
        _backward(model, x, y, 2)
    with pytest.raises(
        RuntimeError,
        match=r"adds to the gradients of 2 backward pass\(es\) before it with no step\(\) between, but accumulation_steps is 2",
    ):
        _backward(model, x, y, 2)  # a factor step: the third pass's backward, on gradients not cleared, is refused
    opt.zero_grad()
    for _ in range(2):
        _backward(model, x, y, 2)
    opt.step()
    for _ in range(2):
        _backward(model, x, y, 2)
    with pytest.raises(RuntimeError, match=r"received gradient number 3 before step\(\), but accumulation_steps is 2"):
        _backward(model, x, y, 2)  # a non-factor step: the third backward pass is refused


def test_second_forward_with_one_accumulation_step_names_the_option():
    x, y = batch(8)
    model = small_net()
    _opt = SPDKFACOptimizer(model, **KW)  # kept: the model holds its hooks weakly
    _backward(model, x, y, 1)
    with pytest.raises(RuntimeError, match=r"before it with no step\(\) between, but accumulation_steps is 1") as refused:
        _backward(model, x, y, 1)
    assert "To accumulate k micro-batches, each backward()ed before one step()" in str(refused.value)
    assert "pass accumulation_steps=k" in str(refused.value)


def test_clipping_between_uncounted_micro_batches_is_not_clearing():
    """A loop that accumulates without accumulation_steps and clips each micro-batch: the clipped gradient (scaled in
    place) still holds the first micro-batch's, so the second backward pass is refused, not taken as cleared."""
    x, y = batch(8)
    model = small_net()
    _opt = SPDKFACOptimizer(model, **KW)
    _backward(model, x, y, 1)
    nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"before it with no step\(\) between, but accumulation_steps is 1"):
        _backward(model, x, y, 1)


def test_bad_accumulation_steps():
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps must be a positive integer"):
            SPDKFACOptimizer(small_net(), accumulation_steps=bad, **KW)


# ----------------------------------------------- one round of communication per step
class MirrorBackend(CommBackend):
    """Two workers that hold the same data (the average is the tensor itself); records every collective."""

    name = "mirror"

    def __init__(self) -> None:
        self.log: list[str] = []

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 2

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        self.log.append(name)
        return CompletedHandle()

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        self.log.append(name)
        return CompletedHandle()


def test_one_round_of_communication_per_step(float64):
    """Each gradient and factor is all-reduced once per step, from the hooks of the last micro-batch."""
    x, y = batch(8)
    logs = {}
    for k in (1, 4):
        backend = MirrorBackend()
        model = small_net()
        kw = dict(KW, backend=backend, placement="local", fusion="layerwise", accumulation_steps=k, factor_update_freq=2, inv_update_freq=2)
        opt = SPDKFACOptimizer(model, **kw)
        per_pass = []
        for s in range(3):
            opt.zero_grad()
            for xm, ym in zip((x + 0.1 * s).chunk(k), y.chunk(k)):
                before = len(backend.log)
                (nn.functional.cross_entropy(model(xm), ym) / k).backward()
                per_pass.append(len(backend.log) - before)
            opt.step()
        logs[k] = backend.log
        sent = [n for n in per_pass if n]
        assert len(sent) == 3
        assert per_pass[k - 1 :: k] == sent
    assert logs[4] == logs[1]
    n_params = len(list(small_net().parameters()))
    assert len([n for n in logs[1] if n.startswith("spdkfac.grad.")]) == 3 * n_params
    assert len([n for n in logs[1] if n.startswith("spdkfac.factor.")]) == 2 * 2 * 4  # steps 0 and 2, A and G of 4 layers


def test_second_backward_with_one_accumulation_step_names_the_option():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **dict(KW, backend=MirrorBackend(), placement="local", factor_update_freq=2, inv_update_freq=2))
    _backward(model, x, y, 1)
    opt.step()
    _backward(model, x, y, 1)
    with pytest.raises(RuntimeError, match=r"received gradient number 2 before step\(\), but accumulation_steps is 1"):
        _backward(model, x, y, 1)
