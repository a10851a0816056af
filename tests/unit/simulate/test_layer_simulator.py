"""The simulator profiles and plans grouped and depthwise convolutions as the optimizer does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from spdkfac.perfmodels import PerfModel
from spdkfac.plan.work_plan import WorkPlan
from spdkfac.simulate import load_profiles, predict
from spdkfac.simulate.prediction import _layer_shapes
from spdkfac.simulate.profile_file import profile_from_dict
from spdkfac.simulate.profiling import measure_profile


@pytest.mark.slow
def test_profile_records_blocks_and_prediction_plans_like_the_optimizer():
    profile = measure_profile("mobilenet_v2_32", resolution=32, batch_size=2, iters=1)
    blocks = {f.key: f.blocks for f in profile.factors}
    assert max(blocks.values()) == 960  # the last depthwise layer: one block per channel
    assert any(p.blocks > 1 for p in profile.precondition)
    again = profile_from_dict(json.loads(json.dumps(profile.to_dict())))  # as the file stores it
    assert again.factors == profile.factors  # blocks survive the file
    perf = PerfModel.default()
    shapes = _layer_shapes(again)
    plan = WorkPlan.make(shapes, 2, perf.scaled_to(2), "lbp", "inverse")
    grouped = [s for s in shapes if s.blocks > 1]
    assert len(grouped) == 17
    for s in grouped:  # each grouped factor is one task, costed as a batched decomposition
        a = next(x for x in plan.inversion.assignments if x.key == ("A", s.name))
        assert a.t_comp > perf.inverse(s.a_dim)
    result = predict(again, perf, 2, "spdkfac")
    assert result["InverseComp"] > 0


def test_a_layer_recorded_without_preconditioning_is_not_planned():
    """A tied embedding's factors are sent (its factor entries stay) but it preconditions nothing: the profile
    records no preconditioning for it, and the prediction plans the layers that precondition, as the optimizer."""
    profile = load_profiles([str(Path(__file__).parents[3] / "benchmarks/results/profile_resnet50.json")])
    names = [p.layer for p in profile.precondition]
    assert [s.name for s in _layer_shapes(profile)] == names
    first = names[0]
    fewer = dataclasses.replace(profile, precondition=tuple(p for p in profile.precondition if p.layer != first))
    assert [s.name for s in _layer_shapes(fewer)] == names[1:]
    assert any(f.layer == first for f in fewer.factors)
