"""Each term of the update-fusion cost model on crafted kernels, and the kernel counting it rests on."""

import pytest
import torch
import torch.nn as nn

from spdkfac.simulate.kernel_trace import Kernel, StepTrace, trace_kernels, trace_training_step
from spdkfac.simulate.update_fusion_cost import (
    ELEMENT_BYTES,
    RECIPES,
    Device,
    Recipe,
    iteration_kernels,
    iteration_seconds,
    predicted_gains,
    stream_seconds,
)

GPU = Device("gpu", bandwidth=1e12, flop_rate=1e13, launch_s=5e-6, asynchronous=True, cache_bytes=2**20)
CPU = Device("cpu", bandwidth=1e10, flop_rate=1e11, launch_s=2e-6, asynchronous=False, cache_bytes=2**20)
FREE = Recipe("free", lambda n: [Kernel("u"), Kernel("u")], lambda sizes: [], lambda n: [])


def _device(base: Device, **changes) -> Device:
    fields = {**base.__dict__, **changes}
    return Device(**fields)


CONV = Kernel("conv", flops=1e9, bytes=1e7)


def _trace(params=(1000, 200_000, 5), big=CONV) -> StepTrace:
    """Three layers, each one long forward and one long backward kernel; parameter i belongs to layer i."""
    n = len(params)
    return StepTrace(
        forward=[big] * n,
        backward=[big] * n,
        params=list(params),
        forward_slots={i: [i] for i in range(n)},
        backward_slots={i: [n - 1 - i] for i in range(n)},
    )


# ----------------------------------------------------------------- kernels and the stream


def test_a_kernel_is_bound_by_its_arithmetic_or_its_traffic():
    assert GPU.kernel_seconds(Kernel("k", flops=1e13, bytes=1.0)) == pytest.approx(1.0)
    assert GPU.kernel_seconds(Kernel("k", flops=1.0, bytes=1e12)) == pytest.approx(1.0)


def test_doubling_the_bandwidth_halves_the_update_term():
    kernels = [k for n in (1000, 50_000, 3_000_000) for k in RECIPES["seed"].update(n)]
    for base in (CPU, GPU):
        slow, fast = _device(base, launch_s=0.0), _device(base, launch_s=0.0, bandwidth=2 * base.bandwidth)
        assert stream_seconds(kernels, fast) == pytest.approx(stream_seconds(kernels, slow) / 2, rel=1e-12)


def test_a_synchronous_device_pays_every_launch_and_every_kernel():
    kernels = [Kernel("k", bytes=1e6)] * 7
    assert stream_seconds(kernels, CPU) == pytest.approx(7 * (CPU.launch_s + 1e6 / CPU.bandwidth))


def test_an_asynchronous_device_hides_launches_behind_long_kernels_until_a_sync():
    long = Kernel("long", bytes=1e9)  # 1 ms on GPU
    tiny = [Kernel("tiny")] * 100  # 100 launches: 0.5 ms of host time
    d = GPU.kernel_seconds(long)
    assert stream_seconds([long, *tiny], GPU) == pytest.approx(GPU.launch_s + d)  # issued while the long one runs
    assert stream_seconds([long, Kernel("read", sync=True), *tiny], GPU) == pytest.approx(GPU.launch_s + d + 100 * GPU.launch_s)
    assert stream_seconds(tiny, GPU) == pytest.approx(100 * GPU.launch_s)  # nothing to hide behind: host-bound


# ----------------------------------------------------------------- the three placements


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("sync_after", ["backward", "step"])
def test_no_launch_cost_and_no_update_traffic_predicts_no_gain(device, sync_after):
    free = _device(device, launch_s=0.0, cache_bytes=0.0)
    gains = predicted_gains(_trace(), FREE, free, sync_after)
    assert gains["forward"] == 1.0
    assert gains["backward"] == 1.0


def test_without_a_cache_fusion_only_moves_work_on_a_synchronous_device():
    no_cache = _device(CPU, cache_bytes=0.0)
    gains = predicted_gains(_trace(), RECIPES["seed"], no_cache)
    assert gains["forward"] == pytest.approx(1.0, rel=1e-12)
    assert gains["backward"] == pytest.approx(1.0, rel=1e-12)


def test_the_cache_saves_one_read_of_each_parameter_that_fits():
    trace = _trace(params=(1000, 2**20, 5), big=Kernel("bn", bytes=1e7))  # the 4 MiB one does not fit in 1 MiB
    t = {m: iteration_seconds(trace, m, RECIPES["seed"], CPU) for m in ("none", "forward", "backward")}
    saved = ELEMENT_BYTES * (1000 + 5) / CPU.bandwidth
    assert t["none"] - t["forward"] == pytest.approx(saved, rel=1e-9)
    assert t["none"] - t["backward"] == pytest.approx(saved, rel=1e-9)  # the gradient's read instead of the parameter's
    compute_bound = _trace(params=(1000, 2**20, 5))  # a read saved from a kernel bound by its arithmetic saves nothing
    assert iteration_seconds(compute_bound, "forward", RECIPES["seed"], CPU) == iteration_seconds(
        compute_bound, "none", RECIPES["seed"], CPU
    )


def test_forward_fusion_hides_the_update_launches_that_the_unfused_step_exposes_after_a_sync():
    k_per_update = len(RECIPES["seed"].update(1))
    trace = _trace(params=(1, 1, 1))
    gpu = _device(GPU, cache_bytes=0.0)
    t_none = iteration_seconds(trace, "none", FREE, gpu)
    t_forward = iteration_seconds(trace, "forward", FREE, gpu)
    # FREE: 2 kernels per parameter, none hidden unfused; fused, all but the first layer's (nothing runs before it yet).
    assert t_none - t_forward == pytest.approx((3 - 1) * 2 * gpu.launch_s)
    assert k_per_update == 4
    # With the loop's sync after step(), the unfused update hides behind backward's queue: forward fusion only
    # exposes the first layer's update, which nothing runs before.
    t_none, t_forward = (iteration_seconds(trace, m, FREE, gpu, "step") for m in ("none", "forward"))
    assert t_forward - t_none == pytest.approx(2 * gpu.launch_s)


def test_backward_fusion_adds_the_updates_device_time_but_no_launches():
    """One in-order stream: the fused updates' kernels still take their device time; their launches hide behind backward's."""
    trace = _trace(params=(1000, 200_000, 5))
    gpu = _device(GPU, cache_bytes=0.0)
    update = RECIPES["seed"]
    device_time = sum(gpu.kernel_seconds(k) for n in trace.params for k in update.update(n))
    t_forward_backward = stream_seconds([*trace.forward, *trace.backward], gpu)
    assert iteration_seconds(trace, "backward", update, gpu) == pytest.approx(t_forward_backward + device_time, rel=1e-12)
    # Unfused, after the loop's sync: every update kernel is shorter than a launch, so the host sets the pace.
    unfused_launches = len(trace.params) * len(update.update(1)) * gpu.launch_s
    last = gpu.kernel_seconds(update.update(trace.params[-1])[-1])
    assert iteration_seconds(trace, "none", update, gpu) == pytest.approx(t_forward_backward + unfused_launches + last, rel=1e-12)


def test_backward_fusion_is_never_worse_than_forward_for_the_update_alone():
    """The seed recipe: the same kernels, moved; backward's are issued behind work already queued."""
    for params in [(1000, 200_000, 5), (5, 5, 5), (3_000_000, 10, 10)]:
        for device in (CPU, GPU, _device(GPU, launch_s=50e-6)):
            g = predicted_gains(_trace(params), RECIPES["seed"], device)
            assert g["backward"] >= g["forward"] - 1e-12


def test_the_optimizers_backward_fusion_pays_its_checks_and_rollback_copies():
    trace = _trace()
    seed, ours = predicted_gains(trace, RECIPES["seed"], GPU), predicted_gains(trace, RECIPES["spdkfac"], GPU)
    assert ours["backward_s"] > seed["backward_s"]
    kernels = iteration_kernels(trace, "backward", RECIPES["spdkfac"], GPU)
    assert sum(k.sync for k in kernels) == 2  # one check at the end of backward (not one per layer), the loss read
    checks = next(i for i, k in enumerate(kernels) if k.sync)
    assert checks > max(i for i, k in enumerate(kernels) if k.name == "conv")  # after every backward kernel
    assert sum(k.sync for k in iteration_kernels(trace, "none", RECIPES["spdkfac"], GPU)) == 2  # one check, the loss read


# ----------------------------------------------------------------- counting kernels


def test_the_sgd_update_is_four_kernels_moving_eleven_tensors():
    kernels = RECIPES["seed"].update(1000)
    assert [k.name for k in kernels] == ["add", "mul_", "add_", "add_"]
    assert sum(k.bytes for k in kernels) == 11 * ELEMENT_BYTES * 1000  # grad+wd*p: 3, buf*=m: 2, buf+=d: 3, p-=lr*buf: 3


def test_a_read_back_is_a_sync_and_views_are_not_kernels():
    x = torch.empty(10, 10, device="meta")
    kernels = trace_kernels(lambda: (x.t().t().view(100).sum().item(), x.detach()))
    assert [(k.name, k.sync) for k in kernels] == [("sum", False), ("_local_scalar_dense", True)]


def test_a_step_is_counted_with_every_parameters_fusion_points():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    trace = trace_training_step(model, (2, 3, 4, 4))
    n = len(trace.params)
    assert sorted(i for ps in trace.forward_slots.values() for i in ps) == list(range(n))
    assert sorted(i for ps in trace.backward_slots.values() for i in ps) == list(range(n))
    assert trace.forward[min(trace.forward_slots)].name == "convolution"  # the conv's update goes just before it
    conv_fwd = 2 * 2 * 8 * 4 * 4 * 3 * 3 * 3
    linear_fwd = 2 * 2 * 128 * 10
    assert sum(k.flops for k in trace.forward) == conv_fwd + linear_fwd
    # Backward: the input gradient of the first conv is not needed.
    assert sum(k.flops for k in trace.backward) == conv_fwd + 2 * linear_fwd


def test_a_depthwise_convolutions_backward_counts_twice_its_forward():
    conv = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False, device="meta")
    x = torch.empty(2, 16, 8, 8, device="meta", requires_grad=True)
    kernels = trace_kernels(lambda: conv(x).sum().backward())
    fwd = next(k.flops for k in kernels if k.name == "convolution")
    bwd = next(k.flops for k in kernels if k.name == "convolution_backward")
    assert fwd == 2 * 2 * 16 * 8 * 8 * 9
    assert bwd == 2 * fwd
