"""KFACPreconditioner attached to your optimizer (``optimizer=``): its ``step()`` preconditions, its ``state_dict()``
carries the K-FAC state, and a step its GradScaler skips drops that batch; each bitwise the explicit loop."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import run_ranks
from spdkfac.update.your_optimizer import STATE_KEY

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

KFAC = dict(damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single", factor_update_steps=1, inv_update_steps=2)


def _loss(model: nn.Module, s: int) -> torch.Tensor:
    x, y = batch(8)
    return nn.functional.cross_entropy(model(x + 0.1 * s), y)


def _explicit(model: nn.Module, steps: range, optimizer: torch.optim.Optimizer, preconditioner: KFACPreconditioner) -> None:
    for s in steps:
        optimizer.zero_grad()
        _loss(model, s).backward()
        preconditioner.step()
        optimizer.step()


def _attached(model: nn.Module, steps: range, optimizer: torch.optim.Optimizer) -> None:
    for s in steps:
        optimizer.zero_grad()
        _loss(model, s).backward()
        optimizer.step()


@torch.no_grad()
def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_the_optimizers_step_preconditions_as_the_explicit_loop_with_its_lr(method):
    """The KL clip's lr defaults to the optimizer's, as its scheduler sets it: the explicit loop with the lambda."""
    ours, ref, plain = small_net(), small_net(), small_net()
    optimizer, ref_optimizer = _sgd(ours), _sgd(ref)
    _pre = KFACPreconditioner(ours, optimizer=optimizer, compute_method=method, **KFAC)
    preconditioner = KFACPreconditioner(ref, lr=lambda _: ref_optimizer.param_groups[0]["lr"], compute_method=method, **KFAC)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (optimizer, ref_optimizer)]
    for s in range(6):
        _attached(ours, range(s, s + 1), optimizer)
        _explicit(ref, range(s, s + 1), ref_optimizer, preconditioner)
        for scheduler in schedulers:
            scheduler.step()
    assert _pre.steps == preconditioner.steps == 6
    assert _max_diff(ours, ref) == 0.0
    _attached(plain, range(6), _sgd(plain))
    assert _max_diff(plain, ref) > 1e-4  # K-FAC changed the result: the comparison above is not vacuous


def test_the_preconditioner_lives_as_long_as_the_optimizer():
    """Built without keeping a reference (the one-line drop-in), it is not collected while the optimizer lives."""
    import gc

    ours, ref = small_net(), small_net()
    optimizer, ref_optimizer = _sgd(ours), _sgd(ref)
    KFACPreconditioner(ours, optimizer=optimizer, **KFAC)
    gc.collect()
    _attached(ours, range(3), optimizer)
    _explicit(ref, range(3), ref_optimizer, KFACPreconditioner(ref, lr=0.05, **KFAC))
    assert _max_diff(ours, ref) == 0.0


@pytest.mark.parametrize("positional", [False, True])
def test_a_closure_runs_before_the_preconditioning(positional):
    """``optimizer.step(closure)`` (Lightning's automatic optimization): the closure's backward pass comes first."""
    ours, ref = small_net(), small_net()
    optimizer, ref_optimizer = torch.optim.AdamW(ours.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    _pre = KFACPreconditioner(ours, optimizer=optimizer, **KFAC)
    losses = []
    for s in range(4):

        def closure(s: int = s) -> torch.Tensor:
            optimizer.zero_grad()
            loss = _loss(ours, s)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure) if positional else optimizer.step(closure=closure))
    _explicit(ref, range(4), ref_optimizer, KFACPreconditioner(ref, lr=0.01, **KFAC))
    assert _max_diff(ours, ref) == 0.0
    assert all(isinstance(loss, torch.Tensor) for loss in losses)


def test_the_optimizers_state_dict_carries_the_kfac_state_and_resumes_bitwise():
    whole = small_net()
    optimizer = _sgd(whole)
    _pre = KFACPreconditioner(whole, optimizer=optimizer, **KFAC)
    _attached(whole, range(6), optimizer)

    first = small_net()
    optimizer = _sgd(first)
    _first = KFACPreconditioner(first, optimizer=optimizer, **KFAC)
    _attached(first, range(3), optimizer)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert STATE_KEY in saved["optimizer"]

    resumed = small_net()
    resumed.load_state_dict(saved["model"])
    optimizer = _sgd(resumed)
    preconditioner = KFACPreconditioner(resumed, optimizer=optimizer, **KFAC)
    optimizer.load_state_dict(saved["optimizer"])
    assert STATE_KEY in saved["optimizer"]  # the caller's dict is left as it was
    assert preconditioner.steps == 3
    _attached(resumed, range(3, 6), optimizer)
    assert _max_diff(resumed, whole) == 0.0


def test_a_checkpoint_without_kfac_state_loads_with_a_warning():
    """A checkpoint of the optimizer alone (before K-FAC was added): its state loads, K-FAC starts afresh."""
    model = small_net()
    plain = _sgd(model)
    _attached(model, range(2), plain)
    optimizer = _sgd(model)
    preconditioner = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    with pytest.warns(UserWarning, match="holds no K-FAC state"):
        optimizer.load_state_dict(plain.state_dict())
    assert preconditioner.steps == 0
    assert torch.equal(
        optimizer.state[next(model.parameters())]["momentum_buffer"], plain.state[next(model.parameters())]["momentum_buffer"]
    )


def test_calling_step_as_well_is_refused():
    model = small_net()
    optimizer = _sgd(model)
    preconditioner = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="precondition the gradients twice"):
        preconditioner.step()
    optimizer.step()
    assert preconditioner.steps == 1


def test_what_cannot_be_attached_is_refused_before_any_hook():
    model = small_net()
    with pytest.raises(TypeError, match="preconditioned twice"):
        KFACPreconditioner(model, optimizer=SPDKFACOptimizer(small_net(), lr=0.1, backend="single"), **KFAC)
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        KFACPreconditioner(model, optimizer=object(), **KFAC)  # type: ignore[arg-type]
    optimizer = _sgd(model)
    _pre = KFACPreconditioner(model, optimizer=optimizer, **KFAC)  # the refused ones left no hook on the model
    _attached(model, range(2), optimizer)
    assert _pre.steps == 2


def test_remove_hooks_detaches_from_the_optimizer():
    model = small_net()
    optimizer = _sgd(model)
    preconditioner = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    _attached(model, range(1), optimizer)
    assert hasattr(optimizer, "consolidate_state_dict")
    preconditioner.remove_hooks()
    _attached(model, range(1, 2), optimizer)
    assert preconditioner.steps == 1
    assert STATE_KEY not in optimizer.state_dict()
    assert not hasattr(optimizer, "consolidate_state_dict")  # (Lightning would take it for a sharded optimizer)


class _ShardedSGD(torch.optim.SGD):
    """An optimizer with a consolidate_state_dict() of its own, as ZeroRedundancyOptimizer."""

    calls: list[tuple[str, int]]

    def consolidate_state_dict(self, to: int = 0) -> None:
        self.calls.append(("optimizer", to))


def test_an_optimizers_own_consolidate_state_dict_runs_after_the_preconditioners():
    model = small_net()
    optimizer = _ShardedSGD(model.parameters(), lr=0.05)
    optimizer.calls = []
    preconditioner = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    preconditioner.kfac.consolidate_state_dict = lambda to: optimizer.calls.append(("kfac", to))  # (a spy)
    optimizer.consolidate_state_dict(to=1)
    assert optimizer.calls == [("kfac", 1), ("optimizer", 1)]
    preconditioner.remove_hooks()
    optimizer.consolidate_state_dict()
    assert optimizer.calls[2:] == [("optimizer", 0)]  # its own again, alone


@pytest.mark.parametrize("overflow_steps", [(), (2,), (2, 3)])
def test_a_step_the_grad_scaler_skips_drops_its_batch_as_the_optimizer_does(overflow_steps):
    """``scaler.step(optimizer)`` skips an overflowing step without calling ``optimizer.step()``: the next forward
    pass drops that batch's factors. Bitwise SPDKFACOptimizer(grad_scaler=...)'s loop, which drops it at zero_grad()."""
    x, y = batch(8)
    ours, ref = small_net(), small_net()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    _pre = KFACPreconditioner(ours, optimizer=optimizer, compute_method="inverse", grad_scaler=scalers[0], **KFAC)
    freqs = dict(factor_update_freq=1, inv_update_freq=2)
    kfac = {k: v for k, v in KFAC.items() if not k.endswith("_steps")}
    reference = SPDKFACOptimizer(ref, lr=0.05, momentum=0.9, compute_method="inverse", grad_scaler=scalers[1], **freqs, **kfac)
    for s in range(7):
        xs = x + 0.1 * s
        if s in overflow_steps:
            xs[0, 0, 0, 0] = float("inf")
        for model, opt, scaler in ((ours, optimizer, scalers[0]), (ref, reference, scalers[1])):
            opt.zero_grad()
            scaler.scale(nn.functional.cross_entropy(model(xs), y)).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scaler.step(opt)
            scaler.update()
    assert _pre.steps == reference.steps == 7 - len(overflow_steps)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** (10 - len(overflow_steps))
    assert _max_diff(ours, ref) == 0.0


def test_a_missed_step_without_a_skipping_scaler_is_still_refused():
    """Only a scaler's skip drops a batch: a forward pass after a backward pass with no step() is still an error."""
    model = small_net()
    optimizer = _sgd(model)
    _pre = KFACPreconditioner(model, optimizer=optimizer, grad_scaler=torch.amp.GradScaler("cpu"), **KFAC)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="adds to the gradients of 1 backward pass"):
        _loss(model, 1).backward()


class _HorovodsSGD(torch.optim.SGD):
    """What ``hvd.DistributedOptimizer(SGD(...))`` makes: a subclass of the optimizer's class, in Horovod's module."""


_HorovodsSGD.__module__ = "horovod.torch.optimizer"


def test_horovods_distributed_optimizer_is_refused_attached():
    model = small_net()
    with pytest.raises(TypeError, match=r"hvd\.DistributedOptimizer would average them a second time"):
        KFACPreconditioner(model, optimizer=_HorovodsSGD(model.parameters(), lr=0.1), **KFAC)


def test_horovods_distributed_optimizer_is_refused_at_its_first_step_in_kaisas_usage():
    """KAISA's horovodrun loop wraps the optimizer (``synchronize()``, ``preconditioner.step()``, then ``step()``
    under ``skip_synchronize()``): its in-place all-reduces would race the preconditioner's on the same tensors."""
    models = [small_net(), small_net()]

    def run(backend: Any) -> str:
        model = models[backend.rank]
        optimizer = _HorovodsSGD(model.parameters(), lr=0.1)
        preconditioner = KFACPreconditioner(model, **{**KFAC, "backend": backend})
        _loss(model, 0).backward()
        preconditioner.step()
        with pytest.raises(TypeError, match="Use the optimizer unwrapped") as refused:
            optimizer.step()
        return str(refused.value)

    assert all("hvd.DistributedOptimizer" in message for message in run_ranks(2, run))
