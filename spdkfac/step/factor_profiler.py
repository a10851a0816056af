"""When each factor is ready: measured in the first factor steps, turned into the fusion plan (Eq. 15).

The ``'optimal'`` plan needs each factor's ready time relative to the start
of its pass. The profiler samples them over ``profile_steps`` factor steps
(after one warm-up), takes the median per factor, adopts rank 0's profile on
every rank (plans must be identical, and measured times are not), and hands
the groups of :func:`spdkfac.plan.work_plan.fusion_groups` to the controller. With
``replan_interval`` it samples again every so many factor steps, keeping the
current plan meanwhile, and every rank switches at the same step.

Only the factors sent from their hooks at their expected call in every sampled
step on every worker are planned (fused); the others go alone. A layer that
runs on some workers or micro-batches only (a routed expert, a skipped head)
is sent at ``step()`` in some steps, and its time would not be where it
arrives; the steps it is irregular in still count, so that a plan is made
after ``profile_steps`` factor steps whatever the layers do.
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
        self._samples: dict[str, list[dict[FactorKey, float]]] = {"A": [], "G": []}
        self._ready: dict[str, dict[FactorKey, float]] = {"A": {}, "G": {}}
        self._pass_t0: dict[str, float | None] = {"A": None, "G": None}
        self._factor_steps = 0
        self._sample_after = 1  # factor steps up to this one are not sampled (the first is a warm-up)

    @property
    def active(self) -> bool:
        """Whether this step's factor ready times are being measured for a plan."""
        return not self._planned

    def begin_iteration(self) -> None:
        self._ready = {"A": {}, "G": {}}
        self._pass_t0 = {"A": None, "G": None}

    def factor_timed(self, key: FactorKey, t_start: float, t_end: float) -> None:
        """Factor ``key`` was computed from ``t_start`` to ``t_end`` (its pass starts with the first of its kind)."""
        kind = key[0]
        t0 = self._pass_t0[kind]
        if t0 is None:
            t0 = self._pass_t0[kind] = t_start
        self._ready[kind][key] = t_end - t0

    def factor_step_done(self, irregular: set[FactorKey]) -> None:
        """Count a completed factor step; sample (leaving out the ``irregular`` factors: not sent at their expected
        call from their hooks on every worker), plan or schedule a re-profile."""
        self._factor_steps += 1
        if self.active:
            self._sample_and_plan(irregular)
        elif self.config.replans and self._factor_steps % (self.config.replan_interval or 1) == 0:
            self._planned = False  # sample the next profile_steps factor steps, keeping the current plan meanwhile
            self._sample_after = self._factor_steps

    def _sample_and_plan(self, irregular: set[FactorKey]) -> None:
        if self._factor_steps > self._sample_after:
            for kind in FACTOR_KINDS:
                self._samples[kind].append({key: t for key, t in self._ready[kind].items() if key not in irregular})
        needed = self.config.profile_steps if self.config.fusion == FusionPolicy.OPTIMAL else 0
        if self._factor_steps < self._sample_after + needed:
            return
        dims = {layer.name: layer for layer in self.layers}
        element_size = torch.finfo(self.layers[0].factor_dtype).bits // 8
        plans: dict[str, list[list[FactorKey]]] = {}
        for kind in FACTOR_KINDS:
            # (a policy that needs no times plans at the warm-up step, from the factors every worker sent from its hooks)
            order, ready = self._agree_on_profile(kind, self._samples[kind] or [self._ready[kind]])
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

    def _agree_on_profile(self, kind: str, samples: list[dict[FactorKey, float]]) -> tuple[list[FactorKey], list[float]]:
        """The factors to plan, in the order they become ready, and their ready times, alike on every rank.

        A factor is planned when every sampled step timed it on every rank;
        its time is rank 0's median, and the order is by that time (then by
        rank 0's last arrival order, which the times follow where the
        arrivals keep one order).
        """
        latest = {key: i for i, key in enumerate(samples[-1])} if samples else {}
        median, position, steady = [], [], []
        for layer in self.layers:
            key = (kind, layer.name)
            times = [step[key] for step in samples if key in step]
            steady.append(float(bool(samples) and len(times) == len(samples)))
            median.append(statistics.median(times) if times else 0.0)
            position.append(float(latest.get(key, len(latest))))
        if self.backend.size > 1:
            device = self.layers[0].helper.weight.device  # (NCCL reduces device tensors only)
            profile = torch.tensor(median + position, dtype=torch.float64, device=device)
            everywhere = torch.tensor(steady, dtype=torch.float64, device=device)
            self.backend.broadcast_async(profile, 0, f"spdkfac.profile.{kind}").wait()
            self.backend.allreduce_async(everywhere, f"spdkfac.profile.steady.{kind}").wait()  # (the mean: 1 where all)
            n = len(self.layers)
            median, position, steady = profile[:n].tolist(), profile[n:].tolist(), everywhere.tolist()
        planned = sorted((i for i in range(len(self.layers)) if steady[i] == 1.0), key=lambda i: (median[i], position[i], i))
        return [(kind, self.layers[i].name) for i in planned], [median[i] for i in planned]
