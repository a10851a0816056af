"""Pipelined factor communication: fusion planning and the fusion controller."""
from .controller import TensorFusionController
from .planner import DEFAULT_THRESHOLD_BYTES, FUSION_POLICIES, plan_groups, plan_layerwise, plan_naive, plan_optimal, plan_threshold, simulate_plan

__all__ = [
    "TensorFusionController",
    "FUSION_POLICIES",
    "DEFAULT_THRESHOLD_BYTES",
    "plan_groups",
    "plan_optimal",
    "plan_threshold",
    "plan_layerwise",
    "plan_naive",
    "simulate_plan",
]
