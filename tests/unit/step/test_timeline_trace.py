"""The timeline drawn as a trace (Perfetto, ``chrome://tracing``): what each row holds, and that it fits together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.step.timeline import merge_traces

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

FACTORS = {"A 0", "G 0", "A 2", "G 2"}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(opt: SPDKFACOptimizer, model: nn.Module, steps: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _slices(trace: dict[str, Any], row: int) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == row]


def _within(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_one_process_draws_each_iteration_its_factors_and_the_parts_of_its_step(tmp_path: Path):
    model = _net()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", timeline=True, inv_update_freq=2)
    _train(opt, model, 3)
    path = tmp_path / "trace.json"
    assert opt.timeline is not None
    opt.timeline.write_trace(str(path))
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"iterations", "factors (hooks)", "factor all-reduces", "step()"}
    iterations = _slices(trace, 0)
    assert [e["name"] for e in iterations] == ["iteration 0", "iteration 1", "iteration 2"]
    for a, b in zip(iterations, iterations[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3  # one after the other
    for k, iteration in enumerate(iterations):
        factors = [e for e in _slices(trace, 1) if _within(e, iteration)]
        assert {e["name"] for e in factors} == FACTORS
        parts = [e for e in _slices(trace, 3) if _within(e, iteration)]
        counted = {name: sum(e["name"] == name for e in parts) for name in ("precondition", "update", "decompositions")}
        assert counted == {"precondition": 1, "update": 1, "decompositions": int(k % 2 == 0)}
        stage = [e for e in parts if e["name"] == "decompositions"]
        decomposed = [e for e in parts if e["name"].startswith("decompose ")]
        assert {e["name"] for e in decomposed} == ({"decompose A.0", "decompose G.0", "decompose A.2", "decompose G.2"} if stage else set())
        assert all(_within(e, stage[0]) for e in decomposed)
    assert not _slices(trace, 2)  # one process: no all-reduce


def test_two_workers_draw_their_fused_all_reduces_and_merge_into_one_trace():
    models = [_net() for _ in range(2)]

    def run(backend: Any) -> dict[str, Any]:
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, lr=0.1, backend=backend, timeline=True, profile_steps=1)
        _train(opt, model, 4, backend.rank)
        assert opt.timeline is not None
        return opt.timeline.trace(backend.rank)

    traces = run_ranks(2, run, timeout=60)
    for rank, trace in enumerate(traces):
        comm = [e for e in trace["traceEvents"] if e.get("cat") == "factor all-reduce"]
        begins = {e["id"]: e for e in comm if e["ph"] == "b"}
        ends = {e["id"]: e for e in comm if e["ph"] == "e"}
        assert begins.keys() == ends.keys()
        assert all(begins[i]["ts"] <= ends[i]["ts"] for i in begins)
        last = [e for e in begins.values() if e["id"].startswith("3.")]  # the last iteration's all-reduces
        assert sorted(f"{e['name'].split()[1]} {layer}" for e in last for layer in e["args"]["factors"]) == sorted(FACTORS)
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        assert any(e["name"] == "wait: gradients" for e in _slices(trace, 3))
    merged = merge_traces(traces)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert len(merged["traceEvents"]) == sum(len(t["traceEvents"]) for t in traces)
    json.dumps(merged)
