"""Where a layer's factors cannot describe the step's gradient, the hooks say so, once.

* A second backward pass through one forward pass (``backward(retain_graph=True)``,
  then another): the gradients add up as for the summed losses, but ``G`` adds
  each pass's own output-gradient products, without the cross terms of one
  backward pass of the sum, so the preconditioner silently differed from
  ``(l1 + l2).backward()``'s.
* A forward use that no backward pass reaches (a metric's forward pass with
  gradients on, a detached branch): its inputs are in ``A``, which then
  silently described inputs the gradient does not.
* A layer that trains with its module in ``eval()`` mode inside a training
  model (an encoder kept in eval mode to switch its dropout off) took no
  factors, silently: the hooks read the layer's own mode. They now read the
  model's, so such a layer takes its factors as in train mode.

The other ways gradients reach a layer in one step must stay silent: a layer
used twice, accumulated micro-batches, a gradient penalty's ``autograd.grad``
pass, checkpointed segments recomputed in the backward pass, and a head left
out of the loss in some steps (it counts as not run).
"""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import shared_net
from torch.utils.checkpoint import checkpoint

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

SECOND_PASS = "a second backward pass went through the same forward pass"
UNUSED = "no backward pass reached"


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


def _said(run: Callable[[], None], what: str = SECOND_PASS) -> int:
    return len(_messages(run, what))


def _messages(run: Callable[[], None], *what: str) -> list[str]:
    """The warnings ``run()`` gives that say any of ``what``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if any(part in str(w.message) for part in what)]


def test_two_backward_passes_through_one_forward_are_said_once():
    model, (x, y) = _net(), _data()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")

    def run() -> None:
        for s in range(3):
            opt.zero_grad()
            out = model(x + 0.1 * s)
            F.cross_entropy(out, y).backward(retain_graph=True)
            (0.5 * out.pow(2).mean()).backward()
            opt.step()

    assert _said(run) == 1
    assert opt.steps == 3


def _summed(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    out = model(x)
    (F.cross_entropy(out, y) + 0.5 * out.pow(2).mean()).backward()
    opt.step()


def _accumulated(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        (F.cross_entropy(model(xm), ym) / 2).backward()
    opt.step()


def _penalty(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    x = x.requires_grad_()
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (F.cross_entropy(out, y) + grad.pow(2).mean()).backward()
    opt.step()


def _checkpointed(model: nn.Module, opt: SPDKFACOptimizer, reentrant: bool) -> None:
    x, y = _data()
    out = model[2](checkpoint(lambda t: model[1](model[0](t)), x.requires_grad_(), use_reentrant=reentrant))
    F.cross_entropy(out, y).backward()
    opt.step()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.aux = nn.Linear(5, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head(h), self.aux(h)


def _wgan_gp(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    """WGAN-GP's critic step: the interpolates' use is reached by the penalty's ``autograd.grad`` pass only."""
    x, _ = _data()
    fake, mix = x.flip(0), torch.rand(x.shape[0], 1, generator=torch.Generator().manual_seed(3))
    x_hat = (mix * x + (1 - mix) * fake).requires_grad_()
    (slope,) = torch.autograd.grad(model(x_hat).sum(), x_hat, create_graph=True)
    (model(fake).mean() - model(x).mean() + ((slope.norm(dim=1) - 1) ** 2).mean()).backward()
    opt.step()


def _aux_some_steps(model: nn.Module, opt: SPDKFACOptimizer, step: int) -> None:
    """The auxiliary head runs every step but is in the loss every other step (when out of it, it counts as not run)."""
    x, y = _data()
    out, aux = model(x)
    (F.cross_entropy(out, y) + (F.cross_entropy(aux, y) if step % 2 else 0.0)).backward()
    opt.step()


@pytest.mark.parametrize(
    "case", ["summed", "accumulated", "penalty", "wgan-gp", "checkpoint-reentrant", "checkpoint", "used-twice", "aux-some-steps"]
)
def test_other_ways_gradients_reach_a_layer_say_nothing(case):
    if case == "aux-some-steps":
        model = _TwoHeads()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")

        def run() -> None:
            for s in range(3):
                opt.zero_grad()
                _aux_some_steps(model, opt, s)

    elif case == "used-twice":
        model = shared_net()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(2))

        def run() -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    else:
        model = _net()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", accumulation_steps=2 if case == "accumulated" else 1)
        steps = {
            "summed": _summed,
            "accumulated": _accumulated,
            "penalty": _penalty,
            "wgan-gp": _wgan_gp,
            "checkpoint-reentrant": lambda m, o: _checkpointed(m, o, True),
            "checkpoint": lambda m, o: _checkpointed(m, o, False),
        }

        def run() -> None:
            for _ in range(2):
                opt.zero_grad()
                steps[case](model, opt)

    said = _messages(run, SECOND_PASS, UNUSED)
    assert said == []
    assert opt.steps >= 1


def _metric_pass(model: nn.Module, opt: SPDKFACOptimizer, step: int) -> None:
    """A training-mode forward pass with gradients on, for a number only, then the step's own pass."""
    x, y = _data()
    F.cross_entropy(model(x.flip(0)), y).item()
    F.cross_entropy(model(x + 0.1 * step), y).backward()
    opt.step()


def _detached_use(model: nn.Module, opt: SPDKFACOptimizer, step: int) -> None:
    """The model run on two views, one of them a detached target (stop-gradient)."""
    x, _ = _data()
    target = model(x.flip(0)).detach()
    (model(x + 0.1 * step) - target).pow(2).mean().backward()
    opt.step()


def _aux_first_micro_batch(model: nn.Module, opt: SPDKFACOptimizer, step: int) -> None:
    """Two accumulated micro-batches; the auxiliary head is in the first one's loss only."""
    x, y = _data()
    for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
        out, aux = model(xm)
        ((F.cross_entropy(out, ym) + (F.cross_entropy(aux, ym) if i == 0 else 0.0)) / 2).backward()
    opt.step()


@pytest.mark.parametrize(
    ("case", "layer", "uses"), [("metric", "'0'", "2 time(s)"), ("detached", "'0'", "2 time(s)"), ("aux-micro-batch", "'aux'", "2 time(s)")]
)
def test_a_forward_use_no_backward_pass_reaches_is_said_once(case, layer, uses):
    """Its inputs are in A (the forward hook cannot know no gradient will come): said once, naming the layer."""
    model: nn.Module = _TwoHeads() if case == "aux-micro-batch" else _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", accumulation_steps=2 if case == "aux-micro-batch" else 1)
    steps = {"metric": _metric_pass, "detached": _detached_use, "aux-micro-batch": _aux_first_micro_batch}

    def run() -> None:
        for s in range(3):
            opt.zero_grad()
            steps[case](model, opt, s)

    (message,) = _messages(run, UNUSED)
    assert f"layer {layer} ran {uses} with gradients enabled in this step, but a backward pass reached the output of 1 of" in message
    assert opt.steps == 3


def test_a_forward_use_no_backward_pass_reaches_is_said_on_every_worker():
    """The workers decide from the step's agreement, so each says it (and each trains on, a replica)."""
    models = [_net() for _ in range(2)]

    def run(backend: object) -> torch.Tensor:
        model = models[backend.rank]  # type: ignore[attr-defined]
        opt = SPDKFACOptimizer(model, lr=0.1, backend=backend)
        for s in range(2):
            opt.zero_grad()
            _metric_pass(model, opt, s)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    ranks: list[torch.Tensor] = []
    said = _messages(lambda: ranks.extend(run_ranks(2, run, timeout=60)), UNUSED)  # (the ranks are threads: caught here)
    assert len(said) == 2
    assert all("ran 2 time(s) with gradients enabled in this step, but a backward pass reached the output of 1 of" in m for m in said)
    assert torch.equal(ranks[0], ranks[1])


def _dropout_net(p: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(p), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("part", ["layer", "dropout"])
def test_a_part_in_eval_mode_inside_a_training_model_takes_its_factors(part):
    """A layer (or the Dropout after it) put in eval mode while the model trains: the layer takes its factors as in
    train mode, so the run is the one of the same model with that part's eval behaviour built in (no dropout)."""
    results = []
    for in_eval in (True, False):
        model = _dropout_net() if in_eval else _dropout_net(p=0.0)
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
        x, y = _data()
        for s in range(3):
            model.train()
            if in_eval:
                model[0 if part == "layer" else 1].eval()
                if part == "layer":
                    model[1].eval()  # (the comparison model has no dropout)
            opt.zero_grad()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
        results.append((model, opt))
    (evaluated, evaluated_opt), (plain, _) = results
    assert not torch.equal(evaluated_opt.layers[0].A, torch.eye(6))  # (it took factors)
    for a, b in zip(evaluated.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_a_model_in_eval_mode_takes_no_factor_and_its_evaluation_passes_say_nothing():
    """Evaluation passes put the model in eval mode: no factor is taken there, with gradients on or not, and a
    factor step after a backward pass in eval mode is refused with the remedy."""
    model, (x, y) = _dropout_net(), _data()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")

    def run() -> None:
        for s in range(3):
            opt.zero_grad()
            model.train()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
            model.eval()
            model(x.flip(0)).argmax(1)  # an evaluation pass, gradients on (no torch.no_grad())

    assert _messages(run, SECOND_PASS, UNUSED) == []
    assert opt.steps == 3
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()  # (still in eval mode)
    with pytest.raises(RuntimeError, match=r"run the forward and backward pass in training mode \(model.train\(\)\)"):
        opt.step()
