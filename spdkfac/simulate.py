"""Predict iteration time and its breakdown at any worker count (D-KFAC, MPD-KFAC, SPD-KFAC, ...).

Two steps::

    python -m spdkfac.simulate profile --model resnet50 --resolution 32 --batch-size 4 --out profile.json
    python -m spdkfac.simulate predict --profile profile.json --perf-model perfmodels/x.json --workers 2 4 8 64

``profile`` measures one worker (launch it with the job's launcher so that all
workers profile at once and share the machine as in training): forward and backward time, when each
factor becomes ready and how long it took, gradient sizes, and the time of the
rest of ``step()``. ``predict`` replays the same event model the optimizer plans
with: factor groups from :func:`spdkfac.fusion.plan_groups` (launched when
their last member is ready, or after backward without pipelining), gradient
all-reduces launched as each layer's backward finishes, one communication
engine serving launches in order with ``t(m) = alpha + beta*m``, then the
inversion stage's makespan from :func:`spdkfac.placement.place` (planned with
the fitted inversion model, as the optimizer plans; charged at the ratio of the
profile's measured inversions to that model), with each rank's packing work
(the profile's per-factor unpack and pack times). On steps that
keep the inverses, variants with ``overlap_preconditioning`` hide up to their
preconditioning time of the gradient wait, and on such steps that update the
factors what remains of it hides the factor wait too. Variants may carry changes
(``'spdkfac:overlap_preconditioning=false'``, see :func:`spdkfac.variants.variant_config`).

Scaling to P workers: the fitted file holds costs at its own world size W.
All-reduce costs are scaled by the ring factor ``(P-1)/P`` relative to W's
(alpha by ``(P-1)/(W-1)``), broadcasts by ``ceil(log2 P)/ceil(log2 W)`` (a
tree). ``--contention`` models machines where communication needs the same
cores as computation (CPU workers with no spare core): nothing overlaps, and
forward+backward (with the factor work in it) is slowed by the ratio the
profile measured for plain-SGD passes with their real gradient all-reduces
(Horovod's background thread and the copies cost CPU time throughout the
backward pass, far more than the all-reduce model's transfer time).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .affinity import add_bind_cores_option, bind_cores_if_asked
from .comm import CommBackend, detect_launcher, get_backend
from .decomposition import payload_size
from .fusion import DEFAULT_THRESHOLD_BYTES, plan_groups
from .host_memory import retain_freed_memory
from .linalg import invert_spd, pack_upper, triangle_size
from .perfmodels import PerfModel, PerfModelError
from .placement import ALL, PlacementPlan, balance_by_cost, place, preconditioning_cost
from .variants import variant_argv, variant_config

__all__ = ["measure_profile", "average_profiles", "load_profiles", "predict", "ScaledModels"]

PARTS = ["FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other"]
DEFAULT_VARIANTS = ("sgd", "dkfac", "mpdkfac", "spdkfac")  # what `predict` predicts without --variants


# ----------------------------------------------------------------------------- profile
def measure_profile(model_name: str, resolution: int, batch_size: int, iters: int = 4, threads: int = 1,
                    comm: Optional[CommBackend] = None) -> Dict:
    """Per-layer compute profile of one worker (factors every iteration, no factor communication).

    With ``comm`` (the job's engine, several workers), plain-SGD passes with
    their real gradient all-reduces run first: they record how much
    communication slows forward+backward on this machine, and they leave the
    engine as it is during training. Everything after is timed in that state,
    because an engine that has run collectives costs the cores more while it
    idles than a fresh one, such as the one the performance models were fitted
    next to (Horovod's 1 ms background cycle: ~10% of a bound CPU worker's
    core on the reference machine). That includes the inversion of every
    factor, which :func:`predict` compares with the fitted inversion model.
    """
    from . import SPDKFACOptimizer
    from .models import get_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = get_model(model_name)
    x = torch.randn(batch_size, 3, resolution, resolution)
    y = torch.randint(0, 10, (batch_size,))
    sgd = _measure_sgd_passes(model, x, y, iters, comm)
    opt = SPDKFACOptimizer(model, lr=1e-4, backend="single", inv_update_freq=10**6, kl_clip=None, timeline=True, fusion="layerwise")
    runs = []
    for it in range(iters + 2):
        opt.zero_grad()
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        nn.functional.cross_entropy(out, y).backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        rec = opt.timeline.iterations[-1]
        if it < 2:
            continue  # warm-up (and the one inversion)
        events = {}
        for key, ev in rec.factors.items():
            start = rec.t0 + ev.compute_start
            end = rec.t0 + ev.compute_end
            base = t0 if ev.kind == "A" else t1
            events[key] = (end - base, end - start)
        runs.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2 - rec.inverse_stage, "events": events})
    # The running averages are kept packed: a rank unpacks each factor it inverts, packs each inverse it
    # broadcasts and unpacks each inverse it receives. Timed per factor (as a factor; an inverse is the same size),
    # with its inversion.
    damping = opt.param_groups[0]["damping"]
    per_factor: Dict[str, Tuple[float, float, float]] = {}  # factor -> (unpack, pack, invert) seconds
    for layer in opt.layers:
        for kind in ("A", "G"):
            t0 = time.perf_counter()
            full = layer.factor(kind)
            t1 = time.perf_counter()
            pack_upper(full)
            t2 = time.perf_counter()
            invert_spd(full, damping)
            per_factor[f"{kind}:{layer.name}"] = (t1 - t0, t2 - t1, time.perf_counter() - t2)
    unpack = sum(u for u, _, _ in per_factor.values())
    # Per-layer preconditioning time, for variants that split it across workers.
    precondition = []
    for layer in opt.layers:
        grad = layer.grad_matrix()
        layer.precondition(grad)
        t0 = time.perf_counter()
        for _ in range(3):
            layer.precondition(grad)
        precondition.append({"layer": layer.name, "seconds": (time.perf_counter() - t0) / 3,
                             "a_dim": layer.a_dim, "g_dim": layer.g_dim})
    opt.remove_hooks()
    n = len(runs)
    keys = list(runs[0]["events"])
    factors = []
    for key in keys:
        kind, name = key.split(":", 1)
        layer = {la.name: la for la in opt.layers}[name]
        factors.append({
            "kind": kind, "layer": name, "dim": layer.dim(kind),
            "ready": sum(r["events"][key][0] for r in runs) / n,
            "compute": sum(r["events"][key][1] for r in runs) / n,
            "grad_numel": sum(p.numel() for p in layer.module.parameters() if p.requires_grad) if kind == "G" else 0,
            "unpack": per_factor[key][0],
            "pack": per_factor[key][1],
            "invert": per_factor[key][2],
        })
    covered = {id(p) for layer in opt.layers for p in layer.module.parameters()}
    return {
        "model": model_name, "resolution": resolution, "batch_size": batch_size, "threads": threads,
        "forward": sum(r["forward"] for r in runs) / n,
        "backward": sum(r["backward"] for r in runs) / n,
        "step_other": sum(r["step"] for r in runs) / n,
        **sgd,
        "unpack": unpack,
        "precondition": precondition,
        "other_grad_numel": sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in covered),
        "factors": factors,
    }


def _measure_sgd_passes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, iters: int,
                        comm: Optional[CommBackend]) -> Dict:
    """Plain-SGD passes, with the engine's real gradient all-reduces when ``comm`` is given.

    Three times as many as the K-FAC passes: they are short, and their
    blocked wait (what the simulator charges plain SGD at the profiled worker
    count) varies from pass to pass by as much as the wait itself.
    """
    from . import SPDKFACOptimizer

    sgd = SPDKFACOptimizer(model, lr=1e-4, backend=comm if comm is not None else "single", precondition=False,
                           timeline=True)
    steps, waits, passes = [], [], []
    for it in range(3 * iters + 1):
        sgd.zero_grad()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        sgd.step()
        if it:
            wait = sgd.timeline.iterations[-1].grad_wait  # blocked on the gradient all-reduces
            steps.append(time.perf_counter() - t1 - wait)
            waits.append(wait)
            passes.append(t1 - t0)
    sgd.remove_hooks()
    sgd.zero_grad()
    return {
        "sgd_step": sum(steps) / len(steps),  # the update alone
        "sgd_grad_wait": sum(waits) / len(waits),  # measured blocked wait, real all-reduces
        "sgd_forward_backward": sum(passes) / len(passes),  # with gradient all-reduces when comm_workers > 1
        "comm_workers": sgd.backend.size,
        "engine_warmed": comm is not None,  # later parts timed with the engine as it is in training
    }


_WORKLOAD = ("model", "resolution", "batch_size", "threads", "comm_workers")
_TIMES = ("forward", "backward", "step_other", "sgd_step", "sgd_grad_wait", "sgd_forward_backward", "unpack")


def average_profiles(profiles: List[Dict]) -> Dict:
    """One profile whose times are the means of several profiles of the same workload.

    Profiles taken before and after a measurement bracket it: on a machine
    whose speed drifts, their mean describes the measured window better than
    either alone.
    """
    if not profiles:
        raise ValueError("no profile to average")
    first = profiles[0]
    for other in profiles[1:]:
        differ = [k for k in _WORKLOAD if other.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"profiles of different workloads cannot be averaged (they differ in {', '.join(differ)})")
        if [(f["kind"], f["layer"]) for f in other["factors"]] != [(f["kind"], f["layer"]) for f in first["factors"]]:
            raise ValueError("profiles with different factors (another model graph) cannot be averaged")
    n = len(profiles)
    out = json.loads(json.dumps(first))  # a deep copy of plain JSON data
    for key in _TIMES:
        if all(key in p for p in profiles):
            out[key] = sum(p[key] for p in profiles) / n
    for i, fac in enumerate(out["factors"]):
        for key in ("ready", "compute", "unpack", "pack", "invert"):
            if all(key in p["factors"][i] for p in profiles):
                fac[key] = sum(p["factors"][i][key] for p in profiles) / n
            else:
                fac.pop(key, None)
    if all(p.get("precondition") for p in profiles):
        for i, entry in enumerate(out["precondition"]):
            entry["seconds"] = sum(p["precondition"][i]["seconds"] for p in profiles) / n
    else:
        out.pop("precondition", None)
    out["averaged_from"] = n
    return out


def load_profiles(paths: List[str]) -> Dict:
    """Read one or more profile JSON files; several are averaged (:func:`average_profiles`)."""
    profiles = []
    for path in paths:
        try:
            with open(path) as fh:
                profile = json.load(fh)
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not valid JSON ({exc})") from None
        missing = [key for key in PROFILE_FIELDS if not isinstance(profile, dict) or key not in profile]
        if missing:
            raise ValueError(f"profile {path} lacks the field(s) {missing}; write it with `python -m spdkfac.simulate profile`")
        bad = [key for key in ("forward", "backward", "step_other") if not isinstance(profile[key], (int, float)) or profile[key] < 0]
        if bad or not isinstance(profile["factors"], list) or not profile["factors"]:
            raise ValueError(f"profile {path}: field(s) {bad or ['factors']} must be non-negative times / a non-empty list")
        profiles.append(profile)
    return profiles[0] if len(profiles) == 1 else average_profiles(profiles)


#: What predict needs of every profile file (``measure_profile`` writes them).
PROFILE_FIELDS = ("forward", "backward", "step_other", "factors")


# ----------------------------------------------------------------------------- models at P
@dataclass
class ScaledModels:
    """The fitted models extrapolated to ``workers`` (:meth:`PerfModel.scaled_to`), with no communication for one."""

    perf: PerfModel
    workers: int

    def __post_init__(self) -> None:
        self.scaled = self.perf.scaled_to(self.workers)

    def allreduce(self, elements: float) -> float:
        return self.ar_alpha + self.ar_beta * elements

    @property
    def ar_alpha(self) -> float:
        return self.scaled.allreduce.alpha if self.workers > 1 else 0.0

    @property
    def ar_beta(self) -> float:
        return self.scaled.allreduce.beta if self.workers > 1 else 0.0

    def broadcast(self, dim: int, method: str = "inverse") -> float:
        """Broadcast of one factor's result (:func:`~spdkfac.decomposition.payload_size` elements)."""
        if self.workers == 1:
            return 0.0
        return self.scaled.broadcast.payload(payload_size(method, dim))

    def broadcast_elements(self, elements: float) -> float:
        """Broadcast of a flat buffer, from the same fit (its ``m`` is ``d(d+1)/2`` there)."""
        if self.workers == 1 or elements == 0:
            return 0.0
        return self.scaled.broadcast.alpha + self.scaled.broadcast.beta * elements

    def inverse(self, dim: int) -> float:
        return self.perf.inverse(dim)

    def stage_costs(self, method: str) -> Tuple[Callable[[int], float], Callable[[int], float]]:
        """(decomposition, broadcast) seconds of a ``d x d`` factor for ``compute_method`` at ``workers``."""
        return self.perf.decomposition(method), lambda dim: self.broadcast(dim, method)


# ----------------------------------------------------------------------------- predict
def predict(profile: Dict, perf: PerfModel, workers: int, variant: str, contention: bool = False,
            update_freq: tuple = (1, 1)) -> Dict[str, float]:
    """Predicted seconds per iteration and its breakdown for ``variant`` on ``workers`` workers."""
    m = ScaledModels(perf, workers)
    cfg = variant_config(variant)
    fwd, bwd = profile["forward"], profile["backward"]
    facs = profile["factors"]
    kfac = cfg.get("precondition", True)
    f_freq, i_freq = update_freq
    f_share = 1.0 / f_freq if kfac else 0.0
    i_share = 1.0 / i_freq if kfac else 0.0
    factor_compute = sum(f["compute"] for f in facs)
    compute = fwd + bwd - factor_compute
    inflation = 1.0  # how much concurrent communication slows forward+backward (CPU workers)
    if contention and workers > 1 and profile.get("comm_workers", 1) > 1:
        inflation = max(1.0, profile["sgd_forward_backward"] / compute)

    launches: List[tuple] = []  # (launch time, elements, kind) in one engine queue
    g_facs = [f for f in facs if f["kind"] == "G"]
    grad_numel_tail = profile["other_grad_numel"]
    for f in g_facs:
        launches.append((fwd + f["ready"], f["grad_numel"], "grad"))
    launches.append((fwd + bwd, grad_numel_tail, "grad"))
    factor_launches: List[tuple] = []
    threshold = int(cfg.get("fusion_threshold_bytes", DEFAULT_THRESHOLD_BYTES))  # the variant's, as the optimizer plans
    if kfac:
        for kind, offset in (("A", 0.0), ("G", fwd)):
            fs = [f for f in facs if f["kind"] == kind]
            ready = [offset + f["ready"] for f in fs]
            ready = list(itertools.accumulate(ready, max))
            sizes = [triangle_size(f["dim"]) for f in fs]
            if cfg["pipelining"]:
                groups = plan_groups(cfg["fusion"], ready, sizes, m.ar_alpha, m.ar_beta, threshold)
                factor_launches += [(ready[g[-1]], sum(sizes[i] for i in g), "factor") for g in groups]
            else:
                groups = plan_groups(cfg["fusion"], [0.0] * len(sizes), sizes, m.ar_alpha, m.ar_beta, threshold)
                factor_launches += [(fwd + bwd, sum(sizes[i] for i in g), "factor") for g in groups]
    compute_end = fwd + bwd
    comm_time = {"grad": 0.0, "factor": 0.0}
    if workers > 1:
        free = 0.0
        for t, elems, kind in sorted(launches + factor_launches, key=lambda x: (x[0], x[2] == "factor")):
            dur = m.allreduce(elems) if elems else 0.0
            comm_time[kind] += dur
            free = max(free, t) + dur
        done = compute_end + comm_time["grad"] + comm_time["factor"] if contention else max(compute_end, free)
    else:
        done = compute_end
    blocked = done - compute_end
    # Split the blocked time between gradients and factors by their share of communication.
    total_comm = comm_time["grad"] + comm_time["factor"]
    grad_blocked = blocked * comm_time["grad"] / total_comm if total_comm else 0.0
    factor_blocked = blocked - grad_blocked

    inverse_comp = inverse_comm = 0.0
    if kfac:
        # The optimizer's order (A then G of each layer, layers in model order), which Eq. 22's round-robin follows.
        by_key = {(f["kind"], f["layer"]): f["dim"] for f in facs}
        layers = [f["layer"] for f in facs if f["kind"] == "A"]
        dims = [((kind, name), by_key[(kind, name)]) for name in layers for kind in ("A", "G")]
        # An 'eigen' variant is planned and costed with the eigen curve and payload; the profile's inversions
        # (measured over fitted) still set the charge ratio, and its packing times stand for the eigen buffers'.
        method = cfg.get("compute_method", "inverse")
        plan = _charged(place(cfg["placement"], dims, workers, *m.stage_costs(method)), _inverse_scale(facs, m))
        spans = plan.makespans()
        comp_extra, recv_extra = _conversions(plan, facs, workers)
        critical = max(range(workers), key=lambda r: spans[r] + comp_extra[r] + recv_extra[r])
        own = [a for a in plan.assignments if a.owner in (critical, ALL)]
        inverse_comp = sum(a.t_comp for a in own)
        inverse_comm = spans[critical] - inverse_comp + recv_extra[critical]  # the wait includes unpacking what arrived
        inverse_comp += comp_extra[critical]
    parts = {
        # The profile computes factors in every pass; they are charged once, as FactorComp, at their share.
        "FF&BP": compute * inflation,
        "GradComm": grad_blocked if workers > 1 else 0.0,
        "FactorComp": factor_compute * f_share * inflation,
        "FactorComm": factor_blocked * f_share,
        "InverseComp": inverse_comp * i_share,
        "InverseComm": inverse_comm * i_share,
        "Other": profile["step_other"] if kfac else profile["sgd_step"],
    }
    if not kfac and workers > 1 and profile.get("comm_workers") == workers:
        # At the profiled worker count, plain SGD's gradient wait was measured with the real all-reduces;
        # profiles from before it was recorded apart hold it inside sgd_step.
        parts["GradComm"] = profile.get("sgd_grad_wait", 0.0)
    if kfac and not _has_conversion_times(facs):
        # Profiles without per-factor conversion times: every factor unpacked once, on every rank.
        parts["InverseComp"] += profile.get("unpack", 0.0) * i_share
    if kfac and workers > 1 and cfg.get("distribute_preconditioning"):
        parts["Other"] += _distributed_precondition_change(profile, m, workers, contention)
    if kfac and workers > 1 and not contention and cfg.get("overlap_preconditioning", True):
        # On steps that keep the inverses, the preconditioning of the layers whose gradients have arrived
        # runs while the rest are still averaged: the blocked wait shrinks by up to this rank's preconditioning.
        busy = _preconditioning_busy(profile, workers, cfg.get("distribute_preconditioning", False))
        hidden = min(parts["GradComm"], busy)
        parts["GradComm"] -= hidden * (1.0 - i_share)
        # Factor steps that keep the inverses precondition before waiting for the factor all-reduces, so what
        # is left of the preconditioning hides factor communication too (inverse steps are factor steps).
        parts["FactorComm"] -= min(factor_blocked, busy - hidden) * max(0.0, f_share - i_share)
    return {"iteration": sum(parts.values()), **parts}


def _inverse_scale(facs: List[Dict], m: ScaledModels) -> float:
    """Measured over fitted inversion time of the profile's factors (1 for profiles that did not time them).

    The fit comes from a separate benchmark process; the profile inverted the
    same factors inside the job's process (same allocator state, engine warmed
    by real collectives), which is where the optimizer inverts them.
    """
    if not all("invert" in f for f in facs):
        return 1.0
    fitted = sum(m.inverse(f["dim"]) for f in facs)
    return sum(f["invert"] for f in facs) / fitted if fitted > 0 else 1.0


def _charged(plan: PlacementPlan, scale: float) -> PlacementPlan:
    """``plan`` (made with the fitted model, as the optimizer makes it) with its inversions costed at ``scale``."""
    if scale == 1.0:
        return plan
    return PlacementPlan(plan.strategy, plan.world_size,
                         [replace(a, t_comp=a.t_comp * scale) for a in plan.assignments])


def _has_conversion_times(facs: List[Dict]) -> bool:
    """Whether the profile timed each factor's unpacking and packing (profiles before that did not)."""
    return all("unpack" in f and "pack" in f for f in facs)


def _conversions(plan: PlacementPlan, facs: List[Dict], workers: int) -> Tuple[List[float], List[float]]:
    """Per rank, the packing work of the inversion stage: (before its wait, in its wait), in seconds.

    Before: unpacking the factors it inverts and packing the inverses it
    broadcasts; in the wait: unpacking the inverses it receives. Zero for
    profiles without per-factor times (see :func:`predict`).
    """
    comp, recv = [0.0] * workers, [0.0] * workers
    if not _has_conversion_times(facs):
        return comp, recv
    times = {(f["kind"], f["layer"]): f for f in facs}
    for a in plan.assignments:
        unpack, pack = times[a.key]["unpack"], times[a.key]["pack"]
        for r in range(workers):
            if a.owner in (r, ALL):
                comp[r] += unpack + (pack if a.owner == r and workers > 1 else 0.0)
            else:
                recv[r] += unpack
    return comp, recv


def _rank_shares(layers: List[Dict], workers: int) -> List[tuple]:
    """(preconditioning seconds, result elements) of each rank, with the optimizer's layer balancing."""
    owners = balance_by_cost([preconditioning_cost(p["a_dim"], p["g_dim"]) for p in layers], workers)
    return [(sum(p["seconds"] for p, o in zip(layers, owners) if o == r),
             sum(p["g_dim"] * p["a_dim"] for p, o in zip(layers, owners) if o == r)) for r in range(workers)]


def _preconditioning_busy(profile: Dict, workers: int, distributed: bool) -> float:
    """Seconds of preconditioning matmuls on the busiest rank (0 for profiles without per-layer times)."""
    layers = profile.get("precondition") or []
    if not distributed:
        return sum(p["seconds"] for p in layers)
    return max((seconds for seconds, _ in _rank_shares(layers, workers)), default=0.0)


def _distributed_precondition_change(profile: Dict, m: ScaledModels, workers: int, contention: bool) -> float:
    """Seconds the split preconditioning adds to (negative: saves from) the single-worker ``step()``.

    The busiest rank's share replaces the whole preconditioning; the fused
    broadcasts of the results follow (one per rank; serialized under
    ``contention``, else the last one is what is waited for).
    """
    layers = profile.get("precondition")
    if not layers:
        raise ValueError("this profile has no per-layer preconditioning times; re-run `spdkfac.simulate profile`")
    shares = _rank_shares(layers, workers)
    broadcasts = [m.broadcast_elements(elements) for _, elements in shares]
    comm = sum(broadcasts) if contention else max(broadcasts)
    return max(seconds for seconds, _ in shares) + comm - sum(p["seconds"] for p in layers)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spdkfac.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile", help="measure a per-layer compute profile (under the job's launcher: every worker at once)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    add_bind_cores_option(p)
    p.add_argument("--out", required=True)
    q = sub.add_parser("predict", help="predict iteration times from a profile and a performance model")
    q.add_argument("--profile", required=True, nargs="+", help="one profile, or several to average (e.g. taken before and after)")
    q.add_argument("--perf-model", required=True)
    q.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    q.add_argument("--variants", nargs="*", action="extend", default=None, help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    q.add_argument("--contention", action="store_true", help="communication cannot overlap computation (CPU workers, no spare core)")
    q.add_argument("--update-freq", type=int, nargs=2, default=[1, 1])
    q.add_argument("--json", default=None, help="also write the predictions here")
    args = ap.parse_args(variant_argv(sys.argv[1:] if argv is None else argv))
    warnings.filterwarnings("ignore")
    if args.cmd == "profile":
        # Under a launcher, every worker profiles at once, so the profile sees the same sharing of
        # cores and memory bandwidth as a real run (and the SGD passes the real gradient all-reduces).
        for flag, value in (("--resolution", args.resolution), ("--batch-size", args.batch_size), ("--iters", args.iters),
                            ("--threads", args.threads)):
            if value < 1:
                print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
                return 2
        cores = bind_cores_if_asked(args)
        comm = get_backend("auto") if detect_launcher() != "single" else None  # the launcher detection of spdkfac.comm
        rank, workers = (comm.rank, comm.size) if comm is not None else (0, 1)
        if workers == 1:
            comm = None
        retained = retain_freed_memory()  # profile under the training job's allocator settings
        prof = measure_profile(args.model, args.resolution, args.batch_size, args.iters, args.threads, comm)
        prof["concurrent_workers"] = workers
        prof["retained_freed_memory"] = retained
        prof["bound_cores"] = cores
        if rank != 0:
            return 0
        with open(args.out, "w") as fh:
            json.dump(prof, fh, indent=1)
        print(f"profile of {args.model}: forward {prof['forward']*1e3:.1f} ms, backward {prof['backward']*1e3:.1f} ms, "
              f"{len(prof['factors'])} factors; wrote {args.out}")
        return 0
    impossible = [f"--workers {w}" for w in args.workers if w < 1]
    factor_freq, inv_freq = args.update_freq
    if factor_freq < 1 or inv_freq < 1 or inv_freq % factor_freq:
        impossible.append(f"--update-freq {factor_freq} {inv_freq} (both >= 1, the second a multiple of the first)")
    if impossible:
        print(f"error: impossible arguments: {', '.join(impossible)}", file=sys.stderr)
        return 2
    try:
        prof = load_profiles(args.profile)
        perf = PerfModel.load(args.perf_model)
    except (ValueError, OSError, PerfModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.variants = args.variants or list(DEFAULT_VARIANTS)
    for v in args.variants:
        try:
            variant_config(v)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    out = {}
    print(f"{'workers':>7} {'variant':<10} {'iter (ms)':>10} " + " ".join(f"{k:>11}" for k in PARTS))
    for w in args.workers:
        for v in args.variants:
            r = predict(prof, perf, w, v, args.contention, tuple(args.update_freq))
            out[f"{w}:{v}"] = r
            print(f"{w:>7} {v:<10} {r['iteration']*1e3:10.1f} " + " ".join(f"{r[k]*1e3:11.1f}" for k in PARTS))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"profile": args.profile, "perf_model": args.perf_model, "contention": args.contention, "predictions": out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
