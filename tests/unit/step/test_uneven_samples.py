"""A layer that takes a data-dependent number of samples (tokens routed to an expert) on each worker.

Each worker normalises its factors by its own samples. One worker on the
whole batch weighs every sample alike (``A = Σ n_i A_i / N``), and its
``G`` counts all ``N`` rows while its mean loss makes each output gradient
``1/P`` of a worker's. The workers' sample counts travel in the step's
agreement, and a correction all-reduce after it makes N workers equal one
worker (docs/layers.md). Where that cannot be done exactly (gradient
accumulation; a layer uneven for the first time after even steps) the
layer is named by a warning, and the difference is measured here, so the
warning is about a real difference.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.step.factor_allreduce import TensorFusionController

X = torch.randn(8, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
Y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(4))
#: The sign of column 0 routes a sample to the expert: 3 of worker 0's 4 samples and 1 of worker 1's.
UNEVEN = torch.tensor([1.0, 0.8, 0.7, -0.9, 0.6, -0.5, -0.8, -1.0], dtype=torch.float64)
#: 3 and 2 routed, one at least in each half (a micro-batch under accumulation_steps=2).
ACCUMULATED = torch.tensor([1.0, 0.8, 0.7, -0.9, 0.6, -0.5, 0.8, -1.0], dtype=torch.float64)
#: Under accumulation_steps=2 on 2 workers (micro-batches of 2 samples): 2 and 0 routed on worker 0, 1 and 1 on
#: worker 1, so the expert runs in one of worker 0's micro-batches and both of worker 1's.
SKIPS_A_MICRO_BATCH = torch.tensor([1.0, 0.8, -0.7, -0.9, 0.6, -0.5, 0.8, -1.0], dtype=torch.float64)
#: None of worker 1's samples reaches the expert: it runs on worker 0 only.
ONE_WORKER = torch.tensor([1.0, 0.8, 0.7, -0.9, -0.6, -0.5, -0.8, -1.0], dtype=torch.float64)


class Routed(nn.Module):
    """A body, an 'expert' that only the samples routed to it (by the sign of their first input) pass through, a head."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.route = True
        self.twice = twice  # the expert applied twice to its samples (two calls in a pass)
        self.body = nn.Linear(5, 8)
        self.expert = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        chosen = x[:, 0] > 0 if self.route else torch.ones(len(h), dtype=torch.bool)
        out = h.clone()
        routed = self.expert(h[chosen])
        out[chosen] = out[chosen] + (self.expert(torch.tanh(routed)) if self.twice else routed)
        return self.head(out)


def routed_data(route: torch.Tensor) -> torch.Tensor:
    """The fixed batch with ``route`` as its first column (its sign routes each sample)."""
    x = X.clone()
    x[:, 0] = route
    return x


def train_routed(
    model: Routed,
    backend: Any,
    x: torch.Tensor,
    rows: slice = slice(None),
    steps: int = 3,
    optimized: nn.Module | None = None,
    **options: Any,
) -> list[torch.Tensor]:
    """``steps`` steps on ``x[rows]`` (``model.route`` toggled by ``options['route_from']``: routed from that step
    on); ``optimized``: what the optimizer takes and the batch goes through (the model in DDP), else the model."""
    route_from = options.pop("route_from", 0)
    temperature = nn.Parameter(torch.tensor(1.5)) if options.pop("beside", False) else None  # (a loss's own weight)
    accumulation = options.get("accumulation_steps", 1)
    passes = options.pop("passes", accumulation)  # micro-batches per step: fewer than accumulation_steps, a short window
    no_sync = options.pop("no_sync", False)  # (DDP: every micro-batch but the last inside optimized.no_sync())
    net = model if optimized is None else optimized
    opt = SPDKFACOptimizer(net, lr=0.1, damping=0.01, kl_clip=None, backend=backend, **options)
    if temperature is not None:
        opt.add_param_group({"params": [temperature], "lr": 0.05})
    xs, ys = x[rows].to(torch.get_default_dtype()), Y[rows]
    for s in range(steps):
        model.route = s >= route_from
        opt.zero_grad()
        for m, (xm, ym) in enumerate(zip(xs.chunk(passes), ys.chunk(passes))):
            with net.no_sync() if no_sync and m < passes - 1 and hasattr(net, "no_sync") else contextlib.nullcontext():
                out = net(xm + 0.01 * s) if temperature is None else net(xm + 0.01 * s) * temperature
                (F.cross_entropy(out, ym) / passes).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + ([] if temperature is None else [temperature.detach().clone()])


def _said(run: Any) -> tuple[Any, list[str]]:
    """``run()`` and what it said about uneven samples (recorded here: the warnings of the rank threads too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in caught if "different numbers of samples" in str(w.message)]


def _two_workers(x: torch.Tensor, twice: bool = False, **options: Any) -> tuple[list[list[torch.Tensor]], list[str]]:
    models = [Routed(twice), Routed(twice)]
    return _said(lambda: run_ranks(2, lambda b: train_routed(models[b.rank], b, x, slice(4 * b.rank, 4 * b.rank + 4), **dict(options))))


def _replicas_equal_one_worker(ranks: list[list[torch.Tensor]], single: list[torch.Tensor]) -> None:
    for a, b in zip(ranks[0], ranks[1]):
        assert torch.equal(a, b)
    for a, s in zip(ranks[0], single):
        torch.testing.assert_close(a, s, rtol=1e-10, atol=1e-12)


def _routed_counts(route: torch.Tensor) -> list[int]:
    return [int((route[r] > 0).sum()) for r in (slice(0, 4), slice(4, 8))]


def test_a_routed_layer_equals_one_worker_on_the_whole_batch_and_is_not_said(float64):
    assert _routed_counts(UNEVEN) == [3, 1]
    x = routed_data(UNEVEN)
    single, said_single = _said(lambda: train_routed(Routed(), "single", x))
    ranks, said = _two_workers(x)
    assert said_single == said == []
    _replicas_equal_one_worker(ranks, single)


def test_a_routed_layer_no_sample_of_one_worker_reaches_equals_one_worker(float64):
    assert _routed_counts(ONE_WORKER) == [3, 0]
    x = routed_data(ONE_WORKER)
    single = train_routed(Routed(), "single", x)
    ranks, said = _two_workers(x)
    assert said == []
    _replicas_equal_one_worker(ranks, single)


def test_the_eigen_method_and_no_pipelining_weigh_alike(float64):
    x = routed_data(UNEVEN)
    for options in ({"compute_method": "eigen"}, {"pipelining": False}):
        single = train_routed(Routed(), "single", x, **options)
        ranks, said = _two_workers(x, **options)
        assert said == [], options
        _replicas_equal_one_worker(ranks, single)


def _routed_per_micro_batch(route: torch.Tensor, size: int) -> list[int]:
    return [int((part > 0).sum()) for part in route.split(size)]


@pytest.mark.parametrize("method", ["inverse", "eigen", "ekfac"])
def test_accumulating_micro_batches_is_the_whole_batch_at_once(method, float64):
    """One process, accumulation_steps=2: the expert's micro-batches take 3 and 2 of 4 samples (and 3 and none), and
    its factors are those of all the step's samples at once, so the step is the whole batch's without accumulation.
    (Before, A was the mean of the micro-batches' own, each normalised by its own samples.)"""
    assert _routed_per_micro_batch(ACCUMULATED, 4) == [3, 2]
    assert _routed_per_micro_batch(ONE_WORKER, 4) == [3, 0]
    for x in (routed_data(ACCUMULATED), routed_data(ONE_WORKER)):
        whole = train_routed(Routed(), "single", x, compute_method=method)
        accumulated, said = _said(lambda x=x: train_routed(Routed(), "single", x, accumulation_steps=2, compute_method=method))
        assert said == []
        for a, w in zip(accumulated, whole):
            torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"compute_method": "eigen"}, {"compute_method": "ekfac"}, {"pipelining": False}], ids=str)
def test_two_workers_accumulating_equal_one_worker_on_the_whole_batch(options, float64):
    """2 workers, accumulation_steps=2, micro-batches of 2: the expert takes uneven samples between the workers and
    between the micro-batches, and none of a micro-batch on one worker (it then runs once there, twice on the other:
    before, a use count that differed between the workers was refused, and uneven samples were averaged plainly)."""
    cases = {"uneven": UNEVEN, "accumulated": ACCUMULATED, "skips": SKIPS_A_MICRO_BATCH}
    assert [_routed_per_micro_batch(route, 2) for route in cases.values()] == [[2, 1, 1, 0], [2, 1, 1, 1], [2, 0, 1, 1]]
    for name, route in cases.items():
        x = routed_data(route)
        whole = train_routed(Routed(), "single", x, steps=6, **options)
        ranks, said = _two_workers(x, accumulation_steps=2, steps=6, profile_steps=2, **options)  # (a fusion plan from step 4)
        assert said == [], name
        _replicas_equal_one_worker(ranks, whole)


def test_a_short_window_of_uneven_micro_batches_equals_one_worker(float64):
    """accumulation_steps=3 with 2 micro-batches in a step (an epoch's short last window, each loss divided by 2, a
    first step that takes factors and decompositions): 2 workers equal one worker whose micro-batches are the two
    workers' together."""
    x = routed_data(ACCUMULATED)
    together = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # (worker 0's first micro-batch and worker 1's, then their second)
    single = train_routed(Routed(), "single", x, rows=together, steps=1, accumulation_steps=3, passes=2)  # type: ignore[arg-type]
    ranks, said = _two_workers(x, steps=1, accumulation_steps=3, passes=2)
    assert said == []
    _replicas_equal_one_worker(ranks, single)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_routed_layer_called_twice_in_a_pass_is_named_once_and_differs_from_one_worker(accumulation, float64):
    """Two calls of the expert in a pass: its A is the mean of the calls', not weighed by samples; said once per worker.
    (Every micro-batch routes a sample to it: a layer used several times must run as often on every worker.)"""
    x = routed_data(UNEVEN if accumulation == 1 else ACCUMULATED)
    single = train_routed(Routed(twice=True), "single", x, accumulation_steps=accumulation)
    ranks, said = _two_workers(x, twice=True, accumulation_steps=accumulation)
    assert len(said) == 2, said  # three steps: once on each worker
    for message in said:
        assert "'expert' (" in message
        assert "several calls of the layer in a pass" in message
        assert "'body'" not in message
        assert "'head'" not in message
    assert max(float((a - s).abs().max()) for a, s in zip(ranks[0], single)) > 1e-6
    for a, b in zip(ranks[0], ranks[1]):
        assert torch.equal(a, b)


def test_a_layer_uneven_after_even_steps_is_named_then_weighed_exactly(float64):
    """Its first uneven step finds no local factors kept (an even layer keeps none): said, and it differs; kept from
    then on, so a run uneven from its second step on differs from one worker by that step only."""
    x = routed_data(UNEVEN)
    single = train_routed(Routed(), "single", x, route_from=1)
    ranks, said = _two_workers(x, route_from=1)
    assert len(said) == 2, said
    assert all("for the first time after steps with even samples" in m for m in said), said
    assert max(float((a - s).abs().max()) for a, s in zip(ranks[0], single)) > 1e-6
    for a, b in zip(ranks[0], ranks[1]):
        assert torch.equal(a, b)


def test_every_sample_through_every_layer_is_not_said_and_equals_one_worker(float64):
    x = routed_data(UNEVEN)
    single = train_routed(Routed(), "single", x, route_from=99)
    ranks, said = _two_workers(x, route_from=99)
    assert said == []
    for params in ranks:
        for a, s in zip(params, single):
            torch.testing.assert_close(a, s, rtol=1e-9, atol=1e-11)


def _plans(route: torch.Tensor, accumulation: int, steps: int = 6) -> list[tuple[int, dict[str, Any]]]:
    """2 workers, ``steps`` steps with the 'optimal' fusion profiled over 2 factor steps: the plans made, and the plan."""
    x = routed_data(route)

    def run(backend: Any) -> tuple[int, dict[str, Any]]:
        model = Routed()
        opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend=backend, accumulation_steps=accumulation, profile_steps=2)
        xs, ys = x[4 * backend.rank : 4 * backend.rank + 4], Y[4 * backend.rank : 4 * backend.rank + 4]
        for _ in range(steps):
            opt.zero_grad()
            for xm, ym in zip(xs.chunk(accumulation), ys.chunk(accumulation)):
                (F.cross_entropy(model(xm), ym) / accumulation).backward()
            opt.step()
        return opt.kfac_step.profiler.plans_made, opt.fusion_plan()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_ranks(2, run)


@pytest.mark.parametrize(("route", "accumulation"), [(ONE_WORKER, 1), (SKIPS_A_MICRO_BATCH, 2)], ids=["one-worker", "skips-a-micro-batch"])
def test_the_fusion_plan_is_made_with_a_routed_layer_sent_at_step_on_some_worker(route, accumulation, float64):
    """The expert's factors go at step() on one worker in every step (it ran on the other only, or in one of its
    micro-batches): the plan is still made after the profiled steps, alike on both, with the expert's factors alone.
    (Before, such steps were not sampled, so no plan was ever made and every factor step stayed timed; with
    accumulation the workers then sampled different factors and their profile broadcasts did not match.)"""
    ranks = _plans(route, accumulation)
    assert ranks[0] == ranks[1]
    made, plan = ranks[0]
    assert made == 1
    planned = {key for kind in ("A", "G") for group in plan[kind] for key in group}
    assert planned == {(kind, name) for kind in ("A", "G") for name in ("body", "head")}


def test_the_fusion_plan_of_even_layers_takes_every_factor_in_its_pass_order(float64):
    made, plan = _plans(torch.ones(8), 1)[0]
    assert made == 1
    assert [key for group in plan["A"] for key in group] == [("A", "body"), ("A", "expert"), ("A", "head")]
    assert [key for group in plan["G"] for key in group] == [("G", "head"), ("G", "expert"), ("G", "body")]


def test_the_corrections_of_a_step_travel_in_one_all_reduce(float64, monkeypatch):
    """Each uneven layer's A and G corrections (a mixture of experts has many) go in one fused all-reduce per step."""
    launched: list[list[tuple[str, str]]] = []
    real = TensorFusionController._launch

    def spy(self: TensorFusionController, group: Any) -> None:
        if any(name.endswith("#uneven") for _, name in group.members):
            launched.append(list(group.members))
        real(self, group)

    monkeypatch.setattr(TensorFusionController, "_launch", spy)
    _two_workers(routed_data(UNEVEN))
    assert launched == [[("A", "expert#uneven"), ("G", "expert#uneven")]] * 6  # (3 steps, 2 workers)


@pytest.mark.parametrize("seed", [5, 9, 14, 21, 24, 38])
def test_random_routings_over_workers_and_micro_batches_equal_one_worker(seed, float64, monkeypatch):
    """2 or 3 workers, 1 to 3 micro-batches of 1 or 2 samples, a random share of the samples routed (micro-batches,
    and whole global micro-batches, the expert takes nothing of), a method drawn: over 6 steps (a fusion plan made at
    the fourth) the workers equal one worker whose micro-batches are theirs together, and stay bitwise replicas."""
    rng = random.Random(seed)
    workers, micro, size = rng.choice([2, 3]), rng.choice([1, 2, 3]), rng.choice([1, 2])
    options = rng.choice([{}, {"compute_method": "eigen"}, {"compute_method": "ekfac"}, {"pipelining": False}])
    per = micro * size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(workers * per, 5, generator=g)
    routed = torch.rand(workers * per, generator=g) < rng.choice([0.2, 0.5, 0.8])
    x[:, 0] = torch.where(routed, 1.0, -1.0) * (0.5 + torch.rand(workers * per, generator=g))
    monkeypatch.setattr(sys.modules[__name__], "Y", torch.randint(0, 3, (workers * per,), generator=g))
    together = torch.tensor([w * per + m * size + j for m in range(micro) for w in range(workers) for j in range(size)])
    single = train_routed(Routed(), "single", x, rows=together, steps=6, accumulation_steps=micro, **options)  # type: ignore[arg-type]
    models = [Routed() for _ in range(workers)]
    ranks, said = _said(
        lambda: run_ranks(
            workers,
            lambda b: train_routed(
                models[b.rank], b, x, slice(per * b.rank, per * (b.rank + 1)), steps=6, accumulation_steps=micro, profile_steps=2, **options
            ),
        )
    )
    assert said == []
    for params in ranks[1:]:
        for a, b in zip(ranks[0], params):
            assert torch.equal(a, b)
    for a, s in zip(ranks[0], single):
        torch.testing.assert_close(a, s, rtol=1e-10, atol=1e-12)


def test_micro_batches_of_different_sizes_give_the_pooled_a_and_the_steps_g(float64):
    """A Linear layer under accumulation_steps=2 with micro-batches of 3 and 1 samples (a smaller last one): its A is
    the mean over the 4 inputs, and its G the step loss's n Σ g gᵀ over the 4 output gradients (each micro-batch's
    loss its mean divided by 2), where both were the means of the micro-batches' own."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    opt = SPDKFACOptimizer(layer, lr=0.1, damping=0.01, kl_clip=None, factor_decay=0.0, backend="single", accumulation_steps=2)
    x, y = X[:4], Y[:4]
    outputs: list[torch.Tensor] = []
    for xm, ym in ((x[:3], y[:3]), (x[3:], y[3:])):
        out = layer(xm)
        out.retain_grad()
        outputs.append(out)
        (F.cross_entropy(out, ym) / 2).backward()
    opt.step()
    rows = torch.cat([x, torch.ones(4, 1)], dim=1)  # (the bias column)
    grads = torch.cat([o.grad for o in outputs])  # the step loss's per-sample output gradients
    kfac_layer = opt.layers[0]
    torch.testing.assert_close(kfac_layer.A, rows.T @ rows / 4, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kfac_layer.G, 4 * grads.T @ grads, rtol=1e-12, atol=1e-14)
