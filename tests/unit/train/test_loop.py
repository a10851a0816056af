"""The one training loop (spdkfac.train.loop) and the one argument→optimizer mapping (spdkfac.train.optimizer_options)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from benchmarks import convergence
from spdkfac import SPDKFACOptimizer
from spdkfac.dho2 import DHO2Optimizer
from spdkfac.train.args import parse_args
from spdkfac.train.loop import EpochTotals, TrainingStep, lr_at, train_epoch
from spdkfac.train.optimizer_options import KFAC_ARGUMENTS, optimizer_options


def _batches(n: int, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def test_a_step_is_sgd_on_the_mean_loss_of_its_micro_batches() -> None:
    """Two micro-batches of 4 give the gradient of the batch of 8 (to rounding), and the totals count every sample."""
    batches = _batches(3)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    model = _model()
    step = TrainingStep(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.1, accumulation_steps=2)
    totals = EpochTotals()
    losses = list(train_epoch(step, batches, lambda i: 0.1, totals))
    assert len(losses) == 3
    assert totals.count == 24
    assert len(totals.iter_s) == 3
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert 0 <= totals.correct <= 24
    assert totals.loss_sum > 0


def test_the_lr_follows_the_schedule_and_other_groups_in_proportion() -> None:
    """Each step runs at lr_of_step(i); a group made with half the peak LR (Muon's AdamW part) stays at half."""
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}], lr=0.1)
    seen: list[list[float]] = []
    real_step = opt.step

    def recording_step(closure: Callable[[], float] | None = None) -> None:
        seen.append([group["lr"] for group in opt.param_groups])
        real_step(closure)

    opt.step = recording_step  # type: ignore[method-assign]
    step = TrainingStep(model, opt, 0.1)
    list(train_epoch(step, _batches(3), lambda i: 0.1 / (i + 1), EpochTotals()))
    assert seen == [[0.1, 0.05], [0.05, 0.025], [0.1 / 3, 0.05 / 3]]
    assert step.lr == 0.1 / 3


class _ClosureOptimizer(torch.optim.SGD):
    """Stands for an optimizer that evaluates the loss itself (DHO2, K-FAC's adaptive damping: ``needs_loss_closure``)."""

    needs_loss_closure = True

    def __init__(self, params: object) -> None:
        super().__init__(params, lr=0.1)  # type: ignore[arg-type]
        self.closure_losses: list[float] = []

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        assert closure is not None, "an optimizer that asks for the loss must get a closure"
        self.closure_losses.append(float(closure()))
        super().step()


def test_an_optimizer_that_evaluates_the_loss_gets_the_whole_batch_as_its_closure() -> None:
    model = _model()
    opt = _ClosureOptimizer(model.parameters())
    x, y = _batches(1, batch=6)[0]
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(x), y, label_smoothing=0.1))
    step = TrainingStep(model, opt, 0.1, accumulation_steps=3, label_smoothing=0.1)
    step(x, y, EpochTotals())
    assert opt.closure_losses == [pytest.approx(expected, rel=1e-12)]


def test_the_optimizers_that_evaluate_the_loss_say_so_and_get_the_closure() -> None:
    """``needs_loss_closure``: K-FAC under adaptive damping and DHO2 evaluate the loss in step() (and refuse a step
    without the closure); fixed damping and torch's optimizers do not."""
    assert not SPDKFACOptimizer(_model(), lr=0.1).needs_loss_closure
    assert not hasattr(torch.optim.SGD(_model().parameters(), lr=0.1), "needs_loss_closure")
    x, y = _batches(1)[0]
    for make in (lambda m: SPDKFACOptimizer(m, lr=0.1, damping="adaptive"), lambda m: DHO2Optimizer(m, refresh_every=1)):
        model = _model()
        opt = make(model)
        assert opt.needs_loss_closure
        before = [p.detach().clone() for p in model.parameters()]
        TrainingStep(model, opt, 0.1)(x, y, EpochTotals())
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_lr_at_warms_up_from_the_single_worker_lr_then_decays() -> None:
    args = argparse.Namespace(warmup_epochs=1.0, schedule="cosine", epochs=11, lr_decay_epochs=[])
    assert lr_at(args, 0.4, 0.0, workers=4) == pytest.approx(0.1)
    assert lr_at(args, 0.4, 0.5, workers=4) == pytest.approx(0.25)
    assert lr_at(args, 0.4, 1.0, workers=4) == pytest.approx(0.4)
    assert lr_at(args, 0.4, 11.0, workers=4) == pytest.approx(0.004)
    step = argparse.Namespace(warmup_epochs=0.0, schedule="step", epochs=10, lr_decay_epochs=[3, 6])
    assert [lr_at(step, 1.0, e) for e in (0, 3, 6)] == pytest.approx([1.0, 0.1, 0.01])


def test_the_job_maps_its_arguments_to_the_optimizer() -> None:
    """What spdkfac.train passes to make_optimizer, for each kind of optimizer it offers."""
    sgd = optimizer_options("sgd", parse_args(["--optimizer", "sgd", "--data", "mnist5k"]))
    assert sgd == {"weight_decay": 5e-4, "momentum": 0.9, "update_fusion": "none"}
    args = parse_args(["--optimizer", "spdkfac", "--data", "mnist5k", "--compute-method", "eigen", "--kl-clip", "0"])
    kfac = optimizer_options("spdkfac", args)
    assert set(kfac) == {"weight_decay", "momentum", "update_fusion", *KFAC_ARGUMENTS}
    assert kfac["compute_method"] == "eigen"
    assert kfac["kl_clip"] is None
    assert kfac["damping"] == 0.003
    adam = optimizer_options("spdkfac", parse_args(["--optimizer", "spdkfac", "--base", "adamw"]))
    assert adam["base"] == "adamw"
    assert adam["weight_decay"] == 0.05
    assert "momentum" not in adam
    dho2_args = parse_args(["--optimizer", "dho2", "--refresh-every", "20"])
    dho2 = optimizer_options("dho2", dho2_args, dho2={"refresh_every": 20, "seed": 42})
    assert dho2 == {"weight_decay": 0.05, "refresh_every": 20, "seed": 42}


def test_the_benchmark_uses_the_same_mapping_and_a_spec_wins_over_the_flags() -> None:
    """benchmarks.convergence gets the job's K-FAC flags; an entry's own option wins; Adam types take --adamw-weight-decay."""
    args = convergence.parse_args(["--optimizers", "spdkfac", "--compute-method", "eigen", "--out", "/tmp/spdkfac-test-loop"])
    kfac = convergence.optimizer_kwargs("spdkfac", args, "digits")
    assert kfac["compute_method"] == "eigen"
    assert kfac["kl_clip"] == 1e-4
    assert kfac["momentum"] == 0.9
    assert kfac == optimizer_options("spdkfac", argparse.Namespace(**{**vars(args), "kl_clip": 1e-4}), adam_weight_decay=0.05)
    spec = convergence.optimizer_kwargs("spdkfac:compute_method=inverse,base=adamw", args, "mnist5k")
    assert not {"compute_method", "base", "momentum"} & set(spec)
    assert spec["weight_decay"] == args.adamw_weight_decay
    assert spec["kl_clip"] == 1e-3
