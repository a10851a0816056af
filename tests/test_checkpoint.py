"""Save/resume reproduces the uninterrupted trajectory bit for bit."""

import io

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import SPDKFACOptimizer

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_update_freq=2, inv_update_freq=4, backend="single")


def _steps(model, opt, x, y, start, stop):
    for s in range(start, stop):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()


def _uninterrupted_and_first_half():
    """(9-step model, its optimizer, 5-step model, its optimizer, data): step 5 falls between factor and inverse updates."""
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **KW)
    _steps(model, opt, x, y, 0, 9)
    first = small_net()
    opt1 = SPDKFACOptimizer(first, **KW)
    _steps(first, opt1, x, y, 0, 5)
    return model, opt, first, opt1, x, y


def test_resume_is_bitwise_identical():
    model, opt, first, opt1, x, y = _uninterrupted_and_first_half()
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    resumed = small_net(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = SPDKFACOptimizer(resumed, **KW)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.steps == 5
    _steps(resumed, opt2, x, y, 5, 9)

    for k, v in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    for a, b in zip(opt.layers, opt2.layers):
        assert torch.equal(a.A, b.A)
        assert torch.equal(a.decomposition("G"), b.decomposition("G"))


def test_resume_without_kfac_state_would_differ():
    """Guard: corrupting the factors on resume changes the trajectory (so the test above can fail)."""
    model, _opt, first, opt1, x, y = _uninterrupted_and_first_half()
    sd = opt1.state_dict()
    for entry in sd["kfac"]["layers"].values():
        entry["A"] = entry["A"] * 2
    opt2 = SPDKFACOptimizer(first, **KW)
    opt2.load_state_dict(sd)
    _steps(first, opt2, x, y, 5, 9)
    assert any(not torch.equal(first.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("order", ["before", "after", "after, a step first", "after, a save first"])
def test_the_kfac_part_given_beside_a_checkpoint_that_lacks_it_resumes_bitwise(order):
    """torch.distributed.checkpoint keeps an optimizer's ``state`` and ``param_groups`` only: the K-FAC part given by
    load_kfac_state_dict() before that load, or after it (Lightning's FSDP2 strategy loads the optimizer before its
    ``on_load_checkpoint`` hook), resumes bit for bit; a step or a save before it arrives is refused (it would go on
    from fresh factors), naming the fix."""
    model, _, first, opt1, x, y = _uninterrupted_and_first_half()
    saved = opt1.state_dict()
    base_only = {"state": saved["state"], "param_groups": saved["param_groups"]}
    kfac = opt1.kfac_state_dict()
    resumed = small_net(seed=123)
    resumed.load_state_dict(first.state_dict())
    opt2 = SPDKFACOptimizer(resumed, **KW)
    with pytest.raises(ValueError, match="compute_method"):
        SPDKFACOptimizer(small_net(), **KW, compute_method="eigen").load_kfac_state_dict(kfac)
    if order == "before":
        opt2.load_kfac_state_dict(kfac)
    opt2.load_state_dict(base_only)
    if order.startswith("after, "):
        refused = (lambda: _steps(resumed, opt2, x, y, 5, 6)) if "step" in order else opt2.state_dict
        with pytest.raises(RuntimeError, match=r"'state' and 'param_groups' alone .*load_kfac_state_dict\(saved\)"):
            refused()
        opt2.zero_grad()
    if order != "before":
        opt2.load_kfac_state_dict(kfac)
    _steps(resumed, opt2, x, y, 5, 9)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def _checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with every child that has parameters wrapped by torch's activation-checkpoint wrapper (what
    accelerate's and Lightning's FSDP activation checkpointing apply): its layers' module names gain
    ``_checkpoint_wrapped_module``, its ``state_dict()`` keys do not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    children = {id(m) for m in model.children() if any(True for _ in m.parameters())}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in children)
    return model


@pytest.mark.parametrize("saved_with", ["checkpointing", "plain"])
def test_a_checkpoint_resumes_with_activation_checkpointing_turned_on_or_off(saved_with):
    """Turned on or off between runs, the wrappers change the layers' module names (``0.weight``'s layer is
    ``0._checkpoint_wrapped_module``): the K-FAC state is matched through them, and the run resumes bitwise the
    uninterrupted one (the wrapper recomputes the same forward)."""
    model, _, _, _, x, y = _uninterrupted_and_first_half()
    first = _checkpointed(small_net()) if saved_with == "checkpointing" else small_net()
    opt1 = SPDKFACOptimizer(first, **KW)
    _steps(first, opt1, x, y, 0, 5)
    checkpoint = {"model": first.state_dict(), "opt": opt1.state_dict()}
    second = small_net() if saved_with == "checkpointing" else _checkpointed(small_net())
    opt2 = SPDKFACOptimizer(second, **KW)
    assert sorted(layer.name for layer in opt1.layers) != sorted(layer.name for layer in opt2.layers)
    second.load_state_dict(checkpoint["model"])  # (the wrapper's keys are the plain model's)
    opt2.load_state_dict(checkpoint["opt"])
    _steps(second, opt2, x, y, 5, 9)
    for got, want in zip(second.parameters(), model.parameters()):
        assert torch.equal(got, want)


def test_a_checkpoint_of_other_layers_is_still_refused_through_wrappers():
    """The matching through wrappers renames nothing else: a checkpoint of a model with another layer is refused."""
    first = _checkpointed(small_net())
    opt1 = SPDKFACOptimizer(first, **KW)
    x, y = batch(8)
    _steps(first, opt1, x, y, 0, 2)
    other = small_net()
    other.add_module("extra", nn.Linear(3, 3))
    opt2 = SPDKFACOptimizer(other, **KW)
    with pytest.raises(ValueError, match="different model"):
        opt2.load_state_dict(opt1.state_dict())
