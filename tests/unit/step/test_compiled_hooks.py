"""``torch.compile``: a compiled model trains as the eager one, in one graph, and keeps the bare model's names.

Float64, the small test networks, factors and inverses every 2 steps (so the
taps also run on steps that take no factor). Dynamo's counters give the graph
breaks and the graphs compiled. The 2-worker runs (DDP, the preconditioner)
are in ``tests/multiprocess/test_compile_multiprocess.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from nets import batch, mixed_net, shared_net, small_net, small_transformer, train
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.step import compiled_hooks
from spdkfac.step.compiled_hooks import register_factor_pre_hook, register_output_grad_hook

warnings.filterwarnings("ignore", message="no perf_model given")

# slow: Dynamo's compiles cost ~13 s together, a fifth of the fast loop (CI runs them, scripts/test.sh).
pytestmark = [pytest.mark.skipif(not compiled_hooks.TAPS_AVAILABLE, reason="this torch has no custom ops with effects"), pytest.mark.slow]

OPTIONS = dict(lr=0.05, momentum=0.9, damping=0.01, factor_update_freq=2, inv_update_freq=2, backend="single")


@pytest.fixture
def dynamo() -> Iterator[None]:
    """Fresh Dynamo caches and counters."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _run(net: nn.Module, mode: str, steps: int = 5, accumulate: int = 1, backend: str = "inductor", **options) -> SPDKFACOptimizer:
    model: nn.Module = torch.compile(net, backend=backend) if mode == "wrap" else net
    opt = SPDKFACOptimizer(model, accumulation_steps=accumulate, **{**OPTIONS, **options})
    if mode == "after":
        model = torch.compile(net, backend=backend)
    x, y = batch(8)
    train(model, opt, x, y, steps, accumulate=accumulate)
    return opt


def _assert_same_training(eager: SPDKFACOptimizer, compiled: SPDKFACOptimizer) -> None:
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(a, small_net().state_dict().get(name, a + 1)), f"{name} did not train"
    assert eager.state_dict()["kfac"]["layers"].keys() == compiled.state_dict()["kfac"]["layers"].keys()


@pytest.mark.parametrize("mode", ["wrap", "after"])
def test_compiled_model_trains_as_eager_in_one_graph(float64, dynamo, mode):
    eager = _run(small_net(), "eager")
    compiled = _run(small_net(), mode)
    _assert_same_training(eager, compiled)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # compiled once: no recompilation in steps 2-5


def test_every_layer_type_and_accumulation(float64, dynamo):
    """Embedding, grouped, depthwise, reflect and circular padding, Conv1d; two micro-batches per step (AOT backend)."""
    eager = _run(mixed_net(), "eager", accumulate=2)
    compiled = _run(mixed_net(), "wrap", accumulate=2, backend="aot_eager")
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert sum(counters["graph_break"].values()) == 0


class CrossAttentionNet(nn.Module):
    """The 6 rows of a 2x6x6 input as tokens, attending without biases to one memory made from them (k and v one product)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.memory = nn.Linear(12, 12)
        self.attn = nn.MultiheadAttention(12, 2, bias=False, batch_first=True)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 2, 1, 3).reshape(x.shape[0], 6, 12)
        memory = torch.tanh(self.memory(tokens))
        return self.head(self.attn(tokens, memory, memory, need_weights=False)[0].mean(dim=1))


@pytest.mark.parametrize(
    ("net", "projection"),
    [(small_transformer, "encoder.layers.0.self_attn.v_proj"), (CrossAttentionNet, "attn.v_proj")],
    ids=["self", "cross"],
)
def test_attention_compiled_trains_as_eager_in_one_graph(float64, dynamo, net, projection):
    """nn.MultiheadAttention's explicit forward (q, k, v of one input one product, k and v of one memory one product)
    compiled: every projection's factors and update as eager, no graph break."""
    eager = _run(net(), "eager")
    compiled = _run(net(), "wrap", backend="aot_eager")
    names = {layer.name for layer in compiled.layers}
    assert {projection, projection.replace("v_proj", "q_proj")} <= names
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_forward_update_fusion_runs_its_hooks_eagerly(float64, dynamo):
    """update_fusion='forward' updates parameters in pre-hooks: graph breaks there, the same training."""
    eager = _run(small_net(), "eager", update_fusion="forward", kl_clip=None)
    compiled = _run(small_net(), "wrap", backend="aot_eager", update_fusion="forward", kl_clip=None)
    eager.flush()
    compiled.flush()
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert compiled._forward_fusion is not None
    assert compiled._forward_fusion.applied_in_forward > 0


def test_preconditioner_on_a_compiled_model_equals_eager(float64, dynamo):
    def run(compile_it: bool) -> nn.Module:
        net = small_net()
        model = torch.compile(net, backend="aot_eager") if compile_it else net
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = KFACPreconditioner(model, lr=0.05, damping=0.01, factor_update_steps=2, inv_update_steps=2, backend="single")
        x, y = batch(8)
        for s in range(4):
            sgd.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
            pre.step()
            sgd.step()
        return net

    for a, b in zip(run(False).parameters(), run(True).parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("checkpoint_mode", [None, "reentrant", "non-reentrant"])
def test_shared_and_checkpointed_layers_compiled_train_as_eager(checkpoint_mode, float64, dynamo):
    """A siamese encoder, a recurrent cell, tied modules, a head on odd steps only, the trunk checkpointed: the taps
    ask whether G is wanted when the gradient arrives (inside the backward pass), and count as the eager hooks do."""

    def run(compile_it: bool) -> tuple[nn.Module, SPDKFACOptimizer]:
        torch._dynamo.reset()
        net = shared_net(checkpoint_mode=checkpoint_mode)
        model = torch.compile(net, backend="aot_eager") if compile_it else net
        opt = SPDKFACOptimizer(model, **OPTIONS)
        x, y = batch(8)
        for s in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x + 0.1 * s, aux=s % 2 == 1), y).backward()
            opt.step()
        return net, opt

    (eager, eager_opt), (compiled, compiled_opt) = run(False), run(True)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    for la, lb in zip(eager_opt.layers, compiled_opt.layers):
        torch.testing.assert_close(lb.G, la.G, rtol=1e-10, atol=1e-12, msg=lambda m, n=la.name: f"G of {n}: {m}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_names_skip_layers_and_checkpoints_are_the_bare_models():
    """``SPDKFACOptimizer(torch.compile(model))``: no ``_orig_mod.`` anywhere; checkpoints load either way."""
    net = small_net()
    compiled = SPDKFACOptimizer(torch.compile(net), skip_layers=["2"], **OPTIONS)
    eager = SPDKFACOptimizer(small_net(), skip_layers=["2"], **OPTIONS)
    assert compiled.model is net
    assert [la.name for la in compiled.layers] == [la.name for la in eager.layers] == ["0", "4", "6"]
    assert set(compiled.param_names.values()) == set(eager.param_names.values())
    assert "_orig_mod" not in compiled.kfac_summary()
    eager.load_state_dict(compiled.state_dict())
    compiled.load_state_dict(eager.state_dict())
    pre = KFACPreconditioner(torch.compile(small_net()), lr=0.1, skip_layers=["^4$"], backend="single")
    assert [la.name for la in pre.kfac.layers] == ["0", "2", "6"]


@pytest.mark.usefixtures("process_group")
def test_compiled_ddp_is_unwrapped_both_ways():
    for wrap in (lambda n: torch.compile(DistributedDataParallel(n)), lambda n: DistributedDataParallel(torch.compile(n))):
        net = small_net()
        opt = SPDKFACOptimizer(wrap(net), **OPTIONS)
        assert opt.model is net
        assert opt.wrapping.ddp is not None
        assert [la.name for la in opt.layers] == ["0", "2", "4", "6"]
    with pytest.raises(ValueError, match="DistributedDataParallel inside another"):
        SPDKFACOptimizer(torch.compile(DistributedDataParallel(DistributedDataParallel(small_net()))), **OPTIONS)


def test_taps_call_the_hooks_with_the_real_tensors_and_stop_when_removed(dynamo):
    """The pre-hook sees the input under grad mode; the gradient hook the output's gradient, if wanted then."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    seen: list[tuple[str, torch.Tensor, bool]] = []
    want = [True]
    pre = register_factor_pre_hook(layer, lambda m, inputs: seen.append(("in", inputs[0].clone(), torch.is_grad_enabled())))
    post = register_output_grad_hook(layer, lambda: want[0], lambda g: seen.append(("grad", g.clone(), False)))
    model = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3)
    model(x).pow(2).sum().backward()
    expected_grad = 2 * nn.functional.linear(x, layer.weight, layer.bias).detach()
    assert [s[0] for s in seen] == ["in", "grad"]
    torch.testing.assert_close(seen[0][1], x)
    assert seen[0][2]  # called as the eager pre-hook would be: gradients on
    torch.testing.assert_close(seen[1][1], expected_grad)
    want[0] = False
    seen.clear()
    model(x).pow(2).sum().backward()
    assert [s[0] for s in seen] == ["in"]
    with torch.no_grad():  # no tap in a graph traced without gradients
        model(x)
    assert [s[0] for s in seen] == ["in"]
    pre.remove()
    post.remove()
    seen.clear()
    model(x).pow(2).sum().backward()
    assert seen == []


@pytest.mark.parametrize("guard_hooks", [False, True])
def test_another_instance_of_the_class_compiled_beside(float64, dynamo, guard_hooks):
    """A second instance of the model's class compiled in the same process (a teacher, a copy) takes its graph
    without K-FAC's taps, and the K-FAC model then reuses it: the step is refused naming the Dynamo flag; with the
    flag set, K-FAC trains as with no second model."""
    saved = torch._dynamo.config.skip_nnmodule_hook_guards
    torch._dynamo.config.skip_nnmodule_hook_guards = not guard_hooks
    try:
        alone = _run(small_net(), "wrap", steps=3, backend="aot_eager")
        torch._dynamo.reset()
        net = small_net()
        model = torch.compile(net, backend="aot_eager")
        opt = SPDKFACOptimizer(model, **OPTIONS)
        teacher = torch.compile(small_net(seed=1), backend="aot_eager")
        x, y = batch(8)

        def three_steps() -> None:
            for s in range(3):
                teacher(x).sum().backward()
                opt.zero_grad()
                nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
                opt.step()

        if not guard_hooks:
            with pytest.raises(RuntimeError, match=r"skip_nnmodule_hook_guards = False"):
                three_steps()
            return
        three_steps()
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = saved
    for a, b in zip(alone.model.parameters(), net.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_the_tap_is_left_outside_cuda_graphs():
    """``mode="reduce-overhead"`` replays CUDA graphs: a tap captured in one would replay its kernels without its
    Python (no factor taken). Tagged cudagraph-unsafe, inductor leaves it outside (run on a GPU: tests/test_gpu.py)."""
    unsafe = getattr(torch._C.Tag, "cudagraph_unsafe", None)
    if unsafe is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert unsafe in torch.ops.spdkfac.hook_tap.default.tags
