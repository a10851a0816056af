"""Pipelined factor communication: fusion planning and the fusion controller."""

from .controller import TensorFusionController
from .planner import (
    DEFAULT_THRESHOLD_BYTES,
    FUSION_POLICIES,
    plan_groups,
    plan_layerwise,
    plan_naive,
    plan_optimal,
    plan_threshold,
    simulate_plan,
)

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "FUSION_POLICIES",
    "TensorFusionController",
    "plan_groups",
    "plan_layerwise",
    "plan_naive",
    "plan_optimal",
    "plan_threshold",
    "simulate_plan",
]
