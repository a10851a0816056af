"""Layers used several times per step, activation checkpointing, and layers that skip a step (one process and in-process ranks).

The factors of a layer used ``k`` times are checked against a float64
reference written here from the definition (the "expand" setting: ``A`` the
mean of the uses' input Grams, ``G`` the sum of their output-gradient Grams),
from inputs and output gradients captured by this file's own hooks.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import CHECKPOINTS, assert_bitwise_equal, batch, shared_net

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """The aux head runs on odd steps only (on every worker)."""
    return F.cross_entropy(model(x + 0.1 * step, aux=step % 2 == 1), y)


def _capture(model: nn.Module) -> dict[int, list[tuple[torch.Tensor, list[torch.Tensor]]]]:
    """Each use of every Linear/Conv2d: (input, [output gradient]) by module id, from plain torch hooks."""
    seen: dict[int, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        grads: list[torch.Tensor] = []
        seen.setdefault(id(module), []).append((inputs[0].detach().clone(), grads))
        output.register_hook(lambda g: grads.append(g.detach().clone()))

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            module.register_forward_hook(hook)
    return seen


def _rows(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer-input rows (ones column for the bias) and the positions per sample sharing the weight."""
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(x, module.kernel_size, padding=module.padding)  # (n, C*k*k, L)
        positions = patches.shape[2]
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        rows, positions = x.reshape(-1, x.shape[-1]), 1
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1), positions


def _reference(module: nn.Module, uses: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The expand factors of a module used ``k`` times: A = mean over uses of Σ(a/S)(a/S)^T/n, G = Σ over uses of
    Σ(nSg)(nSg)^T/(nS), with g the output gradient of the batch-mean loss."""
    a_terms, g_terms = [], []
    for x, grads in uses:
        (g,) = grads
        n = x.shape[0]
        rows, s = _rows(module, x)
        a_terms.append((rows / s).T @ (rows / s) / n)
        g_rows = g.transpose(1, -1).reshape(-1, g.shape[1]) if g.dim() == 4 else g.reshape(-1, g.shape[-1])
        g_terms.append((n * s * g_rows).T @ (n * s * g_rows) / (n * s))
    return torch.stack(a_terms).mean(0), torch.stack(g_terms).sum(0)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_factors_of_layers_used_k_times_are_the_expand_factors(accumulate, float64):
    """With micro-batches the factors are the mean of each micro-batch's (its loss's 1/accumulate divided out of g)."""
    model = shared_net()
    config = dict(KW, factor_decay=0.0, accumulation_steps=accumulate)  # the running averages are the batch factors
    opt = SPDKFACOptimizer(model, backend="single", **config)
    names = {layer.name: layer for layer in opt.layers}
    assert len(names["trunk.1"].modules) == 2  # the tied modules are one layer
    assert "trunk.3" not in names
    seen = _capture(model)
    x, y = batch(8)
    uses = {"conv": 2, "proj": 2, "trunk.0.cell": 3, "trunk.1": 2, "head": 1}
    for step in range(3):  # step 0 learns the uses (calls beyond one folded in at step()), the next ones expect them
        opt.zero_grad()
        refs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in uses}
        for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)):
            seen.clear()
            (_loss(model, xm, ym, step) / accumulate).backward()
            for name, k in uses.items():
                layer = names[name]
                captured = [(a, [g * accumulate for g in gs]) for module in layer.modules for a, gs in seen[id(module)]]
                assert len(captured) == k, name
                refs[name].append(_reference(layer.module, captured))
        opt.step()
        for name, pairs in refs.items():
            layer = names[name]
            a_ref, g_ref = (torch.stack([pair[i] for pair in pairs]).mean(0) for i in (0, 1))
            torch.testing.assert_close(layer.A, a_ref, rtol=1e-12, atol=1e-13, msg=lambda m, n=name, s=step: f"A of {n}, step {s}: {m}")
            torch.testing.assert_close(layer.G, g_ref, rtol=1e-12, atol=1e-13, msg=lambda m, n=name, s=step: f"G of {n}, step {s}: {m}")
        assert (opt.kfac_step.factors.irregular == set()) == (step > 0), step  # step 0 learns the uses


def test_a_module_called_twice_and_tied_modules_train_alike(float64):
    """Two modules tied to one weight and bias are the same layer as one module called twice: bitwise the same training."""

    class Twice(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.first, self.out = nn.Linear(4, 4), nn.Linear(4, 3)
            self.second = nn.Linear(4, 4) if tie else self.first
            if tie:
                self.second.weight, self.second.bias = self.first.weight, self.first.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))

    results = []
    for tie in (False, True):
        model = Twice(tie)
        opt = SPDKFACOptimizer(model, backend="single", **KW)
        assert [layer.name for layer in opt.layers] == ["first", "out"]
        for step in range(4):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(6, 4, generator=torch.Generator().manual_seed(step))), torch.arange(6) % 3).backward()
            opt.step()
        results.append({k: v.clone() for k, v in model.state_dict().items() if k.startswith(("first", "out"))})
    assert_bitwise_equal(results[0], results[1], "tied vs called twice")


def test_tied_weights_that_cannot_be_one_layer_are_left_out_naming_why():
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[2].weight = model[0].weight  # tied weight, separate biases
    with pytest.warns(UserWarning, match=r"shared by \['0.weight', '2.weight'\] \(tied weights\).*own bias"):
        opt = SPDKFACOptimizer(model, lr=0.05, backend="single")
    assert [layer.name for layer in opt.layers] == ["4"]
    emb, out = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
    out.weight = emb.weight  # a language model's tied embedding and output layer: one layer (test_tied_embedding.py)
    lm = nn.Sequential(emb, nn.Linear(4, 4), out, nn.Linear(4, 6))
    lm[3].weight = emb.weight  # ... but a second output layer with its own bias is not
    with pytest.warns(UserWarning, match=r"'3' is a different layer"):
        opt = SPDKFACOptimizer(lm, lr=0.05, backend="single")
    assert [layer.name for layer in opt.layers] == ["1"]
    assert "1 x Embedding, 2 x Linear: its weight is shared by ['0.weight', '2.weight', '3.weight'] (tied weights)" in opt.kfac_summary()
    skipped_one = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2))
    skipped_one[1].weight, skipped_one[1].bias = skipped_one[0].weight, skipped_one[0].bias
    with pytest.warns(UserWarning, match=r"'1' is in skip_layers but '0' is not"):
        opt = SPDKFACOptimizer(skipped_one, lr=0.05, backend="single", skip_layers=["1"])
    assert [layer.name for layer in opt.layers] == ["2"]


@pytest.mark.parametrize("mode", CHECKPOINTS[1:])
def test_checkpointed_trunk_equals_the_plain_model(mode, float64):
    x, y = batch(8)
    results = []
    for checkpoint_mode in (None, mode):
        model = shared_net(checkpoint_mode=checkpoint_mode)
        opt = SPDKFACOptimizer(model, backend="single", **KW)
        for step in range(4):
            opt.zero_grad()
            _loss(model, x, y, step).backward()
            opt.step()
        results.append((model.state_dict(), {layer.name: (layer.A, layer.G) for layer in opt.layers}))
    for key, value in results[0][0].items():
        torch.testing.assert_close(results[1][0][key], value, rtol=1e-12, atol=1e-14, msg=lambda m, k=key: f"{mode}/{k}: {m}")
    for name, (a, g) in results[0][1].items():
        torch.testing.assert_close(results[1][1][name][0], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(results[1][1][name][1], g, rtol=1e-12, atol=1e-14)


def test_a_layer_that_does_not_run_keeps_its_factors_and_decompositions(float64):
    model = shared_net()
    opt = SPDKFACOptimizer(model, backend="single", **KW)
    aux = next(layer for layer in opt.layers if layer.name == "aux")
    x, y = batch(8)
    for step in range(5):
        before = {k: v.clone() for k, v in model.aux.state_dict().items()}
        kept = (aux.packed_factor("A"), aux.packed_factor("G"), aux.decomposition("A"), aux.decomposition("G"))
        kept = tuple(None if t is None else t.clone() for t in kept)
        opt.zero_grad()
        _loss(model, x, y, step).backward()
        opt.step()
        assert opt.kfac_step.factors.skipped == ([] if step % 2 else ["aux"]), step
        if step % 2 == 0:  # the aux head did not run: no gradient, no update, its factors and decompositions kept
            assert_bitwise_equal(model.aux.state_dict(), before, f"aux parameters, step {step}")
            if step == 0:  # never ran yet: the identity the running averages start from
                torch.testing.assert_close(aux.A, torch.eye(7))
            else:
                now = (aux.packed_factor("A"), aux.packed_factor("G"), aux.decomposition("A"), aux.decomposition("G"))
                assert_bitwise_equal(list(now), list(kept), f"aux factors and decompositions, step {step}")
        else:
            assert not torch.equal(model.aux.weight, before["weight"])


def _train_shared(backend: object, model: nn.Module, global_batch: int, steps: int, config: dict) -> dict[str, torch.Tensor]:
    """Train ``model`` (built outside the rank threads: seeding is process-wide) on this rank's shard."""
    x, y = batch(global_batch)
    size = 1 if isinstance(backend, str) else backend.size  # type: ignore[attr-defined]
    rank = 0 if isinstance(backend, str) else backend.rank  # type: ignore[attr-defined]
    local = global_batch // size
    opt = SPDKFACOptimizer(model, backend=backend, **config)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local], step).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CONFIGS = {
    "optimal": dict(KW, fusion="optimal"),
    "threshold-no-pipelining": dict(KW, fusion="threshold", pipelining=False),
    "naive-eigen-lbp": dict(KW, fusion="naive", compute_method="eigen", placement="lbp"),
    "update-fusion-forward": dict(KW, update_fusion="forward"),
    "update-fusion-backward-freq-3": dict(KW, kl_clip=None, update_fusion="backward", inv_update_freq=3),
    "dp-lbp": dict(KW, placement="lbp", distribute_preconditioning=True),
}


#: (checkpoint mode, configuration): every configuration without checkpointing; with it, the two that meet the
#: recomputation (the others do not, and one model is enough for them).
SHARED_CASES = [(None, name) for name in CONFIGS] + [
    pytest.param(mode, name, marks=pytest.mark.slow)
    for mode in ("non-reentrant", "reentrant")
    for name in ("optimal", "threshold-no-pipelining")
]


@pytest.mark.parametrize(("checkpoint_mode", "name"), SHARED_CASES)
def test_two_workers_equal_one_with_shared_checkpointed_and_skipped_layers(checkpoint_mode, name, float64):
    config = CONFIGS[name]
    ref = _train_shared("single", shared_net(checkpoint_mode=checkpoint_mode), 12, 6, config)
    models = [shared_net(checkpoint_mode=checkpoint_mode) for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train_shared(b, models[b.rank], 12, 6, config))
    for key, value in ref.items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key: f"{name}/{k}: {m}")
    assert_bitwise_equal(ranks[1], ranks[0], f"{name}: rank 1 vs rank 0")


def _saved(obj: object) -> object:
    """``obj`` through ``torch.save``/``torch.load`` (a checkpoint on disk, nothing shared with the live run)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_a_resumed_run_with_shared_layers_is_the_uninterrupted_run(float64, old_checkpoint):
    """The learned use counts are saved: 3 steps, a checkpoint, 3 more steps in a fresh optimizer give the 6-step
    run bitwise. A checkpoint without them (made before they were saved) still loads, and learns them again."""
    x, y = batch(8)
    ref_model = shared_net()
    ref_opt = SPDKFACOptimizer(ref_model, backend="single", **KW)
    for step in range(6):
        ref_opt.zero_grad()
        _loss(ref_model, x, y, step).backward()
        ref_opt.step()
    model = shared_net()
    opt = SPDKFACOptimizer(model, backend="single", **KW)
    for step in range(3):
        opt.zero_grad()
        _loss(model, x, y, step).backward()
        opt.step()
    checkpoint = _saved({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert isinstance(checkpoint, dict)
    if old_checkpoint:
        for entry in checkpoint["optimizer"]["kfac"]["layers"].values():
            entry.pop("uses", None)
    resumed = shared_net(seed=1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = SPDKFACOptimizer(resumed, backend="single", **KW)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    for step in range(3, 6):
        resumed_opt.zero_grad()
        _loss(resumed, x, y, step).backward()
        resumed_opt.step()
    if old_checkpoint:  # learned again in the first factor step: equal up to rounding
        for key, value in ref_model.state_dict().items():
            torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-10, atol=1e-12)
    else:
        assert_bitwise_equal(resumed.state_dict(), ref_model.state_dict(), "parameters")
        assert_bitwise_equal(resumed_opt.state_dict()["kfac"]["layers"], ref_opt.state_dict()["kfac"]["layers"], "K-FAC state")
