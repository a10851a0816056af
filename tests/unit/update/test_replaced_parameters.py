"""A model's parameters replaced after the optimizer was built, or never allocated (meta device): refused by name.

``load_state_dict(..., assign=True)``, ``to_empty()`` and conversions under
``torch.__future__.set_overwrite_module_params_on_conversion(True)`` make
new parameters; an optimizer built before them holds the old ones (before,
``step()`` failed with "no Kronecker factor was computed", and on steps
without factors it would have updated the old tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from spdkfac import KFACPreconditioner, SPDKFACOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _pass(model: nn.Module) -> None:
    x, y = torch.randn(4, 5, dtype=next(model.parameters()).dtype), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(model(x), y).backward()


def test_a_model_on_the_meta_device_is_refused_when_the_optimizer_is_built():
    with torch.device("meta"):
        model = _net()
    for build in (lambda: SPDKFACOptimizer(model, lr=0.1, backend="single"), lambda: KFACPreconditioner(model, backend="single")):
        with pytest.raises(ValueError, match=r"on the meta device \(0.weight, 0.bias, 2.weight, 2.bias\).*after model.to_empty"):
            build()


def _assigned(model: nn.Module) -> None:
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _converted(model: nn.Module) -> None:
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)


def _weight_normed(model: nn.Module) -> None:
    nn.utils.weight_norm(model[2])


@pytest.mark.parametrize("replace", [_assigned, _converted, _weight_normed], ids=["assign", "overwrite-on-conversion", "weight-norm"])
@pytest.mark.parametrize("factor_step", [True, False], ids=["factor-step", "step-without-factors"])
def test_a_parameter_replaced_after_the_optimizer_was_built_is_refused_at_step(replace: Callable[[nn.Module], None], factor_step: bool):
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", factor_update_freq=1 if factor_step else 2, inv_update_freq=2)
    if not factor_step:  # (step 1 computes no factors)
        _pass(model)
        opt.step()
        opt.zero_grad()
    replace(model)
    before = [p.detach().clone() for p in model.parameters()]
    _pass(model)
    with pytest.raises(RuntimeError, match=r"parameter '(0|2)\.weight' is not the tensor this optimizer was built with"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # (refused before anything changed)


def test_changes_that_keep_the_parameters_train_on():
    """``load_state_dict()`` (copying), ``double()``, ``to(memory_format=...)`` write into the same parameters."""
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    model.double()
    _pass(model)
    opt.step()
    assert opt.steps == 1


def test_a_submodule_replaced_after_the_optimizer_was_built_is_said_once():
    """``model[2] = nn.Linear(...)`` after building: its parameters are held by no optimizer (torch.optim leaves them
    untrained, silently); the first step names them."""
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    model[2] = nn.Linear(8, 3)
    _pass(model)
    with pytest.warns(UserWarning, match=r"trainable parameters this optimizer was not built with \(2.weight, 2.bias\)"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _pass(model)
        opt.step()  # (said once)


def test_a_module_added_with_its_group_is_not_said():
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    model.append(nn.Linear(3, 3))
    opt.add_param_group({"params": model[3].parameters()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "no perf_model given")
        _pass(model)
        opt.step()
