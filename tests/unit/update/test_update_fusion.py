"""Update fusion: the update in the next forward pass or in backward gives bitwise the unfused parameters.

On one process and on in-process ranks (threads, :mod:`spdkfac.comm.inprocess`);
the real engines are in ``tests/multiprocess/test_update_fusion_multiprocess.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, mixed_net, small_net, small_transformer, train

from spdkfac import NonFiniteError, SPDKFACOptimizer
from spdkfac.comm import run_ranks
from spdkfac.update.update_fusion import update_owners
from spdkfac.variants import variant_config

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=None, factor_update_freq=2, inv_update_freq=4)
KINDS = {"sgd": dict(precondition=False), "inverse": {}, "eigen": dict(compute_method="eigen")}
STEPS = 6


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no perf_model given")
        yield


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(model, opt, x, y, steps=STEPS, flush_each_step=False, accumulate=1, nan_grad_at=None):
    """The usual loop; returns the parameters after each step (after ``flush()`` where asked, else only the last)."""
    out = []
    for s in range(steps):
        opt.zero_grad()
        first = next(iter(model.parameters()))  # the first layer's weight: its gradient is the last to arrive
        hook = first.register_hook(lambda g: g * float("nan")) if s == nan_grad_at else None
        for xm, ym in zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate)):
            (nn.functional.cross_entropy(model(xm), ym) / accumulate).backward()
        if hook is not None:
            hook.remove()
        opt.step()
        if flush_each_step:
            opt.flush()
            out.append(_params(model))
    opt.flush()
    return out or [_params(model)]


def _assert_bitwise(ref: list[dict[str, torch.Tensor]], got: list[dict[str, torch.Tensor]]) -> None:
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"


def _run(kind, fusion, x, y, model=None, backend="single", **kw):
    model = model or small_net()
    opt = SPDKFACOptimizer(model, backend=backend, update_fusion=fusion, **{**KW, **KINDS[kind], **kw})
    return model, opt


@pytest.mark.parametrize(
    ("kind", "flush_each_step", "net"),
    # mixed_net: every layer type; small_transformer: q, k and v share in_proj_weight (one backward-fusion unit)
    [(kind, False, small_net) for kind in KINDS] + [("inverse", True, mixed_net), ("inverse", True, small_transformer)],
)
@pytest.mark.parametrize("fusion", ["forward", "backward"])
def test_fused_parameters_equal_unfused_bitwise(float64, kind, fusion, flush_each_step, net):
    """Without flush the forward pre-hooks apply the updates (compared at the end); with it, after every step."""
    x, y = batch(8)
    ref = _train(*_run(kind, "none", x, y, model=net()), x, y, flush_each_step=flush_each_step)
    model, opt = _run(kind, fusion, x, y, model=net())
    got = _train(model, opt, x, y, flush_each_step=flush_each_step)
    _assert_bitwise(ref, got)
    assert any(not torch.equal(ref[-1][k], v) for k, v in _params(net()).items())  # training moved them
    if fusion == "forward" and not flush_each_step:  # the pre-hooks applied the updates
        assert opt._forward_fusion.applied_in_forward > 0
    if fusion == "backward":  # every step that kept the decompositions was updated in backward
        assert opt._backward_fusion is not None
        assert opt._backward_fusion.fused_steps == (STEPS if kind == "sgd" else STEPS - 2)  # inverse steps 0 and 4


@pytest.mark.parametrize("fusion", ["forward", "backward"])
def test_ekfac_natural_update_fused_equals_unfused(float64, fusion):
    """EKFAC's scaling learns from every step's gradient, also on the steps backward fusion updates in
    ``backward()``: those must take the step's batch and commit the scaling as ``step()`` does."""
    x, y = batch(8)
    kw = dict(compute_method="ekfac", ekfac_update="natural", factor_update_freq=1, inv_update_freq=3)
    ref_model, ref_opt = _run("inverse", "none", x, y, **kw)
    ref = _train(ref_model, ref_opt, x, y, steps=8, flush_each_step=True)
    model, opt = _run("inverse", fusion, x, y, **kw)
    got = _train(model, opt, x, y, steps=8, flush_each_step=True)
    _assert_bitwise(ref, got)
    for a, b in zip(ref_opt.layers, opt.layers):  # the scaling itself (refreshed bases at steps 0, 3, 6)
        assert torch.equal(a.method_state.scale, b.method_state.scale), a.name
    if fusion == "backward":
        assert opt._backward_fusion is not None
        assert opt._backward_fusion.fused_steps == 5  # all but steps 0, 3, 6 (new bases)


@pytest.mark.slow
@pytest.mark.parametrize("fusion", ["forward", "backward"])
@pytest.mark.parametrize("extra", [dict(accumulation_steps=2), dict(factor_update_freq=1, inv_update_freq=3, pipelining=False)])
def test_fused_equals_unfused_with_accumulation_and_frequencies(float64, fusion, extra):
    x, y = batch(8)
    acc = extra.get("accumulation_steps", 1)
    ref = _train(*_run("inverse", "none", x, y, **extra), x, y, flush_each_step=True, accumulate=acc)
    got = _train(*_run("inverse", fusion, x, y, **extra), x, y, flush_each_step=True, accumulate=acc)
    _assert_bitwise(ref, got)


@pytest.mark.slow
def test_forward_fusion_with_kl_clip_schedules_and_clipping(float64):
    """Forward fusion keeps everything global: KL clip, scheduled damping, clipping after synchronize()."""
    x, y = batch(8)
    kw = dict(kl_clip=0.01, damping=lambda s: 0.02 / (1 + s))

    def loop(fusion):
        model, opt = _run("inverse", fusion, x, y, **kw)
        for s in range(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        return _params(model) if fusion == "none" else (opt.flush(), _params(model))[1]

    _assert_bitwise([loop("none")], [loop("forward")])


def test_forward_fusion_under_a_grad_scaler_that_skips_a_step(float64):
    """GradScaler loop (kl_clip on), a NaN at step 2 that the scaler skips: forward fusion equals the unfused run."""
    x, y = batch(8)
    poisoned = {2: torch.arange(8) == 7}

    def loop(fusion):
        model = small_net()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        opt = SPDKFACOptimizer(model, backend="single", update_fusion=fusion, grad_scaler=scaler, **{**KW, "kl_clip": 0.01})
        train(model, opt, x, y, STEPS, scaler=scaler, poisoned=poisoned)
        opt.flush()
        return _params(model), opt.steps

    (ref, ref_steps), (got, steps) = loop("none"), loop("forward")
    _assert_bitwise([ref], [got])
    assert steps == ref_steps == STEPS - 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "inverse"])
@pytest.mark.parametrize("fusion", ["forward", "backward"])
def test_in_process_ranks_equal_unfused_and_each_other(float64, kind, fusion):
    x, y = batch(8)

    def on_ranks(f):
        models = [small_net(), small_net()]  # built here: the ranks are threads sharing the global RNG

        def fn(b):
            r = b.rank
            model, opt = _run(kind, f, x, y, model=models[r], backend=b)
            return _train(model, opt, x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4], flush_each_step=True)

        return run_ranks(2, fn)

    ref, got = on_ranks("none"), on_ranks(fusion)
    for r in range(2):
        _assert_bitwise(ref[r], got[r])
    _assert_bitwise(got[0], got[1])  # bitwise replicas


# -- flush semantics -------------------------------------------------------------------------
def _one_step(fusion, model=None):
    x, y = batch(8)
    model, opt = _run("inverse", fusion, x, y, model=model)
    for s in range(2):  # step 1 keeps the decompositions
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()
    return model, opt


def test_forward_fusion_holds_the_update_until_the_next_forward(float64):
    ref, _ = _one_step("none")
    model, _ = _one_step("forward")
    raw = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert any(not torch.equal(raw[k], v) for k, v in _params(ref).items())  # held, not yet applied
    model.eval()
    with torch.no_grad():
        x, _ = batch(8)
        assert torch.equal(model(x), ref.eval()(x))  # the eval forward uses the updated parameters
    _assert_bitwise([_params(ref)], [_params(model)])


@pytest.mark.parametrize("read", ["model_state_dict", "optimizer_state_dict", "flush", "zero_grad_in_place"])
def test_every_read_of_the_state_applies_the_held_updates(float64, read):
    ref, ref_opt = _one_step("none")
    model, opt = _one_step("forward")
    if read == "model_state_dict":
        sd = model.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in _params(ref).items())
    elif read == "optimizer_state_dict":
        sd = opt.state_dict()
        ref_sd = ref_opt.state_dict()
        assert all(torch.equal(sd["state"][i]["momentum_buffer"], s["momentum_buffer"]) for i, s in ref_sd["state"].items())
    elif read == "flush":
        opt.flush()
    else:
        opt.zero_grad(set_to_none=False)
    assert not opt._forward_fusion.pending
    _assert_bitwise([_params(ref)], [dict(model.named_parameters())])


def test_updates_the_next_forward_does_not_reach_are_applied_by_the_next_step(float64):
    x, y = batch(8)
    ref, ref_opt = _run("sgd", "none", x, y)
    model, opt = _run("sgd", "forward", x, y)
    for m, o in ((ref, ref_opt), (model, opt)):
        _train_steps(m, o, x, y, range(2))
        o.zero_grad()
        m[0](x)  # a forward that reaches the first layer only
    assert len(opt._forward_fusion.pending) == len(list(model.parameters())) - 2
    opt.step()  # no gradient: this step only applies what was held
    assert not opt._forward_fusion.pending
    _assert_bitwise([_params(ref)], [dict(model.named_parameters())])


@pytest.mark.slow
def test_checkpoint_taken_mid_flight_resumes_bitwise(float64):
    x, y = batch(8)
    ref = _train(*_run("inverse", "none", x, y), x, y, steps=6)
    model, opt = _run("inverse", "forward", x, y)
    _train_steps(model, opt, x, y, range(3))
    assert opt._forward_fusion.pending
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}  # updates still held: the state_dicts apply them
    model2, opt2 = _run("inverse", "forward", x, y, model=small_net(seed=1))
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    _train_steps(model2, opt2, x, y, range(3, 6))
    opt2.flush()
    _assert_bitwise(ref, [_params(model2)])


def _train_steps(model, opt, x, y, steps):
    for s in steps:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()


def test_update_owners_cover_functional_submodules():
    """``nn.MultiheadAttention`` computes with ``out_proj.weight`` itself: its pre-hook applies that update."""
    model = small_transformer()
    owners = update_owners(model, list(model.parameters()))
    attn = model.encoder.layers[0].self_attn
    assert any(p is attn.out_proj.weight for p in owners[attn])
    assert attn.out_proj not in owners
    held = {id(p) for ps in owners.values() for p in ps}
    assert held == {id(p) for p in model.parameters()}


def test_forward_fusion_on_a_transformer_equals_unfused(float64):
    x, y = batch(8)

    def loop(fusion):
        model = small_transformer()
        opt = SPDKFACOptimizer(model, backend="single", update_fusion=fusion, **KW)
        _train_steps(model, opt, x, y, range(5))
        opt.flush()
        return _params(model)

    _assert_bitwise([loop("none")], [loop("forward")])


# -- non-finite steps under backward fusion ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "inverse"])
def test_backward_fusion_rolls_back_a_non_finite_step(float64, kind):
    """A NaN in an early layer's gradient is found after later layers were updated: they are restored bitwise."""
    x, y = batch(8)
    ref = _train(*_run(kind, "none", x, y, skip_nonfinite=1), x, y, flush_each_step=True, nan_grad_at=5)
    model, opt = _run(kind, "backward", x, y, skip_nonfinite=1)
    with pytest.warns(UserWarning, match="step skipped"):
        got = _train(model, opt, x, y, flush_each_step=True, nan_grad_at=5)
    _assert_bitwise(ref, got)
    assert opt.steps == STEPS - 1
    assert opt._backward_fusion.fused_steps == (STEPS - 1 if kind == "sgd" else STEPS - 3)


def test_backward_fusion_refuses_a_non_finite_step_with_nothing_changed(float64):
    x, y = batch(8)
    model, opt = _run("inverse", "backward", x, y)
    _train_steps(model, opt, x, y, range(2))
    before = _params(model)
    momentum = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    with pytest.raises(NonFiniteError, match="No parameter was changed"):
        _train(model, opt, x, y, steps=1, nan_grad_at=0)
    _assert_bitwise([before], [_params(model)])
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in momentum.items())


def test_zero_grad_without_step_rolls_back_a_backward_update(float64):
    x, y = batch(8)
    model, opt = _run("sgd", "backward", x, y)
    _train_steps(model, opt, x, y, range(2))
    before = _params(model)
    nn.functional.cross_entropy(model(x), y).backward()
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())  # updated in backward
    with pytest.raises(RuntimeError, match="between backward\\(\\) and step\\(\\)"):
        opt.state_dict()
    opt.zero_grad()  # the step is abandoned
    _assert_bitwise([before], [_params(model)])


# -- refused combinations ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(kl_clip=0.001), "needs kl_clip=None"),
        (dict(grad_scaler=torch.amp.GradScaler("cpu")), "grad_scaler"),
        (dict(distribute_preconditioning=True), "distribute_preconditioning"),
        (dict(grad_worker_fraction="auto"), "grad_worker_fraction < 1"),
    ],
)
def test_backward_fusion_refuses_what_needs_every_gradient(kw, match):
    with pytest.raises(ValueError, match=match):
        SPDKFACOptimizer(small_net(), **{**KW, "backend": "single", "update_fusion": "backward", **kw})


def test_backward_fusion_refuses_a_scheduled_kl_clip_and_synchronize(float64):
    x, y = batch(8)
    model, opt = _run("inverse", "backward", x, y, kl_clip=lambda s: None if s < 1 else 0.01)
    _train_steps(model, opt, x, y, range(1))
    with pytest.raises(ValueError, match="needs kl_clip=None"):
        _train_steps(model, opt, x, y, range(1, 2))
    model, opt = _run("sgd", "backward", x, y)
    with pytest.raises(RuntimeError, match="cannot be read or clipped"):
        opt.synchronize()


def test_bad_update_fusion_values_are_refused():
    with pytest.raises(ValueError, match="update_fusion must be one of"):
        SPDKFACOptimizer(small_net(), lr=0.1, backend="single", update_fusion="sideways")
    with pytest.raises(ValueError, match="update_fusion must be one of"):
        variant_config("sgd:update_fusion=sideways")
    assert variant_config("spdkfac:update_fusion=backward")["update_fusion"] == "backward"


# -- the training job's flag -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--optimizer", "spdkfac", "--update-fusion", "backward"], "needs --kl-clip 0"),
        (["--optimizer", "sgd", "--update-fusion", "backward", "--amp", "fp16"], "cannot be used with --amp fp16"),
        (["--optimizer", "dho2", "--update-fusion", "forward"], "applies to --optimizer sgd and the K-FAC"),
    ],
)
def test_training_job_refuses_unsupported_fusion_flags(flags, error, capsys):
    from spdkfac.train.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert error in capsys.readouterr().err


def test_training_job_passes_the_fusion_and_kl_clip_zero_as_none():
    from spdkfac.train.args import parse_args
    from spdkfac.train.optimizer_options import optimizer_options

    args = parse_args(["--optimizer", "spdkfac", "--update-fusion", "backward", "--kl-clip", "0"])
    options = optimizer_options("spdkfac", args)
    assert options["update_fusion"] == "backward"
    assert options["kl_clip"] is None
    assert optimizer_options("spdkfac", parse_args(["--optimizer", "spdkfac", "--kl-clip", "0.002"]))["kl_clip"] == 0.002


def test_backward_fusion_refuses_a_gradient_changed_after_backward(float64):
    """Clipping between ``backward()`` and ``step()`` would be lost on the steps updated in ``backward()`` (and kept on
    the others): such a step is refused, naming the fusions that clip. A loop that does not change them is not."""
    x, y = batch(8)

    def loop(clip: bool) -> SPDKFACOptimizer:
        model, opt = _run("inverse", "backward", x, y)
        for s in range(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
        return opt

    assert loop(clip=False)._backward_fusion.fused_steps == STEPS - 2
    with pytest.raises(RuntimeError, match=r"changed \(clipped.*update_fusion='backward'.*'forward' or 'none'"):
        loop(clip=True)
