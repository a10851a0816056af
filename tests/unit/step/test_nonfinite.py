"""NaN or Inf on any kind of step: the step is skipped or refused, never NaN parameters (one process).

The 2-worker version (a NaN on one worker only, every worker skipping the same
step) is in tests/multiprocess/test_distributed_equivalence.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import NonFiniteError, SPDKFACOptimizer

KW = dict(lr=0.05, factor_update_freq=2, inv_update_freq=4, backend="single")


def _step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _poisoned(x):
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    return bad


def _state(model, opt):
    return copy.deepcopy(model.state_dict()), {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}


def test_nan_gradient_on_a_step_without_factors_is_refused_and_changes_nothing():
    model = small_net()
    opt = SPDKFACOptimizer(model, **KW)
    x, y = batch(8)
    _step(model, opt, x, y)  # step 0 updates factors and inverses; step 1 only preconditions
    params, momenta = _state(model, opt)
    with pytest.raises(NonFiniteError, match=r"non-finite gradient\(s\) at step 1 for \['0.weight'"):
        _step(model, opt, _poisoned(x), y)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v["momentum_buffer"], momenta[i]) for i, v in enumerate(opt.state.values()))
    assert opt.steps == 1
    _step(model, opt, x, y)  # usable again
    assert opt.steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_nonfinite_skips_that_many_steps_in_a_row_then_raises():
    model = small_net()
    opt = SPDKFACOptimizer(model, skip_nonfinite=2, **KW)
    x, y = batch(8)
    _step(model, opt, x, y)
    params, _ = _state(model, opt)
    for attempt in (1, 2):  # a factor step (2 -> no: step 1 keeps factors) and again: both skipped
        with pytest.warns(UserWarning, match=rf"step skipped \({attempt} in a row, at most 2\)"):
            _step(model, opt, _poisoned(x), y)
    assert opt.steps == 1
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    with pytest.raises(NonFiniteError):
        _step(model, opt, _poisoned(x), y)
    _step(model, opt, x, y)  # a good step resets the count
    with pytest.warns(UserWarning, match=r"\(1 in a row"):
        _step(model, opt, _poisoned(x), y)
    assert opt.kfac_step.nonfinite.skipped_total == 3


def test_nan_factor_step_is_skipped_with_the_factors_untouched():
    model = small_net()
    opt = SPDKFACOptimizer(model, skip_nonfinite=1, **KW)
    x, y = batch(8)
    _step(model, opt, x, y)
    _step(model, opt, x, y)  # step 2 is the next factor step
    a0 = opt.layers[0].A.clone()
    params, _ = _state(model, opt)
    with pytest.warns(UserWarning, match="non-finite Kronecker factor"):
        _step(model, opt, _poisoned(x), y)
    assert torch.equal(opt.layers[0].A, a0)
    assert opt.steps == 2
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())


def test_a_nan_inverse_from_a_damaged_checkpoint_is_named():
    model = small_net()
    opt = SPDKFACOptimizer(model, **KW)
    x, y = batch(8)
    _step(model, opt, x, y)
    opt.layers[2].decomposition("A")[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"inverses \[\"A_inv of '4'\"\] are non-finite"):
        _step(model, opt, x, y)


def test_a_nan_eigendecomposition_from_a_damaged_checkpoint_is_named():
    model = small_net()
    opt = SPDKFACOptimizer(model, compute_method="eigen", **KW)
    x, y = batch(8)
    _step(model, opt, x, y)
    opt.layers[2].decomposition("G").Q[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"eigendecompositions \[\"G_eigen of '4'\"\] are non-finite"):
        _step(model, opt, x, y)


@pytest.mark.parametrize("pipelining", [True, False])
def test_skipping_a_bad_batch_after_the_forward_pass_works(pipelining):
    model = small_net()
    ref = copy.deepcopy(model)
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single", pipelining=pipelining, fusion="threshold")
    ref_opt = SPDKFACOptimizer(ref, lr=0.05, backend="single", pipelining=pipelining, fusion="threshold")
    x, y = batch(8)
    for step in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(_poisoned(x) if step == 1 else x + step), y)
        if not opt.finite_everywhere(loss):
            continue  # the usual idiom: the next forward pass drops this one's factors
        loss.backward()
        opt.step()
    for step in (0, 2):
        _step(ref, ref_opt, x + step, y)
    assert opt.steps == 2
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
