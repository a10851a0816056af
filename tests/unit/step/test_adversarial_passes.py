"""An adversarial attack's forward passes give the step no factors: FGSM and PGD crafted in train mode.

Adversarial training (FGSM, PGD, as in Madry et al.) crafts each batch's
attack with ``torch.autograd.grad(loss, x)``: forward passes whose backward
computes the input's gradient only. Their ``A`` was counted: the next forward
pass, the training one, became a second use of every layer in the same pass,
so ``A`` averaged the clean and the adversarial inputs (the parameters
differed from those of the same loop with the attack crafted elsewhere by
3e-4 after 3 steps, with no warning). A forward pass after such a backward
pass (no weight gradient, no graph built) now drops the step's factors taken
so far, while the step has no gradient yet. The reference crafts the same
attack on a copy of the model, which carries no optimizer hooks.

Fast FGSM as Wong et al.'s loop writes it runs ``backward()`` on the attack
(computing the weights' gradients too) and clears the gradients only after
the training pass's forward. That forward was refused ("computed twice"); it
now drops the attack's pass provisionally, and the backward pass checks that
the gradients were cleared (else it is refused, as a missing
``accumulation_steps`` is).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from nets import assert_bitwise_equal

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

N, STEPS, EPS = 16, 3, 0.1


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))


def _batch(step: int, rank: int = 0, size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    share = N // size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def _attack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: str) -> torch.Tensor:
    """FGSM (one step), PGD (three), or FGSM through ``backward(inputs=)``, in train mode."""
    x_adv = x.clone()
    for _ in range(3 if how == "pgd" else 1):
        x_adv.requires_grad_(True)
        loss = nn.functional.cross_entropy(model(x_adv), y)
        if how == "backward-inputs":
            loss.backward(inputs=[x_adv])
            grad = x_adv.grad
        else:
            (grad,) = torch.autograd.grad(loss, x_adv)
        assert grad is not None
        x_adv = (x_adv + EPS * grad.sign()).detach()
    return x_adv


def _train(
    how: str, on_copy: bool, backend: Any = "single", rank: int = 0, size: int = 1, model: nn.Module | None = None, **options: Any
) -> dict[str, torch.Tensor]:
    """Adversarial training, the attack crafted on the model itself or (``on_copy``) on a copy with no hooks."""
    model = _net() if model is None else model
    opt = SPDKFACOptimizer(model, lr=0.1, backend=backend, **options)
    for step in range(STEPS):
        x, y = _batch(step, rank, size)
        x_adv = _attack(copy.deepcopy(model) if on_copy else model, x, y, how)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_adv), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("how", ["fgsm", "pgd", "backward-inputs"])
def test_the_attacks_passes_give_the_step_no_factors(how, method):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning about unused forward passes either)
        warnings.filterwarnings("ignore", "no perf_model given")
        crafted_here = _train(how, on_copy=False, compute_method=method)
    assert_bitwise_equal(crafted_here, _train(how, on_copy=True, compute_method=method), f"{how}: attack on the model vs on a copy")


@pytest.mark.parametrize(
    "options",
    [
        dict(factor_update_freq=2, inv_update_freq=2, timeline=True),
        dict(update_fusion="forward"),
        dict(base="adamw", pipelining=False),
    ],
    ids=["factors-every-2-steps", "forward-fusion", "adamw-unpipelined"],
)
def test_other_settings_take_the_training_pass_alone(options):
    assert_bitwise_equal(_train("pgd", False, **options), _train("pgd", True, **options), f"pgd, {options}")


def test_the_preconditioner_for_any_optimizer_takes_the_training_pass_alone():
    results = []
    for on_copy in (False, True):
        model = _net()
        preconditioner = KFACPreconditioner(model, lr=0.1, backend="single")
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = _batch(step)
            x_adv = _attack(copy.deepcopy(model) if on_copy else model, x, y, "pgd")
            sgd.zero_grad()
            nn.functional.cross_entropy(model(x_adv), y).backward()
            preconditioner.step()
            sgd.step()
        results.append(model.state_dict())
    assert_bitwise_equal(results[0], results[1], "KFACPreconditioner: attack on the model vs on a copy")


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_two_workers_drop_the_attack_alike_and_equal_one_process(fraction):
    """The dropped factors' all-reduces (started in the attack's forward passes) are completed on every worker."""
    models = [_net() for _ in range(2)]
    options = dict(grad_worker_fraction=fraction)
    ranks = run_ranks(2, lambda b: _train("pgd", False, b, b.rank, b.size, models[b.rank], **options), timeout=120)
    assert_bitwise_equal(ranks[0], ranks[1], "rank 1 vs rank 0")
    one = _train("pgd", on_copy=True)
    for name, value in one.items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def _accumulated_step(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _batch(0)
    for half in (slice(0, N // 2), slice(N // 2, N)):
        x_adv = _attack(model, x[half], y[half], "fgsm")
        (nn.functional.cross_entropy(model(x_adv), y[half]) / 2).backward()
    opt.step()


def test_an_attack_in_a_later_micro_batch_is_counted_and_said_so():
    """With gradient accumulation the step already holds the first micro-batch's factors when the second one's
    attack runs: those stay counted (dropping them would lose the first), with a warning."""
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", accumulation_steps=2)
    with pytest.warns(UserWarning, match="also averages the inputs of the attack's forward passes") as caught:
        _accumulated_step(model, opt)
    assert sum("attack's forward passes" in str(w.message) for w in caught) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _penalty(critic: nn.Module, x_hat: torch.Tensor) -> torch.Tensor:
    (slope,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    return ((slope.norm(dim=1) - 1) ** 2).mean()


def test_a_penalty_pass_that_builds_a_graph_is_not_dropped():
    """WGAN-GP's penalty takes the input gradient with ``create_graph=True``, and that gradient is part of the loss:
    its forward pass is the step's, counted as before, whether it runs before the loss's passes or after them."""
    results = []
    for penalty_first in (False, True):
        critic = _net()
        opt = SPDKFACOptimizer(critic, lr=0.01, factor_decay=0.0, kl_clip=None, backend="single")
        x, _ = _batch(0)
        x_hat = (0.5 * x.flip(0) + 1).requires_grad_(True)  # (inputs of their own: A differs)
        first = _penalty(critic, x_hat) if penalty_first else None
        loss = critic(x).mean()
        (loss + (first if first is not None else _penalty(critic, x_hat))).backward()
        opt.step()
        results.append({layer.name: layer.A.clone() for layer in opt.layers})
    for name, a in results[0].items():
        torch.testing.assert_close(results[1][name], a, rtol=1e-12, atol=1e-14, msg=lambda m, n=name: f"A of {n}: {m}")


def _train_fast_fgsm(
    on_copy: bool,
    backend: Any = "single",
    rank: int = 0,
    size: int = 1,
    model: nn.Module | None = None,
    in_place: bool = False,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """Wong et al.'s loop: the attack's ``backward()``, then the training forward, then ``zero_grad()``, backward, step."""
    model = _net() if model is None else model
    opt = SPDKFACOptimizer(model, lr=0.1, backend=backend, **options)
    for step in range(STEPS):
        x, y = _batch(step, rank, size)
        attacked = copy.deepcopy(model) if on_copy else model
        delta = torch.zeros_like(x, requires_grad=True)
        nn.functional.cross_entropy(attacked(x + delta), y).backward()
        assert delta.grad is not None
        x_adv = (x + EPS * delta.grad.sign()).detach()
        out = model(x_adv)
        opt.zero_grad(set_to_none=not in_place)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"compute_method": "eigen"},
        {"accumulation_steps": 1, "factor_update_freq": 2, "inv_update_freq": 2},
        {"base": "adamw"},
        {"update_fusion": "backward", "kl_clip": None},  # (the attack's backward updated the parameters: rolled back)
    ],
    ids=["inverse", "eigen", "factors-every-2-steps", "adamw", "backward-fusion"],
)
def test_fast_fgsm_clearing_after_the_forward_pass_trains_on_the_training_pass_alone(options):
    assert_bitwise_equal(_train_fast_fgsm(False, **options), _train_fast_fgsm(True, **options), f"fast FGSM, {options}")


def test_fast_fgsm_with_gradients_zeroed_in_place():
    """``zero_grad(set_to_none=False)`` zeroes the attack's gradients in place: cleared too (their version moved)."""
    assert_bitwise_equal(_train_fast_fgsm(False, in_place=True), _train_fast_fgsm(True, in_place=True), "zeroed in place")


def test_fast_fgsm_on_two_workers_equals_one_process():
    """The attack's gradient all-reduces (started in its backward pass) are completed when its pass is dropped."""
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train_fast_fgsm(False, b, b.rank, b.size, models[b.rank]), timeout=120)
    assert_bitwise_equal(ranks[0], ranks[1], "rank 1 vs rank 0")
    for name, value in _train_fast_fgsm(True).items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_a_forward_pass_for_a_metric_before_step_is_refused_at_step_and_the_optimizer_goes_on():
    """A pass beyond accumulation_steps with no backward pass (a metric computed with gradients on) cannot be the
    training pass the provisional drop expects: step() says so, and after zero_grad() training goes on."""
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    x, y = _batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    _accuracy = (model(x).argmax(1) == y).float().mean()
    with pytest.raises(RuntimeError, match=r"step\(\) after a forward pass with no backward pass.*under torch.no_grad\(\)"):
        opt.step()
    assert opt.steps == 0
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.steps == 1
