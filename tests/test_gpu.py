"""The CUDA paths against the CPU: ``pytest -m gpu`` (``scripts/gpu_check.sh`` runs them on a GPU).

The device is ``SPDKFAC_TEST_DEVICE`` (default ``cuda``); without CUDA these
tests skip. ``scripts/gpu_check.sh --device cpu`` sets it to ``cpu``, which
runs the same comparisons on the CPU so that the tests themselves are tested
where no GPU is. Every comparison is against a computation on the CPU in
float64: the reference K-FAC step, or the optimizer itself, whose CPU
float64 results the rest of the suite checks against the references.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from launch import ROOT, run_workers
from nets import assert_bitwise_equal, batch, mixed_net, shared_net, small_net, small_transformer, train
from torch._dynamo.utils import counters
from unit.kfac.test_embedding_outside_use import OUTSIDE, TinyLM
from unit.kfac.test_embedding_outside_use import _steps as lm_steps
from unit.kfac.test_embedding_outside_use import _tokens as lm_tokens
from unit.kfac.test_reference_kfac import ConvLinearNet, ReferenceKFAC
from unit.step.test_stacked_preconditioning import RepeatedNet

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.torch_backend import TorchDistributedBackend
from spdkfac.kfac.layers import KFACLayer, make_helper
from spdkfac.kfac.linalg import cupy_available, invert_spd
from spdkfac.kfac.tensor_cores import keeps_half_rows
from spdkfac.plan.memory_check import available_bytes, layer_memory
from spdkfac.step import compiled_hooks
from spdkfac.step.gradient_views import StackedGradients
from spdkfac.update.your_optimizer import STATE_KEY

pytestmark = pytest.mark.gpu

DEVICE_ENV = "SPDKFAC_TEST_DEVICE"
HYPER = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=1e-2)
#: The compute methods and their variants, each a configuration of the one optimizer.
METHODS = {
    "inverse": {},
    "eigen": dict(compute_method="eigen"),
    "eigen-warm": dict(compute_method="eigen", eigen_refresh="warm", eigen_full_every=3),
    "ekfac": dict(compute_method="ekfac"),
    "ekfac-adam": dict(compute_method="ekfac", ekfac_update="adam", base="adamw", lr=1e-2, kl_clip=None),
    # The factors wider than 4 kept diagonal (max_factor_dim: A of the ungrouped convolutions, A and G of the Linear layer).
    "inverse-diagonal": dict(max_factor_dim=4),
    "eigen-diagonal": dict(compute_method="eigen", max_factor_dim=4),
}


#: float32 on the device against float64 on the CPU after 6 steps (on the CPU: 1e-7 inverse and eigen, 4e-5 EKFAC).
FLOAT32_RTOL = 1e-3


@pytest.fixture
def device() -> torch.device:
    """The device under test; skips without CUDA unless ``SPDKFAC_TEST_DEVICE=cpu``."""
    name = os.environ.get(DEVICE_ENV, "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (set {DEVICE_ENV}=cpu to run these tests on the CPU)")
    dev = torch.device(name)
    if dev.type == "cuda":
        # Exact float32 arithmetic, so that a float32 comparison measures the optimizer, not TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def _cpu_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float64) for k, v in model.state_dict().items()}


def _train_on(
    device: torch.device, dtype: torch.dtype, options: dict, steps: int = 6, net=mixed_net, samples: int = 16
) -> tuple[dict[str, torch.Tensor], SPDKFACOptimizer]:
    """``steps`` steps of the optimizer on ``device`` in ``dtype`` (mixed_net: Embedding, grouped, depthwise, Conv1d)."""
    model = net().to(device, dtype)
    hyper = {**HYPER, **options}
    if hyper.get("base", "sgd") != "sgd":
        del hyper["momentum"]  # betas instead
    stack_groups = hyper.pop("stack_groups", None)
    opt = SPDKFACOptimizer(model, backend="single", **hyper)
    opt.kfac_step.preconditioner.stack_groups = stack_groups  # (None: the default, stacked on a GPU only)
    x, y = batch(samples)
    train(model, opt, x.to(device, dtype), y.to(device), steps)
    assert opt.steps == steps
    return _cpu_params(model), opt


def _smallest_eigen_gap(opt: SPDKFACOptimizer) -> float:
    """The smallest gap between neighbouring eigenvalues of any factor, relative to its largest eigenvalue."""
    gaps = []
    for layer in opt.layers:
        for factor in (layer.A, layer.G):
            d = torch.linalg.eigvalsh(factor.double().cpu())
            gaps.append(float((d[1:] - d[:-1]).min() / d[-1]) if d.numel() > 1 else 1.0)
    return min(gaps)


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[k] - v).pow(2).sum()) for k, v in want.items())
    den = sum(float(v.pow(2).sum()) for v in want.values())
    return (num / den) ** 0.5


def test_reference_step_on_device(device: torch.device) -> None:
    """The inverse method on the device takes the float64 reference step computed on the CPU (factors every step,
    decompositions every 2)."""
    torch.manual_seed(0)
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.003, factor_decay=0.95, kl_clip=1e-3)
    ref_net = ConvLinearNet().double()
    net = copy.deepcopy(ref_net).to(device)
    reference = ReferenceKFAC(ref_net, factor_update_freq=1, inv_update_freq=2, **hyper)
    opt = SPDKFACOptimizer(net, backend="single", factor_update_freq=1, inv_update_freq=2, **hyper)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(5, 2, 7, 7, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=gen)
        reference.step(x, y)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        opt.step()
        for (name, p), p_ref in zip(net.named_parameters(), ref_net.parameters()):
            assert p.device.type == device.type
            torch.testing.assert_close(
                p.detach().cpu(), p_ref, rtol=1e-9, atol=1e-12, msg=lambda m, n=name, s=step: f"{n} at step {s}: {m}"
            )
    for layer, module in zip(opt.layers, reference.layers):
        assert layer.A.device.type == device.type
        torch.testing.assert_close(layer.A.cpu(), reference.A[module], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_on_device_equals_cpu_float64(device: torch.device, method: str) -> None:
    """Each compute method, float64 on the device, gives the CPU's float64 parameters; float32 on the device is within
    float32 rounding of them."""
    options = dict(METHODS[method], factor_update_freq=1, inv_update_freq=2)
    # EKFAC's running scales live on the eigenvectors, so they are defined only where the eigenvalues are distinct:
    # in a repeated eigenvalue's eigenspace (an Embedding's diagonal A with equal token counts, a factor of rank below
    # its size mixed with the identity) CPU and GPU eigh pick different bases, and both are right. Its check runs
    # where every factor has distinct eigenvalues: the small network on 64 samples (full-rank factors).
    net, samples = (small_net, 64) if options.get("compute_method") == "ekfac" else (mixed_net, 16)
    want, reference = _train_on(torch.device("cpu"), torch.float64, options, net=net, samples=samples)
    if net is small_net:
        assert _smallest_eigen_gap(reference) > 1e-6
    got, _ = _train_on(device, torch.float64, options, net=net, samples=samples)
    # (Adam divides by the root of its second moments: a rounding difference of the eigenbasis grows to ~2e-9, H200.)
    rtol = 1e-7 if options.get("base", "sgd") != "sgd" else 1e-9
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=1e-11, msg=lambda m, k=k: f"{method} {k}: {m}")
    start = _cpu_params(net().double())
    assert _relative_error(want, start) > 1e-3  # the parameters moved: the comparison is not of a still model
    if options.get("base", "sgd") == "sgd":
        # (Adam's first steps are nearly sign(g): float32 rounding flips the coordinates whose gradient is ~0.)
        got32, _ = _train_on(device, torch.float32, options, net=net, samples=samples)
        assert _relative_error(got32, want) < FLOAT32_RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cupy_and_torch_inverses_agree(device: torch.device, dtype: torch.dtype) -> None:
    """cuSOLVER through cupy and ``torch.linalg`` invert the same damped factors to the dtype's rounding."""
    if device.type != "cuda" or not cupy_available():
        pytest.skip("cupy with a CUDA device is needed to compare the two")
    gen = torch.Generator().manual_seed(0)
    for d in (7, 256, 1153):
        a = torch.randn(d, d + 3, generator=gen, dtype=torch.float64)
        spd = (a @ a.T / (d + 3)).to(device, dtype)
        by_cupy, by_torch = invert_spd(spd, 1e-3, use_cupy=True), invert_spd(spd, 1e-3, use_cupy=False)
        exact = torch.linalg.inv(spd.double().cpu() + 1e-3 * torch.eye(d, dtype=torch.float64))
        tol = 1e-3 if dtype == torch.float32 else 1e-10
        for got in (by_cupy, by_torch):
            assert got.dtype == dtype
            assert got.device.type == "cuda"
            assert float((got.double().cpu() - exact).norm() / exact.norm()) < tol
            assert torch.equal(got, got.T)  # symmetrised, as packing the upper triangle needs


@pytest.mark.parametrize("net", [small_net, mixed_net], ids=["small_net", "mixed_net"])
def test_bf16_autocast(device: torch.device, net) -> None:
    """Under bf16 autocast the factors stay float32 and match the float32 run's to bf16 rounding; training goes on.
    (mixed_net: every layer type's half-precision path, transposed and 3-D convolutions included.)"""
    x, y = batch(16)
    x, y = x.to(device), y.to(device)
    runs = {}
    for amp in (False, True):
        model = net().to(device)
        opt = SPDKFACOptimizer(model, backend="single", **HYPER)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        runs[amp] = (opt, losses)
    (plain, _), (mixed, losses) = runs[False], runs[True]
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    for a, b in zip(mixed.layers, plain.layers):
        assert a.A.dtype == torch.float32
        assert a.G.dtype == torch.float32
        assert torch.isfinite(a.A).all()
        assert torch.isfinite(a.G).all()
        assert float((a.A - b.A).norm() / b.A.norm()) < 3e-2
    assert losses[-1] < losses[0]


#: Each layer type's factor path: (module, input shape).
HALF_PRECISION_LAYERS = {
    "conv3x3": (lambda: nn.Conv2d(32, 48, 3, padding=1), (4, 32, 4, 4)),
    "conv1x1": (lambda: nn.Conv2d(32, 48, 1), (4, 32, 4, 4)),
    "linear": (lambda: nn.Linear(32, 48), (64, 32)),
    "conv1d": (lambda: nn.Conv1d(32, 48, 3, padding=1), (4, 32, 16)),
    "conv3d": (lambda: nn.Conv3d(16, 24, 3, padding=1, stride=2), (4, 16, 4, 4, 4)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(32, 48, 4, stride=2, padding=1), (4, 32, 4, 4)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(32, 48, 3, stride=2, padding=1, output_padding=1), (4, 32, 16)),
}


@pytest.mark.parametrize("module", list(HALF_PRECISION_LAYERS))
def test_half_precision_factors_are_exact_products(device: torch.device, module: str) -> None:
    """Factors of bf16/fp16 inputs (autocast) keep the rows in half precision on a GPU, multiplied into float32 on
    the tensor cores: exact products, so they equal the float64 Gram of the same values to float32 summation,
    as float32 inputs do (with or without a loss scale, divided out afterwards). (64 rows of positive inputs,
    as after a ReLU: rounding the inputs to TF32 or bf16 would leave about 5e-5.)"""
    if device.type == "cuda":  # the fast path is the one under test
        assert keeps_half_rows(torch.zeros(1, device=device, dtype=torch.bfloat16), torch.float32)
    torch.manual_seed(0)
    make, shape = HALF_PRECISION_LAYERS[module]
    net = make()
    x = torch.randn(shape).abs() + 0.1
    g = torch.randn_like(net(x).detach())
    ref = KFACLayer("ref", make_helper(net.double()))  # float64 on the CPU
    layer = KFACLayer("dev", make_helper(copy.deepcopy(net).float().to(device)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xs, gs = x.to(dtype), g.to(dtype)  # the values both sides multiply
        for kind, got, want in (
            ("A", layer.compute_a(xs.to(device)), ref.compute_a(xs.double())),
            ("G", layer.compute_g(gs.to(device), loss_scale=2.0**10), ref.compute_g(gs.double(), loss_scale=2.0**10)),
            ("G", layer.compute_g(gs.to(device), loss_scale=3.0), ref.compute_g(gs.double(), loss_scale=3.0)),
        ):
            error = float((got.double().cpu() - want).norm() / want.norm())
            assert error < 3e-6, f"{module} {kind} from {dtype}: relative error {error:.1e}"


def test_grad_scaler_on_device(device: torch.device) -> None:
    """The float16 loop's GradScaler on the device: a loss scale changes nothing (float64), a NaN step is skipped,
    and float16 autocast trains."""
    x, y = batch(8)
    x, y = x.to(device, torch.float64), y.to(device)
    plain = small_net().to(device, torch.float64)
    train(plain, SPDKFACOptimizer(plain, backend="single", **HYPER), x, y, 4)
    scaled = small_net().to(device, torch.float64)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)
    train(scaled, SPDKFACOptimizer(scaled, backend="single", grad_scaler=scaler, **HYPER), x, y, 4, scaler=scaler)
    for k, v in _cpu_params(plain).items():
        torch.testing.assert_close(_cpu_params(scaled)[k], v, rtol=1e-12, atol=1e-14)

    skipped = small_net().to(device, torch.float64)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8)
    opt = SPDKFACOptimizer(skipped, backend="single", grad_scaler=scaler, **HYPER)
    mask = torch.zeros(8, dtype=torch.bool, device=device)
    mask[3] = True
    train(skipped, opt, x, y, 4, scaler=scaler, poisoned={1: mask})
    assert opt.steps == 3
    assert scaler.get_scale() == 2.0**7
    assert all(torch.isfinite(layer.A).all() and torch.isfinite(layer.G).all() for layer in opt.layers)

    model = small_net().to(device)
    scaler = torch.amp.GradScaler(device.type)
    opt = SPDKFACOptimizer(model, backend="single", grad_scaler=scaler, **HYPER)
    xf, losses = x.float(), []
    for _ in range(8):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(xf), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
    assert opt.steps >= 6
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("direction", ["device-to-cpu", "cpu-to-device"])
def test_state_dict_moves_between_cpu_and_device(device: torch.device, direction: str) -> None:
    """A checkpoint written on one device and resumed on the other continues the run exactly (float64)."""
    first, second = (device, torch.device("cpu")) if direction == "device-to-cpu" else (torch.device("cpu"), device)
    x, y = batch(16)
    options = dict(HYPER, compute_method="eigen", factor_update_freq=1, inv_update_freq=2)
    whole = mixed_net().to(first, torch.float64)
    train(whole, SPDKFACOptimizer(whole, backend="single", **options), x.to(first, torch.float64), y.to(first), 6)

    model = mixed_net().to(first, torch.float64)
    opt = SPDKFACOptimizer(model, backend="single", **options)
    train(model, opt, x.to(first, torch.float64), y.to(first), 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location=second, weights_only=True)
    resumed = mixed_net(seed=1).to(second, torch.float64)
    resumed.load_state_dict(saved["model"])
    opt2 = SPDKFACOptimizer(resumed, backend="single", **options)
    opt2.load_state_dict(saved["optimizer"])
    # Steps 3-5 of the whole run: train() perturbs the batch by 0.1 * step, so shift it by the 3 steps done.
    train(resumed, opt2, x.to(second, torch.float64) + 0.3, y.to(second), 3)
    assert opt2.steps == 6
    assert all(layer.A.device.type == second.type for layer in opt2.layers)
    for k, v in _cpu_params(whole).items():
        torch.testing.assert_close(_cpu_params(resumed)[k], v, rtol=1e-9, atol=1e-11)


@pytest.mark.multiprocess
def test_two_processes_on_one_device_equal_one(device: torch.device, tmp_path, monkeypatch) -> None:
    """2 torchrun workers (gloo over the device's tensors; on a GPU both share it) give one process's parameters on
    the global batch (float64), and hold bitwise the same parameters, momentum, factors and decompositions."""
    worker = str(ROOT / "tests" / "workers" / "train_configs.py")
    base = dict(HYPER, fusion="optimal", placement="lbp", perf_model="expensive-inverse", model="mixed")
    configs = json.dumps(
        {
            "spdkfac": base,
            "eigen-amortised": dict(base, compute_method="eigen", factor_update_freq=2, inv_update_freq=4),
            "grad-workers-half": dict(base, compute_method="eigen", grad_worker_fraction=0.5),
        }
    )
    common = ["--configs", configs, "--global-batch", "16", "--steps", "5", "--device", str(device)]
    single = tmp_path / "single.pt"
    monkeypatch.setenv("SPDKFAC_DIST_BACKEND", "gloo")  # NCCL cannot put two ranks on one GPU
    run_workers("torch", 2, [worker, "--backend", "torch", "--every-rank", "--out", str(tmp_path / "dist.pt"), *common])
    subprocess.run([sys.executable, worker, "--backend", "single", "--out", str(single), *common], check=True, cwd=ROOT, timeout=300)
    want = torch.load(single, weights_only=False, map_location="cpu")
    ranks = [torch.load(f"{tmp_path / 'dist.pt'}.rank{r}", weights_only=False, map_location="cpu") for r in (0, 1)]
    for name, ref in want.items():
        for r, result in enumerate(ranks):
            for k, v in ref["params"].items():
                torch.testing.assert_close(
                    result[name]["params"][k].cpu(),
                    v.cpu(),
                    rtol=1e-9,
                    atol=1e-11,
                    msg=lambda m, n=name, r=r, k=k: f"{n} rank {r} {k}: {m}",
                )
        assert_bitwise_equal(ranks[0][name]["params"], ranks[1][name]["params"], f"{name} parameters")
        if "grad_worker_fraction" not in json.loads(configs)[name]:  # (there each rank holds its own layers' decompositions)
            assert_bitwise_equal(ranks[0][name]["optimizer_state"], ranks[1][name]["optimizer_state"], f"{name} optimizer state")


def test_nccl_engine_takes_the_optimizers_cpu_tensors(device: torch.device, tmp_path) -> None:
    """NCCL refuses host memory; the optimizer's small collectives (the step's agreement, a profile's numbers) are
    CPU tensors, which the torch engine moves through a gloo group of the same ranks. One process: they run."""
    if device.type != "cuda" or not dist.is_nccl_available():
        pytest.skip("NCCL needs a CUDA device")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        engine = TorchDistributedBackend()
        values = torch.tensor([1.5, -2.0], dtype=torch.float64)
        engine.allreduce_async(values, "gpu_check.allreduce").wait()
        engine.broadcast_async(values, 0, "gpu_check.broadcast").wait()
        assert values.device.type == "cpu"
        assert values.tolist() == [1.5, -2.0]
        assert engine.gather_values([3.0, 4.0], "gpu_check.gather") == [[3.0, 4.0]]
        assert engine._host is not None
        assert engine._host[0] is not None
    finally:
        dist.destroy_process_group()


def _repeated_net() -> nn.Module:
    torch.manual_seed(0)
    return RepeatedNet()


@pytest.mark.parametrize("net", [_repeated_net, small_transformer], ids=["repeated-blocks", "transformer"])
def test_same_shape_layers_stacked_on_device_equal_cpu_float64(device: torch.device, net) -> None:
    """Same-shape layers preconditioned stacked (the default on a GPU; forced here so that the CPU run of this test
    stacks too): their gradients read and their updates written back as one stack, the KL clip's products summed
    per stack on a GPU. The parameters of the CPU's float64 run layer by layer, with a clip that binds."""
    options = dict(factor_update_freq=2, inv_update_freq=4, kl_clip=1e-4)
    got, opt = _train_on(device, torch.float64, {**options, "stack_groups": True}, net=net)
    want, _ = _train_on(torch.device("cpu"), torch.float64, {**options, "stack_groups": False}, net=net)
    groups = [g for g in opt.kfac_step.preconditioner.stacks.groups(opt.layers) if len(g) > 1]
    assert groups
    assert all(StackedGradients.of([opt.layers[i] for i in g]) is not None for g in groups)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")


def test_preconditioner_attached_to_a_torch_optimizer_on_device(device: torch.device) -> None:
    """``KFACPreconditioner(model, optimizer=AdamW)`` (Lightning's and Trainer's way) on the device gives the CPU's
    float64 parameters, and its optimizer's state_dict() carries the K-FAC state there."""

    def run(dev: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
        model = mixed_net().to(dev, torch.float64)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-3)
        _pre = KFACPreconditioner(model, optimizer=adamw, damping=0.01, factor_update_steps=1, inv_update_steps=2, backend="single")
        x, y = batch(16)
        for s in range(5):
            adamw.zero_grad()
            nn.functional.cross_entropy(model(x.to(dev, torch.float64) + 0.1 * s), y.to(dev)).backward()
            adamw.step()
        return _cpu_params(model), adamw.state_dict()

    got, state = run(device)
    want, _ = run(torch.device("cpu"))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")
    assert STATE_KEY in state


@pytest.mark.skipif(not compiled_hooks.TAPS_AVAILABLE, reason="this torch has no custom ops with effects")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("net", [small_net, shared_net], ids=["small_net", "shared_net"])
def test_compiled_model_on_device_trains_as_eager(device: torch.device, net, mode: str) -> None:
    """torch.compile (inductor: generated device kernels) with K-FAC's hooks in the graph trains as the eager model
    on the device (float64), with no graph break; shared_net has a layer used twice. ``reduce-overhead`` replays
    CUDA graphs, which must leave the taps' Python outside (their op is tagged cudagraph-unsafe)."""
    torch._dynamo.reset()
    counters.clear()

    def run(compile_it: bool) -> dict[str, torch.Tensor]:
        bare = net().to(device, torch.float64)
        model = torch.compile(bare, mode=mode) if compile_it else bare
        opt = SPDKFACOptimizer(model, backend="single", factor_update_freq=2, inv_update_freq=2, **HYPER)
        x, y = batch(8)
        train(model, opt, x.to(device, torch.float64), y.to(device), 5)
        return _cpu_params(bare)

    eager, compiled = run(False), run(True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for k, v in eager.items():
        torch.testing.assert_close(compiled[k], v, rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")
    torch._dynamo.reset()


def test_memory_check_reads_the_device(device: torch.device) -> None:
    """The construction-time memory check on the device: its estimate is what ``memory_usage()`` counts there once
    allocated, and a layer whose G cannot fit the device's free memory is named (nothing that large allocated)."""
    model = mixed_net().to(device)
    opt = SPDKFACOptimizer(model, backend="single", compute_method="eigen", **HYPER)
    sizes = {layer.name: layer.factor_dtype.itemsize for layer in opt.layers}
    predicted = sum(la.bytes for la in layer_memory(opt.work_plan, opt.method, 0, sizes))
    x, y = batch(8)
    train(model, opt, x.to(device), y.to(device), 1)
    assert predicted == sum(opt.memory_usage().values())
    if device.type == "cuda":
        free = available_bytes(device)
        assert free is not None
        assert 0 < free <= torch.cuda.mem_get_info(device)[1]
    wide = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 300_000)).to(device)  # G: 335 GiB in float32
    with pytest.warns(UserWarning, match=r"the first factor step will likely run out of memory") as record:
        SPDKFACOptimizer(wide, backend="single", **HYPER)
    assert "skip_layers=['2']" in str(next(w for w in record if "out of memory" in str(w.message)).message)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*run out of memory.*")
        SPDKFACOptimizer(small_net().to(device), backend="single", **HYPER)


def test_embedding_used_outside_its_forward_is_said_on_device(device: torch.device) -> None:
    """A tied head written as a product (``h @ wte.weight.T``) is found from the gradient on the device, once."""
    model = TinyLM("product").to(device)
    opt = SPDKFACOptimizer(model, backend="single", factor_update_freq=2, inv_update_freq=2, lr=0.05, damping=0.01)
    with pytest.warns(UserWarning, match=OUTSIDE) as record:
        lm_steps(model, opt, lm_tokens(1).to(device))
    assert sum("never looked up" in str(w.message) for w in record) == 1
    lookups_only = TinyLM("linear").to(device)
    opt = SPDKFACOptimizer(lookups_only, backend="single", lr=0.05, damping=0.01)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*never looked up.*")
        lm_steps(lookups_only, opt, lm_tokens(1).to(device))


def test_fsdp_cpu_offloading_trains_as_without(device: torch.device, tmp_path) -> None:
    """FSDP2 with CPU offloading (``CPUOffloadPolicy``) keeps the shards and their gradients in host memory while the
    passes run on the device: K-FAC's factors (from the device's activations) and the host's gradients meet in the
    preconditioning. One process (a 1-worker mesh; NCCL on a GPU): the offloaded run equals the one without, to
    float32 rounding (the base update runs on the host there). On the CPU the policy's code paths run, nothing moves."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "CPUOffloadPolicy"):
        pytest.skip("no FSDP2 CPU offloading in this torch")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        results = []
        for offload in (False, True):
            model = small_net()
            policy = {"offload_policy": fsdp.CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
            if not offload:
                model = model.to(device)
            for child in model.children():
                if any(True for _ in child.parameters()):
                    fsdp.fully_shard(child, **policy)
            fsdp.fully_shard(model, **policy)
            opt = SPDKFACOptimizer(model, **HYPER)
            x, y = batch(16)
            train(model, opt, x.to(device), y.to(device), 4)
            results.append({name: p.full_tensor().detach().to("cpu", torch.float64) for name, p in model.named_parameters()})
        for name, want in results[0].items():
            torch.testing.assert_close(results[1][name], want, rtol=1e-5, atol=1e-6, msg=f"{name}: offloaded against not")
    finally:
        dist.destroy_process_group()
