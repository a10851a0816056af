"""Bad input gets a clear error naming the problem."""

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import NonFiniteFactorError, SPDKFACOptimizer
from spdkfac.kfac.methods import DecompositionFallbackWarning


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=-0.1), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, weight_decay=-1), "weight_decay"),
        (dict(lr=0.1, damping=0.0), "damping"),
        (dict(lr=0.1, factor_decay=1.0), "factor_decay"),
        (dict(lr=0.1, kl_clip=0.0), "kl_clip"),
        (dict(lr=0.1, factor_update_freq=0), "factor_update_freq"),
        (dict(lr=0.1, inv_update_freq=1.5), "inv_update_freq"),
        (dict(lr=0.1, factor_update_freq=2, inv_update_freq=3), "multiple of factor_update_freq"),
        (dict(lr=0.1, fusion="fastest"), "fusion"),
        (dict(lr=0.1, placement="random"), "placement"),
        (dict(lr=0.1, distribute_preconditioning="yes"), "distribute_preconditioning"),
        (dict(lr=0.1, backend="mpi"), "backend"),
        (dict(lr=0.1, fusion_threshold_bytes=0), "fusion_threshold_bytes"),
        (dict(lr=0.1, skip_nonfinite=-1), "skip_nonfinite must be a non-negative integer"),
        (dict(lr=0.1, compute_method="cholesky"), "compute_method"),
        (dict(lr=0.1, accumulation_steps=0), "accumulation_steps"),
        (dict(lr=0.1, perf_model="/nonexistent/model.json"), "does not exist"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SPDKFACOptimizer(small_net(), backend=kwargs.pop("backend", "single"), **kwargs)


def test_lr_type_error():
    with pytest.raises(TypeError, match="lr"):
        SPDKFACOptimizer(small_net(), lr="0.1", backend="single")


def test_model_without_supported_layers():
    with pytest.raises(ValueError, match="no layer SPDKFACOptimizer can precondition"):
        SPDKFACOptimizer(nn.Sequential(nn.LayerNorm(4), nn.Embedding(4, 4, sparse=True)), lr=0.1, backend="single")


def test_not_a_module():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str$"):
        SPDKFACOptimizer("resnet50", lr=0.1, backend="single")


@pytest.mark.parametrize("given", ["list", "generator", "groups"])
def test_parameters_instead_of_the_model_says_so(given):
    """``torch.optim``'s habit, ``SPDKFACOptimizer(model.parameters(), ...)``: the error says to pass the model."""
    model = nn.Linear(2, 2)
    params = {"list": list(model.parameters()), "generator": model.parameters(), "groups": [{"params": model.parameters()}]}
    with pytest.raises(TypeError, match=r"pass the model itself, not model.parameters\(\)"):
        SPDKFACOptimizer(params[given], lr=0.1, backend="single")


def test_non_finite_factor_reports_layer_and_keeps_state():
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single")
    x, y = batch(8)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    saved_a = opt.layers[0].A.clone()
    saved_params = copy.deepcopy(model.state_dict())
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    nn.functional.cross_entropy(model(bad), y).backward()
    with pytest.raises(NonFiniteFactorError, match=r"A of '0'") as info:
        opt.step()
    assert ("A", "0") in info.value.layers
    assert torch.equal(opt.layers[0].A, saved_a)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved_params[k])
    # The optimizer is usable again on good data.
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.steps == 2


def test_rank_deficient_factor_error_names_a_damping_that_works():
    """One sample gives rank-1 factors: a damping below float32 rounding fails, one above what the error names works.

    (factor_decay=0 makes the running average that batch factor; with the default decay the identity it starts
    from keeps it full rank.) The inverse method's fallback then inverts the factor and the warning explains;
    as an error, it is the message the job used to end with.
    """
    torch.manual_seed(0)

    def first_step(damping: float) -> None:
        model = nn.Sequential(nn.Linear(16, 8))
        opt = SPDKFACOptimizer(model, lr=0.1, damping=damping, factor_decay=0.0, backend="single")
        model(torch.randn(1, 16) * 100).sum().backward()
        opt.step()

    with pytest.warns(DecompositionFallbackWarning, match=r"factor A of layer '0' \(dimension 17.*lower rank") as info:
        first_step(1e-12)
    message = next(str(w.message) for w in info if w.category is DecompositionFallbackWarning)
    enough = float(re.search(r"rounding at this scale is about ([0-9.e+-]+)", message).group(1))
    assert enough > 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("error", DecompositionFallbackWarning)
        first_step(100 * enough)
        with pytest.raises(DecompositionFallbackWarning, match="eigenvalues"):
            first_step(1e-12)


def test_checkpoint_from_different_model_is_rejected():
    a = SPDKFACOptimizer(small_net(), lr=0.1, backend="single")
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = SPDKFACOptimizer(other, lr=0.1, backend="single")
    with pytest.raises(ValueError, match="different model"):
        b.load_state_dict(a.state_dict())
    wider = small_net()
    wider[4] = nn.Linear(36, 9)
    wider[6] = nn.Linear(9, 5, bias=False)
    c = SPDKFACOptimizer(wider, lr=0.1, backend="single")
    with pytest.raises(ValueError, match=r"different factor dimensions \['4', '6'\]"):
        c.load_state_dict(a.state_dict())


def test_plain_sgd_state_dict_is_rejected():
    model = small_net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    with pytest.raises(ValueError, match="not an SPDKFACOptimizer checkpoint"):
        opt.load_state_dict(sgd.state_dict())


def test_step_without_backward_is_an_error():
    opt = SPDKFACOptimizer(small_net(), lr=0.1, backend="single")
    with pytest.raises(RuntimeError, match="no Kronecker factor was computed"):
        opt.step()


def test_a_fresh_optimizer_stepped_with_zero_gradients_set_by_hand_changes_nothing():
    """What Horovod's broadcast_optimizer_state does to a new optimizer (tests/multiprocess/test_horovod_idioms.py runs
    the real one): no state, no step counted, no parameter moved; after a real step the same call is refused."""
    model = small_net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = SPDKFACOptimizer(model, lr=0.1, weight_decay=0.1, backend="single")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.steps == 0
    assert not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    x = torch.randn(4, 2, 6, 6)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert opt.steps == 1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="no Kronecker factor was computed"):
        opt.step()


def test_weight_sharing_is_one_layer_counted_per_use():
    """A module registered twice, or called twice in one forward pass, is one layer (tests/unit/step/test_shared_layers.py
    checks its factors); a second forward/backward pass without step() is still refused."""
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    assert [layer.name for layer in opt.layers] == ["0"]
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.step()
    assert opt.kfac_step.factors.expected[("A", "0")] == 2
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="with no step\\(\\) between, but accumulation_steps is 1"):
        model(x).sum().backward()
    assert opt.steps == 1


def test_non_factor_steps_do_no_factor_work():
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, factor_update_freq=3, inv_update_freq=3, backend="single")
    x, y = batch(8)
    for step in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        computed = opt.kfac_step.factors.arrived["A"] + opt.kfac_step.factors.arrived["G"]
        assert (len(computed) == 2 * len(opt.layers)) == (step % 3 == 0), step
        before = opt.layers[0].A.clone() if opt.layers[0].A is not None else None
        opt.step()
        if step % 3:
            assert torch.equal(opt.layers[0].A, before)


def test_timeline_export_and_summary():
    import json

    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single", timeline=True, factor_update_freq=2, inv_update_freq=2)
    x, y = batch(8)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    records = json.loads(opt.timeline.to_json())
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert len(records[0]["factors"]) == 2 * len(opt.layers)
    assert records[1]["factors"] == {}
    # one worker decomposes every factor itself, at the decomposition steps only, inside the stage's time
    assert set(records[0]["decompositions"]) == {f"{kind}.{layer.name}" for layer in opt.layers for kind in ("A", "G")}
    assert all(t >= 0 for t in records[0]["decompositions"].values())
    assert sum(records[0]["decompositions"].values()) <= records[0]["inverse_stage"]
    assert records[1]["decompositions"] == {}
    summary = opt.timeline.summary()
    assert summary["iterations"] == 4
    assert summary["factor_compute"] > 0
    assert summary["inverse_stage"] > 0
    assert summary["precondition_comm_nonoverlap"] == 0.0  # one worker: no preconditioned gradient is broadcast


@pytest.mark.parametrize("base", ["sgd", "adamw", "lamb"])
def test_a_fresh_optimizer_stepped_at_learning_rate_zero_gets_a_zero_state_that_changes_nothing(base):
    """What torch.distributed.checkpoint's get_state_dict does to a new optimizer, for a state to load a checkpoint
    into (tests/multiprocess/test_fsdp_multiprocess.py resumes through it): zero gradients, every learning rate 0,
    one step(). The base state is created as zeros, and training from it is bitwise training from no state."""
    x, y = torch.randn(4, 2, 6, 6), torch.randint(0, 5, (4,))
    options = dict(lr=0.1, weight_decay=0.1, base=base, backend="single", factor_update_freq=2, inv_update_freq=2)
    if base == "sgd":
        options["momentum"] = 0.9
    runs = []
    for template in (False, True):
        model = small_net()
        opt = SPDKFACOptimizer(model, **options)
        if template:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.param_groups[0]["lr"] = 0.1
            opt.zero_grad()
            assert opt.steps == 0
            keys = {"sgd": {"momentum_buffer"}}.get(base, {"step", "exp_avg", "exp_avg_sq"})
            assert [set(opt.state[p]) for p in model.parameters()] == [keys] * len(list(model.parameters()))
            assert all(not t.any() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        for s in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
