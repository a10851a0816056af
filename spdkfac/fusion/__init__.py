"""Pipelined factor communication: fusion planning and the fusion controller."""
from .controller import TensorFusionController
from .planner import FUSION_POLICIES, plan_groups, plan_layerwise, plan_naive, plan_optimal, plan_threshold, simulate_plan

__all__ = [
    "TensorFusionController",
    "FUSION_POLICIES",
    "plan_groups",
    "plan_optimal",
    "plan_threshold",
    "plan_layerwise",
    "plan_naive",
    "simulate_plan",
]
