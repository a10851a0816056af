"""A KAISA script's options run unchanged: the options for what this project decides itself are taken (bucket sizes
mapped to threshold fusion, placement hints without effect, the log level used), KAISA's hyperparameter properties
read and set, and its ``LambdaParamScheduler`` scales them as KAISA's does."""

from __future__ import annotations

import copy
import enum
import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

import spdkfac.kaisa as kfac
from spdkfac import KFACPreconditioner, LambdaParamScheduler

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

KFAC = dict(damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")


def _train(options: dict[str, Any], steps: int = 6, scheduler: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """``steps`` steps of torch's SGD on the preconditioned gradients (a ``LambdaParamScheduler`` stepped after each
    preconditioner step, as KAISA's examples do, where ``scheduler`` gives its lambdas)."""
    torch.manual_seed(0)
    model = small_net().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preconditioner = KFACPreconditioner(model, lr=0.05, **options)
    sched = None if scheduler is None else LambdaParamScheduler(preconditioner, **scheduler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _loop(model, preconditioner, optimizer, range(steps), sched)
    return [p.detach().clone() for p in model.parameters()]


def _loop(model: nn.Module, preconditioner: Any, optimizer: torch.optim.Optimizer, steps: range, scheduler: Any = None) -> None:
    """KAISA's loop: backward, ``preconditioner.step()``, ``optimizer.step()``, then the scheduler's step if any."""
    x, y = batch(8)
    for s in steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x.double() + 0.1 * s), y).backward()
        preconditioner.step()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def test_kaisas_vision_example_options_are_taken():
    """KAISA's examples pass allreduce_bucket_cap_mb=25 and colocate_factors: fixed 25 MB buckets, said once."""
    with pytest.warns(UserWarning, match=r"fixed 25 MB buckets \(fusion='threshold'\)") as caught:
        p = KFACPreconditioner(small_net(), allreduce_bucket_cap_mb=25, colocate_factors=True, **KFAC)
    assert len([w for w in caught if "buckets" in str(w.message)]) == 1
    assert (p.kfac.config.fusion, p.kfac.config.fusion_threshold_bytes) == ("threshold", 25 * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (0: no buckets, nothing to say)
        none = KFACPreconditioner(small_net(), allreduce_bucket_cap_mb=0, **KFAC)
    assert none.kfac.config.fusion == "layerwise"
    assert KFACPreconditioner(small_net(), **KFAC).kfac.config.fusion == "optimal"
    with pytest.raises(ValueError, match=r"allreduce_bucket_cap_mb .* or fusion='naive', not both"):
        KFACPreconditioner(small_net(), allreduce_bucket_cap_mb=25, fusion="naive", **KFAC)
    with pytest.raises(ValueError, match="allreduce_bucket_cap_mb"):
        KFACPreconditioner(small_net(), allreduce_bucket_cap_mb=-1, **KFAC)


class AssignmentStrategy(enum.Enum):
    """KAISA's enum, as a script passes it."""

    COMPUTE = 1
    MEMORY = 2


def test_placement_hints_are_taken_and_change_nothing():
    hints = dict(colocate_factors=False, assignment_strategy=AssignmentStrategy.MEMORY, compute_eigenvalue_outer_product=False)
    plain = _train(dict(KFAC, compute_method="eigen", factor_update_steps=1, inv_update_steps=2))
    hinted = _train(
        dict(KFAC, compute_method="eigen", factor_update_steps=1, inv_update_steps=2, factor_dtype=None, inv_dtype=None, **hints)
    )
    for a, b in zip(plain, hinted):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("option", "error", "says"),
    [
        (dict(colocate_factors="yes"), TypeError, "must be bools"),
        (dict(compute_eigenvalue_outer_product=1), TypeError, "must be bools"),
        (dict(assignment_strategy="fastest"), ValueError, "assignment_strategy must be one of"),
        (dict(factor_dtype=torch.float16), ValueError, "'factor_dtype' other than None"),
        (dict(inv_dtype=torch.float32), ValueError, "'inv_dtype' other than None"),
    ],
)
def test_bad_values_of_kaisas_options_are_refused(option, error, says):
    with pytest.raises(error, match=says):
        KFACPreconditioner(small_net(), **option, **KFAC)


def test_loglevel_logs_the_summary_and_the_hints_at_that_level(caplog):
    with caplog.at_level(logging.INFO, logger="spdkfac"):
        KFACPreconditioner(small_net(), **KFAC)  # (KAISA's default level, DEBUG: not shown at INFO)
        assert not caplog.records
        KFACPreconditioner(small_net(), loglevel=logging.INFO, colocate_factors=False, **KFAC)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert {r.levelno for r in caplog.records} == {logging.INFO}
    assert "KFACPreconditioner(layers=" in text
    assert "Linear" in text  # (the summary's table of preconditioned modules)
    assert "colocate_factors=False" in text


def test_kaisas_properties_read_the_values_in_force_and_set_the_numbers():
    p = KFACPreconditioner(
        small_net(),
        lr=0.05,
        damping=lambda s: 0.02 if s < 3 else 0.01,
        factor_update_steps=2,
        inv_update_steps=4,
        **{k: v for k, v in KFAC.items() if k != "damping"},
    )
    assert (p.damping, p.kl_clip, p.factor_decay, p.lr, p.factor_update_steps, p.inv_update_steps) == (0.02, 0.01, 0.9, 0.05, 2, 4)
    p.kl_clip, p.factor_decay, p.lr, p.factor_update_steps, p.inv_update_steps = 0.02, 0.8, 0.1, 1, 3
    assert (p.kl_clip, p.factor_decay, p.lr, p.factor_update_steps, p.inv_update_steps) == (0.02, 0.8, 0.1, 1, 3)
    assert p.kfac.param_groups[0]["kl_clip"] == 0.02
    assert (p.kfac.factor_update_freq, p.kfac.inv_update_freq) == (1, 3)
    with pytest.raises(ValueError, match="damping was given as a function of the step"):
        p.damping = 0.1
    with pytest.raises(ValueError, match=r"factor_decay must be in"):
        p.factor_decay = 1.5
    p.kl_clip = None
    assert p.kl_clip is None


def test_the_lambda_scheduler_scales_as_kaisas_and_trains_as_the_same_values_given_as_schedules():
    """Stepped after each preconditioner step (KAISA's order), with lambdas of the steps done: each value is multiplied
    by the lambda's value every time (KAISA's rule), so the damping halves at steps 2 and 4 and the inverse interval
    doubles at 3 (cast to int) -- the run of those values given as functions of the step, bitwise."""
    lambdas = dict(
        damping_lambda=lambda s: 0.5 if s in (2, 4) else 1.0,
        inv_update_steps_lambda=lambda s: 2.0 if s == 3 else 1.0,
        kl_clip_lambda=lambda s: 0.9 if s == 1 else 1.0,
    )
    scheduled = _train(KFAC, scheduler=lambdas)
    by_hand = _train(
        dict(
            KFAC,
            damping=lambda s: 0.01 * 0.5 ** ((s >= 2) + (s >= 4)),
            inv_update_steps=lambda s: 2 if s >= 3 else 1,
            kl_clip=lambda s: 0.01 * 0.9 if s >= 1 else 0.01,
        )
    )
    for a, b in zip(scheduled, by_hand):
        assert torch.equal(a, b)
    assert max(float((a - b).abs().max()) for a, b in zip(scheduled, _train(KFAC))) > 1e-6  # (the schedule did something)


def test_the_lambda_scheduler_takes_the_step_given_and_casts_the_intervals():
    p = KFACPreconditioner(small_net(), lr=0.05, factor_update_steps=3, inv_update_steps=9, **KFAC)
    scheduler = LambdaParamScheduler(
        p, factor_update_steps_lambda=lambda s: s / 2, inv_update_steps_lambda=lambda s: 1.4, lr_lambda=lambda s: 0.1
    )
    scheduler.step(2)
    assert (p.factor_update_steps, p.inv_update_steps) == (3, 12)  # int(3 * 1.0), int(9 * 1.4)
    assert p.lr == pytest.approx(0.005)


def test_the_lambda_scheduler_refuses_what_it_cannot_scale():
    scheduled = KFACPreconditioner(
        small_net(), lr=lambda s: 0.1, damping=lambda s: 0.01, **{k: v for k, v in KFAC.items() if k != "damping"}
    )
    for argument in ("damping_lambda", "lr_lambda"):
        with pytest.raises(ValueError, match="already a function of the step"):
            LambdaParamScheduler(scheduled, **{argument: lambda s: 1.0})
    model = small_net()
    attached = KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **KFAC)  # (its rates)
    with pytest.raises(ValueError, match="follows the attached optimizer's learning rates"):
        LambdaParamScheduler(attached, lr_lambda=lambda s: 0.5)
    with pytest.raises(ValueError, match="lr follows the attached optimizer's learning rates"):
        attached.lr = 0.05
    assert attached.lr == 0.1
    with pytest.raises(ValueError, match="the KL clip, which is off"):
        LambdaParamScheduler(KFACPreconditioner(small_net(), **dict(KFAC, kl_clip=None)), kl_clip_lambda=lambda s: 1.0)
    with pytest.raises(TypeError, match="must be a KFACPreconditioner"):
        LambdaParamScheduler(torch.optim.SGD(small_net().parameters(), lr=0.1), damping_lambda=lambda s: 1.0)  # type: ignore[arg-type]
    p = KFACPreconditioner(small_net(), **KFAC)
    with pytest.raises(TypeError, match="returned 'x' at step 0, not a number"):
        LambdaParamScheduler(p, damping_lambda=lambda s: "x").step()  # type: ignore[arg-type,return-value]


def _kaisa_script(import_line: Any, enums: bool, steps: int = 6) -> list[torch.Tensor]:
    """A training loop written for KAISA's ``kfac`` package, its options as KAISA's examples pass them, with
    ``import_line`` the module that ``import kfac`` gave (``enums``: KAISA's enum members, else their names)."""
    torch.manual_seed(0)
    model = small_net().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preconditioner = import_line.preconditioner.KFACPreconditioner(
            model,
            factor_update_steps=1,
            inv_update_steps=2,
            damping=0.01,
            factor_decay=0.95,
            kl_clip=0.01,
            lr=lambda x: optimizer.param_groups[0]["lr"],
            accumulation_steps=1,
            allreduce_bucket_cap_mb=25,
            colocate_factors=True,
            compute_method=kfac.enums.ComputeMethod.INVERSE if enums else "inverse",
            grad_worker_fraction=kfac.enums.DistributedStrategy.COMM_OPT if enums else 1.0,
            assignment_strategy=kfac.enums.AssignmentStrategy.COMPUTE if enums else "compute",
            grad_scaler=None,
            skip_layers=[],
            loglevel=logging.INFO,
            backend="single",
        )
    scheduler = import_line.scheduler.LambdaParamScheduler(preconditioner, damping_lambda=lambda s: 0.5 if s == 3 else 1.0)
    _loop(model, preconditioner, optimizer, range(steps), scheduler)
    assert preconditioner.kfac.config.compute_method == "inverse"
    return [p.detach().clone() for p in model.parameters()]


class _Spdkfac:
    """The same script with this project's own names (``spdkfac.KFACPreconditioner``, ``spdkfac.LambdaParamScheduler``)."""

    class preconditioner:  # noqa: N801  (a module's name, as the script reads it)
        KFACPreconditioner = KFACPreconditioner

    class scheduler:  # noqa: N801
        LambdaParamScheduler = LambdaParamScheduler


def test_a_kaisa_script_runs_with_its_import_changed():
    """``import spdkfac.kaisa as kfac`` for ``import kfac``: KAISA's paths, enums and scheduler, bitwise the run with
    this project's names and the enums' names."""
    assert kfac.preconditioner.KFACPreconditioner is KFACPreconditioner
    kaisa = _kaisa_script(kfac, enums=True)
    ours = _kaisa_script(_Spdkfac, enums=False)
    for a, b in zip(kaisa, ours):
        assert torch.equal(a, b)


def test_kaisas_checkpoint_arguments_are_taken_and_resume_bitwise():
    """``state_dict(include_factors=False)`` (said once: the factors are kept) and ``load_state_dict(...,
    compute_inverses=False)``, as KAISA scripts call them: the resumed run is the uninterrupted one, bitwise."""

    def build(model: nn.Module) -> tuple[KFACPreconditioner, torch.optim.Optimizer]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return KFACPreconditioner(model, lr=0.05, factor_update_steps=1, inv_update_steps=3, **KFAC), optimizer

    torch.manual_seed(0)
    model = small_net().double()
    preconditioner, optimizer = build(model)
    _loop(model, preconditioner, optimizer, range(4))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        saved = copy.deepcopy((preconditioner.state_dict(include_factors=False), optimizer.state_dict(), model.state_dict()))
        preconditioner.state_dict(include_factors=False)
    assert len([w for w in said if "the factors are kept" in str(w.message)]) == 1  # (said once)
    _loop(model, preconditioner, optimizer, range(4, 8))
    resumed_model = small_net().double()
    resumed_model.load_state_dict(saved[2])
    resumed, resumed_optimizer = build(resumed_model)
    resumed.load_state_dict(saved[0], compute_inverses=False)
    resumed_optimizer.load_state_dict(saved[1])
    _loop(resumed_model, resumed, resumed_optimizer, range(4, 8))
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
