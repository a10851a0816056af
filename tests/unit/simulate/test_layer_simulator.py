"""The simulator profiles and plans grouped and depthwise convolutions as the optimizer does."""

from __future__ import annotations

import json

import pytest

from spdkfac.perfmodels import PerfModel
from spdkfac.plan.work_plan import WorkPlan
from spdkfac.simulate import predict
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
