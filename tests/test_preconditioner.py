"""KFACPreconditioner: torch's own optimizers on its preconditioned gradients are SPDKFACOptimizer's bases, its
checkpoints resume exactly, and KAISA's option names are taken, mapped or refused naming what to use."""

from __future__ import annotations

import enum
import io
import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import KFACParamScheduler, KFACPreconditioner, NonFiniteError, SPDKFACOptimizer
from spdkfac.preconditioner import kaisa_grad_workers, kaisa_skip_layers

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

STEPS = 7


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _train_pair(model: nn.Module, preconditioner: KFACPreconditioner, optimizer: torch.optim.Optimizer, start: int, stop: int) -> None:
    x, y = batch(8)
    for s in range(start, stop):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        preconditioner.step()
        optimizer.step()


def _train_optimizer(model: nn.Module, optimizer: SPDKFACOptimizer, stop: int = STEPS) -> None:
    x, y = batch(8)
    for s in range(stop):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        optimizer.step()


@torch.no_grad()
def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


KFAC = dict(damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")
FREQS = [(1, 1), (2, 4), (3, 3)]


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize(("factor_freq", "inv_freq"), FREQS)
def test_torch_sgd_on_preconditioned_gradients_is_the_optimizer_with_momentum_sgd(method, factor_freq, inv_freq):
    """torch.optim.SGD adds ``wd * param`` to the preconditioned gradient before its momentum: base='sgd''s rule."""
    ours, ref, plain = small_net(), small_net(), small_net()
    sgd = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    optimizer = torch.optim.SGD(ours.parameters(), **sgd)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    preconditioner = KFACPreconditioner(
        ours, lr=lambda _: optimizer.param_groups[0]["lr"], compute_method=method,
        factor_update_steps=factor_freq, inv_update_steps=inv_freq, **KFAC,
    )  # fmt: skip
    reference = SPDKFACOptimizer(ref, compute_method=method, factor_update_freq=factor_freq, inv_update_freq=inv_freq, **sgd, **KFAC)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(reference, step_size=3, gamma=0.5)
    for s in range(STEPS):
        _train_pair(ours, preconditioner, optimizer, s, s + 1)
        _train_optimizer_step(ref, reference, s)
        scheduler.step()
        ref_scheduler.step()
    assert _max_diff(ours, ref) <= 1e-9
    assert preconditioner.steps == reference.steps == STEPS
    _train_optimizer(plain, SPDKFACOptimizer(plain, precondition=False, **sgd, **KFAC))  # torch's SGD, bitwise
    assert _max_diff(plain, ref) > 1e-4  # K-FAC changed the result: the comparison above is not vacuous


def _train_optimizer_step(model: nn.Module, optimizer: SPDKFACOptimizer, s: int) -> None:
    x, y = batch(8)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
    optimizer.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize(("factor_freq", "inv_freq"), FREQS)
def test_torch_adamw_on_preconditioned_gradients_is_the_optimizer_with_adamw(weight_decay, factor_freq, inv_freq):
    """base='adamw' is torch.optim.AdamW's rule on the preconditioned gradients (spdkfac.update.rules.adamw_delta):
    bitwise without weight decay, to rounding with it (torch scales the parameter first)."""
    ours, ref = small_net(), small_net()
    adamw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    optimizer = torch.optim.AdamW(ours.parameters(), foreach=False, **adamw)
    preconditioner = KFACPreconditioner(
        ours, lr=0.01, compute_method="inverse", factor_update_steps=factor_freq, inv_update_steps=inv_freq, **KFAC
    )
    reference = SPDKFACOptimizer(ref, base="adamw", factor_update_freq=factor_freq, inv_update_freq=inv_freq, **adamw, **KFAC)
    _train_pair(ours, preconditioner, optimizer, 0, STEPS)
    _train_optimizer(ref, reference)
    if weight_decay == 0:
        assert _max_diff(ours, ref) == 0.0
    else:
        assert _max_diff(ours, ref) <= 1e-9


def test_the_kl_clip_uses_the_lr_given():
    """The lr is the KL clip's (a wrong one gives another update), as SPDKFACOptimizer's base lr."""
    a, b = small_net(), small_net()
    _train_pair(a, KFACPreconditioner(a, lr=0.05, **KFAC), torch.optim.SGD(a.parameters(), lr=0.05), 0, 3)
    _train_pair(b, KFACPreconditioner(b, lr=0.5, **KFAC), torch.optim.SGD(b.parameters(), lr=0.05), 0, 3)
    assert _max_diff(a, b) > 1e-6


def test_state_dict_round_trip_resumes_bitwise():
    def make(model: nn.Module) -> tuple[KFACPreconditioner, torch.optim.Optimizer]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return KFACPreconditioner(model, lr=0.05, factor_update_steps=2, inv_update_steps=4, **KFAC), optimizer

    whole = small_net()
    _train_pair(whole, *make(whole), 0, STEPS)
    first = small_net()
    preconditioner, optimizer = make(first)
    _train_pair(first, preconditioner, optimizer, 0, 3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "kfac": preconditioner.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = small_net()
    resumed.load_state_dict(saved["model"])
    preconditioner, optimizer = make(resumed)
    preconditioner.load_state_dict(saved["kfac"])
    optimizer.load_state_dict(saved["optimizer"])
    assert preconditioner.steps == 3
    _train_pair(resumed, preconditioner, optimizer, 3, STEPS)
    assert _max_diff(resumed, whole) == 0.0


def test_reset_batch_forgets_a_backward_pass_whose_step_is_skipped():
    whole, skipped = small_net(), small_net()
    pairs = [(m, KFACPreconditioner(m, lr=0.05, **KFAC), torch.optim.SGD(m.parameters(), lr=0.05)) for m in (whole, skipped)]
    _train_pair(*pairs[0], 0, 4)
    model, preconditioner, optimizer = pairs[1]
    _train_pair(model, preconditioner, optimizer, 0, 2)
    x, y = batch(8)
    nn.functional.cross_entropy(model(x * 3), y).backward()  # a batch given up on: no step()
    preconditioner.reset_batch()
    optimizer.zero_grad()
    _train_pair(model, preconditioner, optimizer, 2, 4)
    assert _max_diff(whole, skipped) == 0.0


def test_a_skipped_step_leaves_no_gradient_for_the_optimizer():
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    preconditioner = KFACPreconditioner(model, lr=0.05, skip_nonfinite=1, **KFAC)
    _train_pair(model, preconditioner, optimizer, 0, 2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(8)
    x[0, 0, 0, 0] = float("nan")
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preconditioner.step()
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert preconditioner.steps == 2
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(NonFiniteError):
        preconditioner.step()  # the second in a row: skip_nonfinite=1


class DistributedStrategy(enum.Enum):  # KAISA's enum, by name
    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


class ComputeMethod(enum.Enum):
    EIGEN = 1
    INVERSE = 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, (None, False)),
        (1.0, (1.0, False)),
        (0.5, (0.5, False)),
        (0, (None, True)),  # KAISA: 0 means 1/P
        ("auto", ("auto", False)),
        ("mem_opt", (None, True)),
        ("HYBRID_OPT", (0.5, False)),
        (DistributedStrategy.COMM_OPT, (None, False)),
        (DistributedStrategy.MEM_OPT, (None, True)),
        (DistributedStrategy.HYBRID_OPT, (0.5, False)),
    ],
)
def test_kaisa_grad_worker_fraction_maps_to_ours(given, expected):
    assert kaisa_grad_workers(given) == expected


@pytest.mark.parametrize("bad", ["half", 1.5, -0.1])
def test_bad_grad_worker_fraction_is_refused(bad):
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        kaisa_grad_workers(bad)


def test_kaisa_skip_layers_are_regular_expressions_searched_in_names_and_class_names():
    model = small_net()  # 0: Conv2d, 2: Conv2d, 4: Linear, 6: Linear
    assert kaisa_skip_layers(model, None) == ()
    assert kaisa_skip_layers(model, ["Lin"]) == ("4", "6")  # search, not match: anywhere in the class name
    assert kaisa_skip_layers(model, ["^[02]$", "Conv", nn.Linear, "kind:depthwise"]) == ("0", "2", nn.Linear, "kind:depthwise")
    with pytest.raises(ValueError, match="'lstm'"):
        kaisa_skip_layers(model, ["lstm"])
    preconditioner = KFACPreconditioner(model, skip_layers=["6"], backend="single")
    assert [layer.name for layer in preconditioner.layers] == ["0", "2", "4"]


def test_kaisa_names_reach_the_optimizer():
    def schedule(step: int) -> float:
        return 0.02

    preconditioner = KFACPreconditioner(
        small_net(), factor_update_steps=2, inv_update_steps=6, damping=schedule, factor_decay=0.8, kl_clip=None,
        lr=0.3, accumulation_steps=2, compute_method=ComputeMethod.INVERSE, grad_worker_fraction=DistributedStrategy.MEM_OPT,
        skip_layers=["Conv2d"], update_factors_in_hook=False, symmetry_aware=True, backend="single",
    )  # fmt: skip
    kfac = preconditioner.kfac
    group = kfac.param_groups[0]
    assert (kfac.factor_update_freq, kfac.inv_update_freq) == (2, 6)
    assert (group["damping"], group["factor_decay"], group["kl_clip"], group["lr"]) == (0.02, 0.8, None, 0.3)
    assert kfac.config.accumulation_steps == 2
    assert kfac.config.compute_method == "inverse"
    assert kfac.config.distribute_preconditioning
    assert kfac.config.pipelining is False
    assert kfac.config.skip_layers == ("0", "2")  # KAISA's regular expression, found in the class names
    assert all(type(layer.helper.module).__name__ != "Conv2d" for layer in preconditioner.layers)
    assert "momentum_buffer" not in str(kfac.state_dict()["state"])
    text = repr(preconditioner)
    assert text.startswith("KFACPreconditioner(")
    assert "lr=0.3" in text
    assert "inv_update_steps=6" in text
    assert "momentum" not in text


def test_kaisa_defaults():
    preconditioner = KFACPreconditioner(small_net(), backend="single")
    group = preconditioner.kfac.param_groups[0]
    assert (group["damping"], group["factor_decay"], group["kl_clip"], group["lr"]) == (0.001, 0.95, 0.001, 0.1)
    assert preconditioner.kfac.config.compute_method == "eigen"


@pytest.mark.parametrize(
    ("name", "value", "names"),
    [
        ("factor_dtype", torch.float32, "dtype"),
        ("inv_dtype", torch.float32, "dtype"),
        ("momentum", 0.9, "your own optimizer"),
        ("weight_decay", 1e-4, "your own optimizer"),
        ("base", "adamw", "SPDKFACOptimizer"),
        ("update_fusion", "forward", "SPDKFACOptimizer"),
        ("factor_update_freq", 2, "factor_update_steps"),
        ("inv_update_freq", 2, "inv_update_steps"),
        ("pipelining", False, "update_factors_in_hook"),
        ("distribute_preconditioning", True, "grad_worker_fraction='mem_opt'"),
    ],
)
def test_options_without_an_equivalent_are_refused_naming_what_to_use(name, value, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(")) as info:
        KFACPreconditioner(small_net(), backend="single", **{name: value})
    assert name in str(info.value)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'dampning'"):
        KFACPreconditioner(small_net(), backend="single", dampning=0.1)


def test_other_refusals():
    with pytest.raises(ValueError, match="factor_decay must be a number"):
        KFACPreconditioner(small_net(), backend="single", factor_decay=lambda s: 0.9)
    with pytest.raises(ValueError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        KFACPreconditioner(small_net(), backend="single", grad_scaler=lambda: 1.0)
    with pytest.raises(ValueError, match="not a gradient for another optimizer"):
        KFACPreconditioner(small_net(), backend="single", compute_method="ekfac", ekfac_update="adam")
    with pytest.raises(ValueError, match="compute_method"):
        KFACPreconditioner(small_net(), backend="single", compute_method="cholesky")
    model = small_net()
    preconditioner = KFACPreconditioner(model, backend="single", lr=lambda s: -1.0 if s else 0.1)
    x, y = batch(8)
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        if preconditioner.steps:
            with pytest.raises(ValueError, match="lr schedule's value at step 1"):
                preconditioner.step()
        else:
            preconditioner.step()


def test_the_per_epoch_scheduler_drives_the_preconditioner():
    model = small_net()
    preconditioner = KFACPreconditioner(model, lr=0.05, factor_update_steps=1, inv_update_steps=2, **KFAC)
    scheduler = KFACParamScheduler(
        preconditioner.kfac, damping_alpha=0.5, damping_schedule=[1], update_freq_alpha=2, update_freq_schedule=[1]
    )
    _train_pair(model, preconditioner, torch.optim.SGD(model.parameters(), lr=0.05), 0, 2)
    scheduler.step()
    _train_pair(model, preconditioner, torch.optim.SGD(model.parameters(), lr=0.05), 2, 3)
    assert preconditioner.kfac.param_groups[0]["damping"] == 0.005
    assert (preconditioner.kfac.factor_update_freq, preconditioner.kfac.inv_update_freq) == (2, 4)


@pytest.mark.parametrize("overflow_steps", [(), (2, 3)])
def test_grad_scaler_loop_is_the_optimizers(overflow_steps):
    """``scaler.unscale_(optimizer); preconditioner.step(); scaler.step(optimizer)`` is SPDKFACOptimizer's GradScaler
    loop; a step whose gradients overflowed is skipped by both (``skip_nonfinite``: the most overflows in a row)."""
    x, y = batch(8)
    ours, ref = small_net(), small_net()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    freqs = dict(factor_update_steps=1, inv_update_steps=2)
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    preconditioner = KFACPreconditioner(ours, lr=0.05, compute_method="inverse", grad_scaler=scalers[0], skip_nonfinite=2, **freqs, **KFAC)
    reference = SPDKFACOptimizer(ref, lr=0.05, momentum=0.9, grad_scaler=scalers[1], factor_update_freq=1, inv_update_freq=2, **KFAC)
    for s in range(7):
        xs = x + 0.1 * s
        if s in overflow_steps:
            xs[0, 0, 0, 0] = float("inf")
        optimizer.zero_grad()
        scalers[0].scale(nn.functional.cross_entropy(ours(xs), y)).backward()
        scalers[0].unscale_(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            preconditioner.step()
        scalers[0].step(optimizer)
        scalers[0].update()
        reference.zero_grad()
        scalers[1].scale(nn.functional.cross_entropy(ref(xs), y)).backward()
        scalers[1].step(reference)
        scalers[1].update()
    assert preconditioner.steps == reference.steps == 7 - len(overflow_steps)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** (10 - len(overflow_steps))
    assert _max_diff(ours, ref) == 0.0


def test_a_ddp_wrapped_model_is_preconditioned_as_the_bare_model(tmp_path):
    """KAISA's usage, ``KFACPreconditioner(DDP(model))``: the layers are the bare model's (KAISA's skip_layers rule
    read on them), so the state matches a bare model's (the 2-worker run: tests/multiprocess)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(small_net())
        preconditioner = KFACPreconditioner(wrapped, backend="single", skip_layers=["Linear$"])
        bare = KFACPreconditioner(small_net(), backend="single", skip_layers=["Linear$"])
        assert [layer.name for layer in preconditioner.layers] == [layer.name for layer in bare.layers] == ["0", "2"]
    finally:
        torch.distributed.destroy_process_group()
