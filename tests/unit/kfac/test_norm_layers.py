"""``norm_layers='kfac'``: normalisation layers' scale and shift preconditioned by per-channel 2x2 Fisher blocks.

The reference is written from the definition, in float64, without spdkfac
code: the per-sample gradients of each channel's ``(scale, shift)`` (for
LayerNorm and GroupNorm by one backward pass per sample, which is exact:
they normalise each sample alone; for BatchNorm from ``x̂`` computed by hand
and the output gradient, the batch statistics held constant), their mean
outer product per channel ``F_c``, the running average from the identity,
and the update ``(F_c+γI)^-1 grad_c / (1+γ)`` (inverse method: the factored
damping with ``A = 1``) or ``(F_c+γI)^-1 grad_c`` (eigen). Only the norm
layers are preconditioned there (``skip_layers`` leaves the rest to SGD),
so their update is read off the parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

GAMMA, DECAY, LR = 0.01, 0.8, 1.0
EXACT = dict(lr=LR, momentum=0.0, damping=GAMMA, factor_decay=DECAY, kl_clip=None)


class Permute(nn.Module):
    """``(n, C, L) -> (n, L, C)``: a LayerNorm over the channels of a sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 1)


def per_sample_net(seed: int = 0) -> nn.Module:
    """GroupNorm on a feature map, LayerNorm on a sequence (no shift), LayerNorm and RMSNorm (scale only) on vectors: each
    sample normalised alone."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Conv2d(4, 3, 3),  # 4x4
        nn.Flatten(2),  # (n, 3, 16)
        Permute(),  # (n, 16, 3)
        nn.LayerNorm(3, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(48, 6),
        nn.LayerNorm(6),
        nn.Tanh(),
        nn.RMSNorm(6),
        nn.Linear(6, 5),
    )


def batch_norm_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(64, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 5),
    )


NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, NORMS)}


def _bias(module: nn.Module) -> torch.Tensor | None:
    """The shift, or None (an RMSNorm has no ``bias`` attribute at all)."""
    return getattr(module, "bias", None)


def _stack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(C, 1 or 2)``: scale and shift per channel."""
    return torch.stack([weight.reshape(-1)] + ([] if bias is None else [bias.reshape(-1)]), dim=-1)


def per_sample_grads_exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``(n, C, k)`` per layer: each sample's own loss gradient, one backward pass per sample."""
    norms = _norms(model)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in norms}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, m in norms.items():
            out[name].append(_stack(m.weight.grad, None if _bias(m) is None else _bias(m).grad).clone())
    return {name: torch.stack(grads) for name, grads in out.items()}


def per_sample_grads_batch_norm(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """BatchNorm: ``n * (Σ_s x̂ g, Σ_s g)`` per sample and channel, ``x̂`` by hand from the batch statistics."""
    norms = _norms(model)
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, m in norms.items():

        def keep(mod, inp, out, name=name):
            inputs[name] = inp[0].detach()
            out.retain_grad()
            outputs[name] = out

        handles.append(m.register_forward_hook(keep))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    n = x.shape[0]
    result = {}
    for name, m in norms.items():
        a, g = inputs[name], outputs[name].grad
        dims = [0, *list(range(2, a.dim()))]
        shape = [1, -1] + [1] * (a.dim() - 2)
        mean = a.mean(dims).reshape(shape)
        var = ((a - mean) ** 2).mean(dims).reshape(shape)  # biased, as BatchNorm normalises
        xhat = (a - mean) / torch.sqrt(var + m.eps)
        rows = []
        for i in range(n):
            scale = torch.stack([(xhat[i, c] * g[i, c]).sum() for c in range(a.shape[1])])
            shift = torch.stack([g[i, c].sum() for c in range(a.shape[1])])
            rows.append(n * torch.stack([scale, shift], dim=-1))
        result[name] = torch.stack(rows)
    return result


def reference_updates(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, running: dict[str, torch.Tensor], method: str, exact: bool
) -> dict[str, torch.Tensor]:
    """``(C, k)`` per norm layer: the preconditioned gradient; ``running`` (per-channel averages) is updated."""
    grads = per_sample_grads_exact(model, x, y) if exact else per_sample_grads_batch_norm(model, x, y)
    updates = {}
    for name, u in grads.items():  # u: (n, C, k), each sample's gradient
        n, channels, k = u.shape
        fisher = torch.stack([sum(torch.outer(u[i, c], u[i, c]) for i in range(n)) / n for c in range(channels)])
        previous = running.get(name, torch.eye(k).expand(channels, k, k))
        running[name] = DECAY * previous + (1 - DECAY) * fisher
        grad = u.mean(0)  # the mean loss's gradient
        damped = running[name] + GAMMA * torch.eye(k)
        solved = torch.stack([torch.linalg.solve(damped[c], grad[c]) for c in range(channels)])
        updates[name] = solved / (1 + GAMMA) if method == "inverse" else solved
    return updates


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("net", ["per_sample", "batch_norm"])
def test_norm_update_equals_the_float64_reference(net, method, float64):
    model = per_sample_net() if net == "per_sample" else batch_norm_net()
    reference = copy.deepcopy(model)
    opt = SPDKFACOptimizer(model, norm_layers="kfac", compute_method=method, skip_layers=["Linear", "Conv2d"], **EXACT)
    assert sorted(layer.name for layer in opt.layers) == sorted(_norms(model))
    x, y = _data(8)
    running: dict[str, torch.Tensor] = {}
    for step in range(3):
        xs = x + 0.2 * step
        reference.load_state_dict(model.state_dict())
        before = {name: _stack(m.weight, _bias(m)).detach().clone() for name, m in _norms(model).items()}
        expected = reference_updates(reference, xs, y, running, method, exact=net == "per_sample")
        opt.zero_grad()
        F.cross_entropy(model(xs), y).backward()
        opt.step()
        for name, m in _norms(model).items():
            update = (before[name] - _stack(m.weight, _bias(m)).detach()) / LR
            torch.testing.assert_close(update, expected[name], rtol=1e-9, atol=1e-12, msg=lambda s, n=name, t=step: f"{n} step {t}: {s}")


def test_off_by_default_and_listed_with_the_option_that_covers_them():
    model = batch_norm_net()
    opt = SPDKFACOptimizer(model, lr=0.1)
    assert [type(layer.module) for layer in opt.layers] == [nn.Conv2d, nn.Linear, nn.Linear]
    assert "norm_layers='kfac'" in opt.kfac_summary()
    covered = SPDKFACOptimizer(batch_norm_net(), lr=0.1, norm_layers="kfac")
    assert "100.0%" in covered.kfac_summary()
    with pytest.raises(ValueError, match="norm_layers must be one of"):
        SPDKFACOptimizer(batch_norm_net(), lr=0.1, norm_layers="diagonal")


def test_sync_batch_norm_is_refused_with_its_reason():
    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    opt = SPDKFACOptimizer(model, lr=0.1, norm_layers="kfac")
    assert [type(layer.module) for layer in opt.layers] == [nn.Linear]


def test_checkpoint_resumes_bit_for_bit_and_refuses_the_other_choice():
    x, y = _data(8)

    def run(model: nn.Module, opt: SPDKFACOptimizer, steps: range) -> None:
        for s in steps:
            opt.zero_grad()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()

    straight = per_sample_net()
    opt = SPDKFACOptimizer(straight, lr=0.1, norm_layers="kfac")
    run(straight, opt, range(4))
    resumed = per_sample_net()
    first = SPDKFACOptimizer(resumed, lr=0.1, norm_layers="kfac")
    run(resumed, first, range(2))
    saved, params = first.state_dict(), copy.deepcopy(resumed.state_dict())
    again = per_sample_net()
    again.load_state_dict(params)
    second = SPDKFACOptimizer(again, lr=0.1, norm_layers="kfac")
    second.load_state_dict(copy.deepcopy(saved))
    run(again, second, range(2, 4))
    for key, value in straight.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    with pytest.raises(ValueError, match="different model"):
        SPDKFACOptimizer(per_sample_net(), lr=0.1).load_state_dict(copy.deepcopy(saved))


CONFIGS = {
    "inverse-lbp": dict(compute_method="inverse", placement="lbp"),
    "eigen-seq": dict(compute_method="eigen", placement="seq"),
    "inverse-local-dp": dict(compute_method="inverse", placement="local", distribute_preconditioning=True),
    "ekfac": dict(compute_method="ekfac"),
}


def _train(backend, model: nn.Module, config: dict, global_batch: int) -> dict[str, torch.Tensor]:
    size = 1 if isinstance(backend, str) else backend.size
    rank = 0 if isinstance(backend, str) else backend.rank
    x, y = _data(global_batch)
    local = global_batch // size
    xs, ys = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    opt = SPDKFACOptimizer(model, backend=backend, norm_layers="kfac", lr=0.05, damping=0.01, kl_clip=0.01, **config)
    for s in range(4):
        opt.zero_grad()
        F.cross_entropy(model(xs + 0.1 * s), ys).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_workers_equal_one_on_the_global_batch(name, float64):
    ref = _train("single", per_sample_net(), CONFIGS[name], 12)
    models = [per_sample_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, models[b.rank], CONFIGS[name], 12))
    init = dict(per_sample_net().named_parameters())
    for key, value in ref.items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-9, atol=1e-11)
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert not torch.equal(ref["1.weight"], init["1.weight"])


def test_batch_norm_two_workers_bitwise_replicas():
    """BatchNorm's statistics are each worker's own batch's, so one worker differs; the replicas do not."""
    models = [batch_norm_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, models[b.rank], CONFIGS["inverse-lbp"], 12))
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key]), key


def test_accumulated_micro_batches_equal_one_batch(float64):
    """Two micro-batches of 4 (each forward input kept until its own backward pass) give the batch of 8's step."""
    x, y = _data(8)
    results = []
    for accumulate in (1, 2):
        model = per_sample_net()
        opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, norm_layers="kfac", accumulation_steps=accumulate)
        for s in range(3):
            opt.zero_grad()
            for xm, ym in zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate)):
                (F.cross_entropy(model(xm), ym) / accumulate).backward()
            opt.step()
        results.append(dict(model.named_parameters()))
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=1e-9, atol=1e-12)
