"""Predicted iteration time and its breakdown: the optimizer's decisions plus the profile's costs.

Every decision is the optimizer's own function from :mod:`spdkfac.plan.work_plan`
(fusion groups and their launch times, the inversion placement, who
preconditions each layer, when preconditioning overlaps the gradient
all-reduces); communication runs on one engine queue
(:func:`spdkfac.plan.factor_fusion.serve_in_order`). This module only adds the
costs: the profile's measured times and the fitted models at P workers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..config import KFACConfig
from ..kfac.factor_shape import FactorKind
from ..kfac.methods import ComputeMethod, get_method
from ..perfmodels import PerfModel
from ..plan.factor_fusion import DEFAULT_THRESHOLD_BYTES, serve_in_order
from ..plan.grad_worker_choice import GradWorkerProblem, plan_memory, result_broadcast_seconds
from ..plan.placement import ALL, PlacementPlan
from ..plan.work_plan import LayerShape, WorkPlan, fusion_groups, group_launch_times, overlaps_preconditioning
from ..variants import variant_config
from .profile_file import FactorProfile, LayerPreconditionProfile, Profile
from .scaling import ScaledModels

__all__ = [
    "PARTS",
    "PART_OF_PHASE",
    "PHASES",
    "SIMULATED_SUBGROUPS",
    "communication_scale",
    "expected_max_normal",
    "iteration_lag_share",
    "parts_of_phases",
    "predict",
    "predict_memory",
    "predict_phases",
    "rank_lag",
    "simulated_work_plan",
]

#: The simulated engine broadcasts to sub-groups of ranks (torch.distributed, NCCL), as KAISA assumes.
SIMULATED_SUBGROUPS = True

PARTS = ["FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other"]

#: The finer breakdown :func:`predict_phases` gives: :data:`PARTS` with the hooks' own work (beyond computing the
#: factors) taken out of FF&BP, and the preconditioning and the base update out of Other, as the optimizer's timeline
#: records them (``IterationRecord.hooks``, ``precondition``, ``update``).
PHASES = ["FF&BP", "Hooks", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Precondition", "Update", "Other"]

#: The part of :data:`PARTS` each phase of :data:`PHASES` belongs to (a phase not named here is its own part).
PART_OF_PHASE = {"Hooks": "FF&BP", "Precondition": "Other", "Update": "Other"}


def predict(
    profile: Profile, perf: PerfModel, workers: int, variant: str, contention: bool = False, update_freq: tuple[int, int] = (1, 1)
) -> dict[str, float]:
    """Predicted seconds per iteration and its breakdown (:data:`PARTS`) for ``variant`` on ``workers`` workers."""
    return parts_of_phases(predict_phases(profile, perf, workers, variant, contention, update_freq))


def parts_of_phases(phases: Mapping[str, float]) -> dict[str, float]:
    """The :data:`PARTS` breakdown (and ``iteration``) of a :data:`PHASES` breakdown: each phase added to its part."""
    parts = dict.fromkeys(PARTS, 0.0)
    for phase in PHASES:
        parts[PART_OF_PHASE.get(phase, phase)] += phases[phase]
    return {"iteration": phases["iteration"], **parts}


def predict_phases(
    profile: Profile, perf: PerfModel, workers: int, variant: str, contention: bool = False, update_freq: tuple[int, int] = (1, 1)
) -> dict[str, float]:
    """Predicted seconds per iteration and its finer breakdown (:data:`PHASES`) for ``variant`` on ``workers`` workers.

    FF&BP is plain SGD's passes on steps that compute no factors, and the
    K-FAC passes' own work (less the factors and the hooks) on factor steps:
    computing factors slows the passes around them (the caches they evict),
    which version-3 profiles measure as the difference. Under ``contention``
    the communication's own seconds are paid once, on the worker's core
    (:func:`_blocked_communication`): what runs while the passes compute
    stretches FF&BP, Hooks and FactorComp (in proportion to their seconds),
    what is left after them is waited for. Plain SGD at the profiled worker
    count keeps its measured passes and wait.

    Profiles from before version 3 did not time the hooks, the preconditioning
    in ``step()``, the update and plain SGD's passes without communication
    apart: their hooks are charged inside FF&BP (on every step, and the
    contention ratio's base is the K-FAC passes, as before), the
    preconditioning at the per-layer times and the update inside Other.
    """
    if not isinstance(profile, Profile):  # callers from before typed profiles passed the file's dict
        raise TypeError(f"predict takes a Profile (load_profiles or profile_from_dict), got {type(profile).__name__}")
    m = ScaledModels(perf, workers)
    cfg = variant_config(variant)
    fwd, bwd = profile.forward, profile.backward
    facs = profile.factors
    kfac = bool(cfg.get("precondition", True))
    f_freq, i_freq = update_freq
    f_share = 1.0 / f_freq if kfac else 0.0
    i_share = 1.0 / i_freq if kfac else 0.0
    factor_compute = sum(f.compute for f in facs)
    hooks = profile.hooks or 0.0  # the hooks' own work in a factor pass (one worker: no packing, no launches)
    passes = fwd + bwd - factor_compute - hooks  # the passes' own work on a factor step (caches the factors evicted)
    plain = profile.sgd_forward_backward_local  # ... and on any other step: plain SGD's (older profiles: as above)
    if plain is None:
        plain = passes
    scale = communication_scale(profile, perf) if contention else 1.0
    # Factor steps send the factor all-reduces beside the gradients'; the other steps send the gradients' alone
    # (with pipelining the factor groups go out during backward and can hold back the gradients behind them).
    grad_blocked, factor_blocked, grad_stretch, factor_stretch = _blocked_communication(profile, cfg, m, contention, scale)
    if kfac and f_share < 1.0:
        plain_blocked, _, plain_stretch, _ = _blocked_communication(profile, cfg, m, contention, scale, factors=False)
        grad_blocked = plain_blocked * (1.0 - f_share) + grad_blocked * f_share
        grad_stretch = plain_stretch * (1.0 - f_share) + grad_stretch * f_share
    plan = _work_plan(profile, cfg, m, i_freq) if kfac else None
    inverse_comp = inverse_comm = concurrent_inversions = 0.0
    if plan is not None:
        method = cfg.get("compute_method", "inverse")
        inverse_comp, inverse_comm, concurrent_inversions = _inversion_stage(plan, facs, m, contention, method)
    step_parts = _step_parts(profile, kfac)
    phases = {
        # The profile computes factors in every pass; they are charged once, as FactorComp, at their share.
        "FF&BP": plain * (1.0 - f_share) + passes * f_share,
        "Hooks": hooks * f_share,
        "GradComm": grad_blocked if workers > 1 else 0.0,
        "FactorComp": factor_compute * f_share,
        "FactorComm": factor_blocked * f_share,
        "InverseComp": inverse_comp * i_share,
        "InverseComm": inverse_comm * i_share,
        **step_parts,
    }
    _stretch_passes(phases, grad_stretch + factor_stretch * f_share)
    if not kfac and workers > 1 and profile.comm_workers == workers:
        # At the profiled worker count, plain SGD's gradient wait was measured with the real all-reduces;
        # profiles from before it was recorded apart hold it inside sgd_step (their sgd_grad_wait is 0).
        phases["GradComm"] = profile.sgd_grad_wait
        if contention and profile.sgd_forward_backward is not None:  # ... and its passes, slowed by them
            phases["FF&BP"] = profile.sgd_forward_backward
    if kfac:
        # Unpacking that older profiles timed only in total: every factor once, on every rank (0 otherwise).
        phases["InverseComp"] += profile.untimed_unpack * i_share
        # Packing each batch factor: the profile (one process, factors every step) packs them in step(), folding
        # them into the running averages; only factor steps pack, and with pipelining on several workers each
        # hook packs its factor into the fused buffer during the passes (the hooks' own cost).
        packing = min(phases["Other"], sum(f.pack for f in facs))
        phases["Other"] -= packing * (1.0 - f_share)
        if workers > 1 and cfg["pipelining"]:
            phases["Other"] -= packing * f_share
            phases["Hooks"] += packing * f_share
    if plan is not None and workers > 1 and plan.groups is not None:
        phases["Precondition"] += _distributed_precondition_change(profile, plan, m)
    grad_share, factor_share = _overlap_shares(bool(cfg.get("overlap_preconditioning", True)), kfac, workers, f_share, i_share)
    if not contention and (grad_share or factor_share):
        # On steps that keep the inverses, the preconditioning of the layers whose gradients have arrived
        # runs while the rest are still averaged: the blocked wait shrinks by up to this rank's preconditioning.
        busy = _preconditioning_busy(profile, plan)
        hidden = min(phases["GradComm"], busy)
        phases["GradComm"] -= hidden * grad_share
        # Factor steps that keep the inverses precondition before waiting for the factor all-reduces, so what
        # is left of the preconditioning hides factor communication too (inverse steps are factor steps).
        phases["FactorComm"] -= min(factor_blocked, busy - hidden) * factor_share
    _add_rank_lag(phases, profile, plan, workers, kfac, concurrent_inversions * i_share)
    return {"iteration": sum(phases[k] for k in PHASES) + 0.0, **{k: phases[k] + 0.0 for k in PHASES}}  # no "-0.0"


def _stretch_passes(phases: dict[str, float], stretch: float) -> None:
    """Spread ``stretch`` seconds of communication that ran during the passes over their phases, by their seconds.

    Under contention the engine's work takes the worker's core from whatever
    it computes at the time: the passes' own work, the hooks and the factors
    alike (0 without contention or communication).
    """
    computing = ("FF&BP", "Hooks", "FactorComp")
    total = sum(phases[k] for k in computing)
    if stretch <= 0.0 or total <= 0.0:
        return
    for k in computing:
        phases[k] += stretch * phases[k] / total


def _step_parts(profile: Profile, kfac: bool) -> dict[str, float]:
    """``step()`` on one worker, split as the timeline records it: (Precondition, Update, Other) seconds.

    K-FAC: the profile's ``step_other`` (running averages, packing,
    preconditioning, update) less its timed preconditioning and update.
    Plain SGD: ``sgd_step`` less its update. Profiles without those times
    (before version 3) charge the per-layer preconditioning times and keep
    the update inside Other.
    """
    if not kfac:
        total = _sgd_step(profile)
        update = min(total, profile.sgd_update or 0.0)
        return {"Precondition": 0.0, "Update": update, "Other": total - update}
    total = profile.step_other
    timed = profile.precondition_step
    precondition = min(total, timed if timed is not None else sum(p.seconds for p in profile.precondition))
    update = min(total - precondition, profile.update or 0.0)
    return {"Precondition": precondition, "Update": update, "Other": total - precondition - update}


def simulated_work_plan(
    profile: Profile, perf: PerfModel, workers: int, variant: str, update_freq: tuple[int, int] = (1, 1)
) -> WorkPlan | None:
    """The work plan :func:`predict` charges for ``variant`` on ``workers`` workers (None for plain SGD).

    The optimizer makes its own with :meth:`WorkPlan.make` from its layers
    and ``perf.for_world_size(workers)``; a test holds the two equal.
    """
    cfg = variant_config(variant)
    return _work_plan(profile, cfg, ScaledModels(perf, workers), update_freq[1]) if cfg.get("precondition", True) else None


def _work_plan(profile: Profile, cfg: Mapping[str, Any], m: ScaledModels, inv_update_freq: int = 1) -> WorkPlan:
    """The optimizer's plan: its gradient workers resolved by its own function (``'auto'`` included)."""
    shapes = _layer_shapes(profile)
    # The method as the optimizer configures it (a warm eigenbasis refresh is costed with its own curve).
    method = get_method(cfg.get("compute_method", "inverse"), KFACConfig.from_options(cfg))
    problem = GradWorkerProblem(
        shapes, m.workers, m.scaled, cfg["placement"], method, SIMULATED_SUBGROUPS,
        inv_update_freq=inv_update_freq, overlap_preconditioning=bool(cfg.get("overlap_preconditioning", True)),
    )  # fmt: skip
    grad_workers, choice = problem.resolve(
        cfg.get("grad_worker_fraction"), bool(cfg.get("distribute_preconditioning", False)), cfg.get("memory_budget")
    )
    if choice is not None:
        return choice.plan
    return WorkPlan.make(
        shapes, m.workers, m.scaled, cfg["placement"], method, grad_workers=grad_workers, native_subgroups=SIMULATED_SUBGROUPS,
        inv_update_freq=inv_update_freq,
    )  # fmt: skip


def predict_memory(profile: Profile, perf: PerfModel, workers: int, variant: str, update_freq: tuple[int, int] = (1, 1)) -> list[int]:
    """Bytes of K-FAC state (float32 running factors and decompositions) on each of ``workers`` workers for ``variant``."""
    cfg = variant_config(variant)
    if not cfg.get("precondition", True):
        return [0] * workers
    plan = _work_plan(profile, cfg, ScaledModels(perf, workers), update_freq[1])
    return plan_memory(plan, cfg.get("compute_method", "inverse"))


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normal values] (0 for one; 0.564 for two, 2.34 for 64)."""
    if n < 2:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-10_000, 10_001):
        x = i * step
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += x * n * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (n - 1) * step
    return total


def rank_lag(totals: Sequence[float], workers: int) -> float:
    """How much longer than the mean rank the slowest of ``workers`` ranks takes, as a share of the mean.

    ``totals`` are the profiled ranks' own times of the same work, measured
    at once (:attr:`Profile.rank_passes`, ...): their slowest lags their
    mean by ``(max - mean) / mean``. Taking the ranks' times as independent
    normal draws, the expected lag of the slowest of P ranks grows as
    :func:`expected_max_normal` (P), so the measured lag is scaled by
    ``E[max of P] / E[max of W]`` for W profiled ranks. 0 with fewer than two
    profiled ranks (nothing measured) or for one worker (nobody waits).
    """
    if len(totals) < 2 or workers < 2:
        return 0.0
    mean = sum(totals) / len(totals)
    if mean <= 0:
        return 0.0
    return _lag_at(workers, (max(totals) - mean) / mean, len(totals))


def _lag_at(workers: int, lag: float, profiled: int) -> float:
    """``lag`` measured over ``profiled`` ranks, for ``workers``: as the expected maximum of that many normal draws."""
    return lag * expected_max_normal(workers) / expected_max_normal(profiled)


def iteration_lag_share(per_iteration: float | None, totals: Sequence[float], workers: int) -> float:
    """The share of a synchronized step's work every rank waits for the slowest rank, at ``workers`` workers.

    ``per_iteration`` is the profile's measured lag of each iteration's
    slowest rank (:func:`~.profiling.iteration_lag`) at its ``len(totals)``
    ranks, scaled to ``workers`` as :func:`rank_lag` scales the lag of the
    ranks' totals, which stands in where the profile predates it (None).
    """
    if per_iteration is None:
        return rank_lag(totals, workers)
    if len(totals) < 2 or workers < 2:
        return 0.0
    return _lag_at(workers, per_iteration, len(totals))


def _add_rank_lag(parts: dict[str, float], profile: Profile, plan: WorkPlan | None, workers: int, kfac: bool, inversions: float) -> None:
    """The wait for the slowest rank at each synchronization: the profile's times are the mean rank's.

    Every rank waits at the gradient all-reduces for each iteration's
    slowest rank (:func:`iteration_lag_share`), and in the inversion stage
    (at its broadcasts; at the next gradient all-reduce when nothing is
    broadcast) for the slowest one's ``inversions`` (those it ran while
    another rank inverted too, see :func:`_inversion_stage`). Plain SGD at
    the profiled worker count needs nothing: its measured wait already holds
    the lag.
    """
    if workers < 2:
        return
    computing = ("FF&BP", "Hooks", "FactorComp", "Precondition", "Update", "Other")
    work = sum(parts.get(k, 0.0) for k in computing)  # what every rank computes on every step
    if not kfac:
        if workers != profile.comm_workers:
            parts["GradComm"] += iteration_lag_share(profile.iteration_lag_sgd, profile.rank_sgd, workers) * work
        return
    parts["GradComm"] += iteration_lag_share(profile.iteration_lag_passes, profile.rank_passes, workers) * work
    stage_lag = rank_lag(profile.rank_inversions, workers) * inversions
    broadcasts = plan is not None and any(a.owner != ALL for a in plan.inversion.assignments)
    parts["InverseComm" if broadcasts else "GradComm"] += stage_lag


def _sgd_step(profile: Profile) -> float:
    """The plain-SGD update's seconds (every profile since the first writes it)."""
    if profile.sgd_step is None:
        raise ValueError("this profile has no plain-SGD step time (sgd_step); re-run `spdkfac.simulate profile`")
    return profile.sgd_step


def _layer_shapes(profile: Profile) -> list[LayerShape]:
    """The preconditioned layers in the optimizer's order (``opt.layers``), with their factor dimensions.

    The per-layer preconditioning entries are recorded in that order, and
    only for the layers that precondition (not an embedding tied to its output
    layer, whose factors are sent all the same); older profiles without them
    give the order the A factors became ready (the same for the models
    profiled so far).
    """
    shapes = {f.key: f.shape for f in profile.factors}
    names = [f.layer for f in profile.factors if f.kind == FactorKind.A]
    recorded = [p.layer for p in profile.precondition]
    if recorded and set(recorded) <= set(names):
        names = recorded
    return [
        LayerShape(
            name,
            shapes[("A", name)].dim,
            shapes[("G", name)].dim,
            shapes[("G", name)].blocks,
            shapes[("A", name)].diagonal,
            shapes[("G", name)].diagonal,
        )
        for name in names
    ]


def _blocked_communication(
    profile: Profile, cfg: Mapping[str, Any], m: ScaledModels, contention: bool, scale: float = 1.0, factors: bool = True
) -> tuple[float, float, float, float]:
    """Seconds of (gradient, factor) all-reduces the step waits for after backward, and that ran during the passes.

    ``factors=False``: a step that sends no factors (between factor steps), the gradients' all-reduces alone.

    Gradients are launched as each layer's backward finishes (the rest after
    backward); factor groups are the optimizer's (:func:`fusion_groups`,
    with the variant's threshold), launched as :func:`group_launch_times`
    says; one engine serves the launches in order. The wait is how far the
    engine runs past the passes, split as ``step()`` waits: for the
    gradients first (with the factor groups served before the last of them),
    then for the factors. Without ``contention`` communication costs the
    passes nothing (the last two are 0). Under ``contention`` (CPU workers
    with no spare core) every second of communication is a second of the
    worker's core, paid once: what the engine served of each kind while the
    passes computed slows the passes by as much (returned last), the rest is
    the wait after them. Each all-reduce costs ``scale`` times the fitted
    model (:func:`communication_scale`); the fusion groups are planned with
    the fitted model, as the optimizer plans them.
    """
    fwd, bwd = profile.forward, profile.backward
    kfac = cfg.get("precondition", True)
    launches: list[tuple[float, int, str]] = [(fwd + f.ready, f.grad_numel, "grad") for f in profile.factors if f.kind == FactorKind.G]
    launches.append((fwd + bwd, profile.other_grad_numel, "grad"))
    threshold = int(cfg.get("fusion_threshold_bytes", DEFAULT_THRESHOLD_BYTES))  # the variant's, as the optimizer plans
    if kfac and factors:
        for kind, offset in (("A", 0.0), ("G", fwd)):
            fs = [f for f in profile.factors if f.kind == kind]
            ready = [offset + f.ready for f in fs]
            sizes = [f.shape.packed_size for f in fs]
            groups = fusion_groups(cfg["fusion"], cfg["pipelining"], ready, sizes, m.ar_alpha, m.ar_beta, threshold)
            times = group_launch_times(groups, ready, cfg["pipelining"], fwd + bwd)
            launches += [(t, sum(sizes[i] for i in g), "factor") for t, g in zip(times, groups)]
    compute_end = fwd + bwd
    if m.workers == 1:
        return 0.0, 0.0, 0.0, 0.0
    launches.sort(key=lambda x: (x[0], x[2] == "factor"))  # the engine serves launches in the order they are made

    def cost(elements: int) -> float:
        return m.allreduce(elements) * scale if elements else 0.0

    ends = serve_in_order([(t, elements) for t, elements, _ in launches], cost)
    during = {"grad": 0.0, "factor": 0.0}  # each kind's service before the passes end
    last_grad = compute_end
    for (_, elements, kind), end in zip(launches, ends):
        during[kind] += min(end, compute_end) - min(end - cost(elements), compute_end)
        if kind == "grad":
            last_grad = max(last_grad, end)
    blocked = max(compute_end, ends[-1]) - compute_end
    # step() waits for every gradient first, then for the factors: what the engine serves before the last
    # gradient (factor groups launched earlier included) is gradient wait, the rest factor wait.
    grad_blocked = last_grad - compute_end
    factor_blocked = blocked - grad_blocked
    if not contention:
        return grad_blocked, factor_blocked, 0.0, 0.0
    return grad_blocked, factor_blocked, during["grad"], during["factor"]


def communication_scale(profile: Profile, perf: PerfModel) -> float:
    """Measured over modelled seconds of the gradient all-reduces of plain-SGD passes, at the profiled worker count.

    Under contention a second of the engine's work is a second of the
    worker's core; the fitted all-reduce model was measured with nothing
    else running, but in training the engine competes with the passes for
    the cores, the caches and the memory bandwidth. The profile measured
    what the real all-reduces cost the same passes: how much they slowed
    forward+backward (``sgd_forward_backward`` over ``..._local``) plus the
    wait after them, less the wait for each iteration's slowest rank (which
    :func:`_add_rank_lag` charges apart). That over the modelled cost of the
    same all-reduces (:func:`_blocked_communication` of plain SGD, at the
    profiled count) scales every all-reduce the engine serves, as the
    measured inversions scale the fitted inversion model. 1 where the
    profile lacks any of these (one worker, older files).
    """
    if profile.comm_workers < 2 or profile.iteration_lag_sgd is None:
        return 1.0
    if profile.sgd_forward_backward is None or profile.sgd_forward_backward_local is None:
        return 1.0
    blocked, _, during, _ = _blocked_communication(profile, variant_config("sgd"), ScaledModels(perf, profile.comm_workers), True)
    modelled = blocked + during
    lag = profile.iteration_lag_sgd * (profile.sgd_forward_backward + _sgd_step(profile))
    measured = max(0.0, profile.sgd_forward_backward - profile.sgd_forward_backward_local) + max(0.0, profile.sgd_grad_wait - lag)
    return measured / modelled if modelled > 0.0 else 1.0


def _inversion_stage(
    plan: WorkPlan, facs: Sequence[FactorProfile], m: ScaledModels, contention: bool = False, method: str = "inverse"
) -> tuple[float, float, float]:
    """(computation, wait, critical rank's inversions while another rank inverts too) seconds of the inversion stage.

    The placement is the optimizer's (planned with the fitted model); an
    'eigen' variant is planned and costed with the eigen curve and payload.
    The profile's measured inversions (over fitted) set the charge ratio, and
    its packing times stand for the eigen buffers'. Every rank leaves the
    stage when its critical rank does (the last broadcast arrived); as the
    optimizer's timeline records it, the computation is the mean rank's own
    (its decompositions and packing), the wait the rest of the stage. Under
    ``contention`` receiving a broadcast takes the receiver's cores as long
    as sending takes the sender's, so each rank also pays the broadcasts it
    receives.

    The profile measured how far the ranks' inversions spread with every
    rank inverting at once (:attr:`Profile.rank_inversions`); a rank that
    inverts while the others wait for its broadcasts has the machine to
    itself, so the critical rank lags only for the inversions it overlaps
    with another rank's (the third value: its own, at most the next busiest
    rank's). Seq-Dist's round-robin leaves the first rank alone for most of
    the stage; D-KFAC and a balanced placement keep every rank busy.
    """
    workers = plan.workers
    charged = _charged(plan.inversion, _inverse_scale(facs, m))
    spans = charged.makespans()
    comp_extra, recv_extra = _conversions(charged, facs, workers, method)
    if contention and workers > 1:
        for a in charged.assignments:
            if a.owner != ALL:
                for r in range(workers):
                    takes_part = a.holds(r) or not plan.native_subgroups
                    recv_extra[r] += a.t_comm if r != a.owner and takes_part else 0.0
    stage = [spans[r] + comp_extra[r] + recv_extra[r] for r in range(workers)]
    critical = max(range(workers), key=lambda r: stage[r])
    inversions = [sum(a.t_comp for a in charged.assignments if a.computes(r)) for r in range(workers)]
    inverse_comp = sum(inversions[r] + comp_extra[r] for r in range(workers)) / workers
    busiest_other = max((inversions[r] for r in range(workers) if r != critical), default=0.0)
    return inverse_comp, stage[critical] - inverse_comp, min(inversions[critical], busiest_other)


def _inverse_scale(facs: Sequence[FactorProfile], m: ScaledModels) -> float:
    """Measured over fitted inversion time of the profile's factors (1 for profiles that did not time them).

    The fit comes from a separate benchmark process; the profile inverted the
    same factors inside the job's process (same allocator state, engine warmed
    by real collectives), which is where the optimizer inverts them.
    """
    measured = [f.invert for f in facs]
    if any(t is None for t in measured):
        return 1.0
    fitted = sum(m.decomposition_cost("inverse", f.shape) for f in facs)
    return sum(t for t in measured if t is not None) / fitted if fitted > 0 else 1.0


def _charged(plan: PlacementPlan, scale: float) -> PlacementPlan:
    """``plan`` (made with the fitted model, as the optimizer makes it) with its inversions costed at ``scale``."""
    if scale == 1.0:
        return plan
    return PlacementPlan(plan.strategy, plan.world_size, [replace(a, t_comp=a.t_comp * scale) for a in plan.assignments])


def _conversions(
    plan: PlacementPlan, facs: Sequence[FactorProfile], workers: int, method: str = "inverse"
) -> tuple[list[float], list[float]]:
    """Per rank, the packing work of the inversion stage: (before its wait, in its wait), in seconds.

    Before: unpacking the factors it inverts, and for each inverse it
    broadcasts packing it and unpacking the packed copy, which the owner
    keeps so that every rank holds the same values
    (:func:`~spdkfac.step.decomposition_stage.compute_inverses`); in the wait: unpacking
    the inverses it receives. An inverse is the size of its factor, so the
    profile's per-factor unpack and pack times stand for all of them. An
    eigendecomposition's owner keeps views into the buffer it sends (no
    second unpacking).
    """
    kept_copy = method == ComputeMethod.INVERSE
    comp, recv = [0.0] * workers, [0.0] * workers
    times: dict[Hashable, FactorProfile] = {f.key: f for f in facs}
    for a in plan.assignments:
        unpack, pack = times[a.key].unpack, times[a.key].pack
        for r in range(workers):
            if a.computes(r):
                comp[r] += unpack + (pack + unpack * kept_copy if a.owner == r and workers > 1 else 0.0)
            elif a.holds(r):
                recv[r] += unpack
    return comp, recv


def _overlap_shares(enabled: bool, kfac: bool, workers: int, f_share: float, i_share: float) -> tuple[float, float]:
    """Shares of all steps whose preconditioning hides (gradient wait, factor wait), by the optimizer's rule.

    :func:`overlaps_preconditioning` decides per step; steps that keep the
    inverses are ``1 - i_share`` of all, and ``f_share - i_share`` of all
    also update the factors (their factor wait can be hidden too).
    """
    steps = ((1.0 - i_share, False), (i_share, True))  # (share of all steps, inverse step)
    grad = sum(share for share, inverse in steps if overlaps_preconditioning(enabled, kfac, workers, inverse))
    factor = max(0.0, f_share - i_share) if overlaps_preconditioning(enabled, kfac, workers, False) else 0.0
    return float(grad), factor


def _rank_shares(layers: Sequence[LayerPreconditionProfile], plan: WorkPlan) -> list[float]:
    """Preconditioning seconds of each rank: the layers it preconditions itself (the plan's gradient workers)."""
    unknown = [p.layer for p in layers if p.layer not in plan.layer_groups]
    if unknown:
        raise ValueError(f"the profile's preconditioning times name layers without factors: {unknown}")
    names = [p.layer for p in layers]
    seconds = {p.layer: p.seconds for p in layers}
    return [sum(seconds[n] for n in plan.preconditioned_here(r, names)) for r in range(plan.workers)]


def _preconditioning_busy(profile: Profile, plan: WorkPlan | None) -> float:
    """Seconds of preconditioning matmuls on the busiest rank (0 for profiles without per-layer times)."""
    layers = profile.precondition
    if plan is None or plan.groups is None:
        return sum(p.seconds for p in layers)
    return max(_rank_shares(layers, plan), default=0.0)


def _distributed_precondition_change(profile: Profile, plan: WorkPlan, m: ScaledModels) -> float:
    """Seconds the split preconditioning adds to (negative: saves from) the single-worker ``step()``.

    The busiest rank's share replaces the whole preconditioning; then the
    fused broadcasts of the results, each at its group's size, as the
    optimizer's ``'auto'`` choice charges them
    (:func:`~spdkfac.plan.grad_worker_choice.result_broadcast_seconds`: a rank's
    link carries every broadcast it takes part in).
    """
    layers = profile.precondition
    if not layers:
        raise ValueError("this profile has no per-layer preconditioning times; re-run `spdkfac.simulate profile`")
    shares = _rank_shares(layers, plan)
    elements = {p.layer: p.blocks * p.g_dim * p.a_dim for p in layers}
    comm = max(result_broadcast_seconds(plan, m.scaled, elements), default=0.0)
    return max(shares) + comm - sum(p.seconds for p in layers)
