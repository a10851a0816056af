"""Data-parallel wrappers: a DDP model is unwrapped (the bare model's names), the others are refused with the fix.

DDP needs a process group: these tests run in a one-process gloo group (a
file store under the test's temporary folder), with the optimizer on the
``'single'`` backend; the 2-worker numbers are in
``tests/multiprocess/test_ddp_multiprocess.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from nets import batch, fully_sharded, small_net
from torch.nn.parallel import DistributedDataParallel

from spdkfac import SPDKFACOptimizer
from spdkfac.step.data_parallel import ModelWrapping

warnings.filterwarnings("ignore", message="no perf_model given")


def _backward(model: nn.Module) -> None:
    x, y = batch(4)
    nn.functional.cross_entropy(model(x), y).backward()


def test_ddp_model_is_preconditioned_under_the_bare_models_names(process_group):
    net = small_net()
    opt = SPDKFACOptimizer(DistributedDataParallel(net), lr=0.1, backend="single")
    bare = SPDKFACOptimizer(small_net(), lr=0.1, backend="single")
    assert opt.model is net
    assert [layer.name for layer in opt.layers] == [layer.name for layer in bare.layers] == ["0", "2", "4", "6"]
    assert set(opt.param_names.values()) == set(bare.param_names.values())
    assert opt.state_dict()["kfac"]["layers"].keys() == bare.state_dict()["kfac"]["layers"].keys()


def test_last_pass_inside_no_sync_is_refused_at_step(process_group):
    model = DistributedDataParallel(small_net())
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    with model.no_sync():
        _backward(model)
    with pytest.raises(RuntimeError, match=r"no_sync\(\).*outside no_sync\(\)"):
        opt.step()
    opt.zero_grad()
    _backward(model)  # outside no_sync: DDP averages, step() goes on
    opt.step()
    assert opt.steps == 1


def _steps(model: nn.Module, opt: SPDKFACOptimizer) -> list[torch.Tensor]:
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_ddp_wrapped_around_the_model_after_the_optimizer_is_adopted(process_group):
    """accelerate's ``prepare()`` (Hugging Face's Trainer) wraps the model after the optimizer is built on it: at the
    first forward pass the optimizer finds the DDP and lets it average, as if it had been given the wrapper."""
    given = DistributedDataParallel(small_net())
    want = _steps(given, SPDKFACOptimizer(given, lr=0.1, backend="single"))
    net = small_net()
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
    model = DistributedDataParallel(net)
    with torch.no_grad():
        model(batch(4)[0])  # a check before training, through the DDP: adopted here
    assert opt.wrapping.ddp is model
    assert opt.kfac_step.grads.wrapping.averages_gradients
    got = _steps(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    model.zero_grad()
    with model.no_sync():
        _backward(model)
    with pytest.raises(RuntimeError, match=r"no_sync\(\).*outside no_sync\(\)"):  # no_sync() is watched as with the wrapper
        opt.step()


def test_a_ddp_the_optimizer_cannot_adopt_is_refused_at_the_first_forward(process_group):
    """A DDP around a larger model than the optimizer's, and backward update fusion (which needs the gradients
    before DDP averages them), are refused at the first forward pass."""
    net = small_net()
    _opt = SPDKFACOptimizer(net, lr=0.1, backend="single")  # kept: the model holds its hooks weakly
    with pytest.raises(RuntimeError, match=r"a part of the model DDP wraps.*pass the wrapper, SPDKFACOptimizer\(ddp_model"):
        _backward(DistributedDataParallel(nn.Sequential(net, nn.Tanh())))
    net = small_net()
    _opt = SPDKFACOptimizer(net, lr=0.1, kl_clip=None, update_fusion="backward", backend="single")
    with pytest.raises(ValueError, match="before DDP has averaged it; use update_fusion='forward'"):
        _backward(DistributedDataParallel(net))


def test_bare_model_check_runs_once_and_leaves_no_hook():
    net = small_net()
    _opt = SPDKFACOptimizer(net, lr=0.1, backend="single")  # kept: the model holds its hooks weakly
    assert len(net._forward_pre_hooks) == 1
    _backward(net)
    assert len(net._forward_pre_hooks) == 0


def test_backward_update_fusion_is_refused_with_ddp(process_group):
    net = small_net()
    model = DistributedDataParallel(net)
    with pytest.raises(ValueError, match="before DDP has averaged it; use update_fusion='forward'"):
        SPDKFACOptimizer(model, lr=0.1, kl_clip=None, update_fusion="backward", backend="single")
    assert not model._forward_pre_hooks
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_a_refused_construction_leaves_no_hook_on_the_bare_model():
    net = small_net()
    with pytest.raises(ValueError, match="lr"):
        SPDKFACOptimizer(net, lr=-1.0, backend="single")
    assert not net._forward_pre_hooks  # a later DDP(net) runs without a stale check


def test_ddp_over_other_processes_than_the_backend_is_refused(process_group):
    wrapping = ModelWrapping(DistributedDataParallel(small_net()))
    wrapping.check(1, "none")
    with pytest.raises(ValueError, match="over 1 processes but the optimizer's backend has 2 workers"):
        wrapping.check(2, "none")


def test_ddp_inside_the_model_is_refused(process_group):
    model = nn.Sequential(DistributedDataParallel(small_net()))
    with pytest.raises(ValueError, match=r"submodule '0' is a DistributedDataParallel inside the model: wrap the whole model"):
        SPDKFACOptimizer(model, lr=0.1, backend="single")


def test_data_parallel_is_refused():
    with pytest.raises(ValueError, match=r"nn\.DataParallel.*one process per GPU"):
        SPDKFACOptimizer(nn.DataParallel(small_net()), lr=0.1, backend="single")


def test_the_first_fsdp_is_refused(process_group):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    try:
        model = fsdp.FullyShardedDataParallel(small_net(), device_id=torch.device("cpu"))
    except Exception as exc:  # an FSDP that cannot run on this build's CPU: the check by type is all there is to test
        pytest.skip(f"FSDP does not wrap on this CPU build: {exc}")
    with pytest.raises(ValueError, match=r"the first FSDP \(FullyShardedDataParallel\).*fully_shard\(\) instead"):
        SPDKFACOptimizer(model, lr=0.1, backend="single")


def _fully_shard() -> Any:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no FSDP2 (fully_shard) in this torch")
    return fsdp.fully_shard


def _sharded(model: nn.Module) -> nn.Module:
    """``model`` sharded by ``fully_shard`` as FSDP2's examples do (:func:`nets.fully_sharded`); skipped without it."""
    _fully_shard()
    return fully_sharded(model)


@pytest.mark.parametrize("options", [{}, {"compute_method": "eigen"}, {"base": "adamw", "momentum": None}])
def test_a_fully_sharded_model_equals_the_bare_model(process_group, options):
    """FSDP2 on a one-worker mesh: every parameter a DTensor, its gradient read whole through a stand-in and written
    back (:mod:`spdkfac.kfac.sharded_grads`); the parameters are the bare model's, bitwise, step after step."""
    sharded, bare = _sharded(small_net()), small_net()
    options = {k: v for k, v in options.items() if v is not None} | {"factor_update_freq": 2, "inv_update_freq": 2}
    opts = [SPDKFACOptimizer(m, lr=0.05, damping=0.01, backend="single", **options) for m in (sharded, bare)]
    assert opts[0].wrapping.sharded_over == 1
    assert opts[0].wrapping.averages_gradients
    for step in range(4):
        x, y = batch(4)
        for model, opt in zip((sharded, bare), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * step), y).backward()
            opt.step()
        for (name, p), q in zip(sharded.named_parameters(), bare.parameters()):
            assert type(p).__name__ == "DTensor"
            assert torch.equal(p.full_tensor(), q), f"step {step}: {name}"
    assert [layer.name for layer in opts[0].layers] == [layer.name for layer in opts[1].layers]
    assert opts[0].kfac_summary() == opts[1].kfac_summary()  # (the layers' own classes, not FSDP's FSDPLinear)


def test_fully_shard_on_a_part_only_is_refused(process_group):
    model = small_net()
    _fully_shard()(model[0])
    with pytest.raises(ValueError, match=r"submodule '0' is sharded by fully_shard\(\) but the model's root module is not"):
        SPDKFACOptimizer(model, lr=0.1, backend="single")


def test_update_fusion_is_refused_on_a_fully_sharded_model(process_group):
    with pytest.raises(ValueError, match=r"update_fusion='forward' cannot be used with a model sharded by fully_shard"):
        SPDKFACOptimizer(_sharded(small_net()), lr=0.1, kl_clip=None, update_fusion="forward", backend="single")


def test_a_grad_scaler_of_each_shard_alone_is_refused_on_a_fully_sharded_model(process_group):
    """A GradScaler looks for an overflow in each worker's shard alone: FSDP's ShardedGradScaler agrees first."""
    wrapping = ModelWrapping(_sharded(small_net()))
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"GradScaler on a model sharded by fully_shard\(\).*use .*ShardedGradScaler"):
        wrapping.check_scaler(scaler, workers=2)
    wrapping.check_scaler(scaler, workers=1)  # (one worker holds every row)
    sharded = pytest.importorskip("torch.distributed.fsdp.sharded_grad_scaler").ShardedGradScaler("cpu")
    wrapping.check_scaler(sharded, workers=2)
    ModelWrapping(small_net()).check_scaler(scaler, workers=2)  # (a model not sharded: the gradients are whole)


def test_tensor_parallel_parameters_are_refused(process_group):
    """Tensor parallelism's DTensor weights: refused by name at construction (before, an error deep in the first
    factor step: 'got mixed torch.Tensor and DTensor')."""
    parallel = pytest.importorskip("torch.distributed.tensor.parallel")
    mesh = pytest.importorskip("torch.distributed.device_mesh").init_device_mesh("cpu", (1,))
    model = small_net()
    first = next(name for name, module in model.named_modules() if isinstance(module, nn.Linear))
    parallel.parallelize_module(model, mesh, {first: parallel.ColwiseParallel()})
    with pytest.raises(ValueError, match=rf"parameter '{first}.weight' is a DTensor placed .*not tensor or sequence parallelism"):
        SPDKFACOptimizer(model, lr=0.1, backend="single")


def test_horovod_distributed_optimizer_wrapping_is_refused():
    hvd = pytest.importorskip("horovod.torch")
    net = small_net()
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
    with pytest.raises(TypeError, match=r"must not be wrapped in hvd\.DistributedOptimizer"):
        hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())


def test_a_non_module_is_still_a_type_error():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        SPDKFACOptimizer([nn.Parameter(torch.zeros(2))], lr=0.1, backend="single")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile(DDP)", "DDP(compile)"])
def test_a_compiled_ddp_wrapped_later_is_adopted_as_if_given(process_group, order):
    """Under ``torch.compile`` the adoption is one graph break at the first pass; the steps are those of the optimizer
    given the same compiled wrapper (to float32 rounding: the graph traced again after the break may fuse otherwise)."""
    results = []
    for given in (True, False):
        net = small_net()
        model = torch.compile(DistributedDataParallel(net)) if order == "compile(DDP)" else DistributedDataParallel(torch.compile(net))
        opt = SPDKFACOptimizer(model if given else net, lr=0.1, backend="single")
        results.append(_steps(model, opt))
        assert opt.wrapping.ddp is not None
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
