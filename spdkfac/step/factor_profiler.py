"""When each factor is ready: measured in the first factor steps, turned into the fusion plan (Eq. 15).

The ``'optimal'`` plan needs each factor's ready time relative to the start
of its pass. The profiler samples them over ``profile_steps`` factor steps
(after one warm-up), takes the median per factor, adopts rank 0's profile on
every rank (plans must be identical, and measured times are not), and hands
the groups of :func:`spdkfac.plan.work_plan.fusion_groups` to the controller. With
``replan_interval`` it samples again every so many factor steps, keeping the
current plan meanwhile, and every rank switches at the same step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from ..comm import CommBackend
from ..config import KFACConfig
from ..kfac.layers import FACTOR_KINDS, FactorKey, KFACLayer
from ..perfmodels import PerfModel
from ..plan.factor_fusion import FusionPolicy
from ..plan.work_plan import fusion_groups
from .factor_allreduce import TensorFusionController

__all__ = ["FusionProfiler"]


class FusionProfiler:
    """Times the factors' ready times until a fusion plan is made, then makes it."""

    def __init__(
        self,
        config: KFACConfig,
        backend: CommBackend,
        layers: Sequence[KFACLayer],
        controller: TensorFusionController,
        perf_model: PerfModel,
    ) -> None:
        self.config = config
        self.backend = backend
        self.layers = list(layers)
        self.controller = controller
        self.perf_model = perf_model
        self.plans_made = 0  # plans made so far (the first, then one per re-profile)
        self.plan_changes = 0  # re-profiles that changed the plan
        self._planned = config.fusion == FusionPolicy.LAYERWISE or not config.precondition
        self._samples: dict[str, list[list[float]]] = {"A": [], "G": []}
        self._ready: dict[str, list[float]] = {"A": [], "G": []}
        self._pass_t0: dict[str, float | None] = {"A": None, "G": None}
        self._factor_steps = 0
        self._sample_after = 1  # factor steps up to this one are not sampled (the first is a warm-up)

    @property
    def active(self) -> bool:
        """Whether this step's factor ready times are being measured for a plan."""
        return not self._planned

    def begin_iteration(self) -> None:
        self._ready = {"A": [], "G": []}
        self._pass_t0 = {"A": None, "G": None}

    def factor_timed(self, kind: str, t_start: float, t_end: float) -> None:
        """A factor of ``kind`` was computed from ``t_start`` to ``t_end`` (its pass starts with the first)."""
        t0 = self._pass_t0[kind]
        if t0 is None:
            t0 = self._pass_t0[kind] = t_start
        self._ready[kind].append(t_end - t0)

    def factor_step_done(self, arrived: dict[str, list[FactorKey]]) -> None:
        """Count a completed factor step (factors in ``arrived`` order); sample, plan or schedule a re-profile."""
        self._factor_steps += 1
        if self.active:
            self._sample_and_plan(arrived)
        elif self.config.replans and self._factor_steps % (self.config.replan_interval or 1) == 0:
            self._planned = False  # sample the next profile_steps factor steps, keeping the current plan meanwhile
            self._sample_after = self._factor_steps

    def _sample_and_plan(self, arrived: dict[str, list[FactorKey]]) -> None:
        if self._factor_steps > self._sample_after:
            for kind in FACTOR_KINDS:
                self._samples[kind].append(list(self._ready[kind]))
        needed = self.config.profile_steps if self.config.fusion == FusionPolicy.OPTIMAL else 0
        if self._factor_steps < self._sample_after + needed:
            return
        dims = {layer.name: layer for layer in self.layers}
        element_size = torch.finfo(self.layers[0].factor_dtype).bits // 8
        plans: dict[str, list[list[FactorKey]]] = {}
        for kind in FACTOR_KINDS:
            order = arrived[kind]
            samples = [s for s in self._samples[kind] if len(s) == len(order)]
            ready = [statistics.median(col) for col in zip(*samples)] if samples else [0.0] * len(order)
            ready = self._agree_on_profile(kind, order, ready)
            sizes = [dims[name].shape(k).packed_size for k, name in order]
            groups = fusion_groups(
                self.config.fusion,
                self.config.pipelining,
                ready,
                sizes,
                self.perf_model.allreduce.alpha,
                self.perf_model.allreduce.beta,
                self.config.fusion_threshold_bytes,
                element_size=element_size,
            )
            plans[kind] = [[order[i] for i in g] for g in groups]
        if self.plans_made and any(self.controller.plan(kind) != plan for kind, plan in plans.items()):
            self.plan_changes += 1
        for kind, plan in plans.items():
            self.controller.set_plan(kind, plan)
        self.plans_made += 1
        self._planned = True
        self._samples = {"A": [], "G": []}

    def _agree_on_profile(self, kind: str, order: list[FactorKey], ready: list[float]) -> list[float]:
        """Every rank adopts rank 0's ready times; the factor order must match everywhere."""
        if self.backend.size == 1:
            return ready
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        payload = torch.tensor(
            [float(index[name]) for _, name in order] + ready, dtype=torch.float64, device=self.layers[0].helper.weight.device
        )  # NCCL broadcasts device tensors only
        self.backend.broadcast_async(payload, 0, f"spdkfac.profile.{kind}").wait()
        n = len(order)
        root_order = [int(v) for v in payload[:n].tolist()]
        if root_order != [index[name] for _, name in order]:
            raise RuntimeError(
                f"the {kind} factors were computed in a different order on rank {self.backend.rank} than on "
                "rank 0; all workers must run the same model graph"
            )
        return [float(v) for v in payload[n:].tolist()]
