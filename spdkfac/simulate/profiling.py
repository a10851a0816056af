"""Measuring a profile: one worker's per-layer compute times (``python -m spdkfac.simulate profile``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from ..comm import CommBackend
from ..kfac.factor_shape import FactorKind
from ..kfac.layers import FACTOR_KINDS
from ..models import get_model
from ..optimizer import SPDKFACOptimizer
from ..step.timeline import Timeline
from .profile_file import FactorProfile, LayerPreconditionProfile, Profile

__all__ = ["measure_profile"]


def measure_profile(
    model_name: str,
    resolution: int,
    batch_size: int,
    iters: int = 4,
    threads: int = 1,
    comm: CommBackend | None = None,
    device: torch.device | str = "cpu",
) -> Profile:
    """Per-layer compute profile of one worker (factors every iteration, no factor communication).

    With ``comm`` (the job's engine, several workers), plain-SGD passes with
    their real gradient all-reduces run first: they record how much
    communication slows forward+backward on this machine, and they leave the
    engine as it is during training. Everything after is timed in that state,
    because an engine that has run collectives costs the cores more while it
    idles than a fresh one, such as the one the performance models were fitted
    next to (Horovod's 1 ms background cycle: ~10% of a bound CPU worker's
    core on the reference machine). That includes the inversion of every
    factor, which :func:`~spdkfac.simulate.predict` compares with the fitted inversion model.

    With ``comm`` every rank measures each part at the same time as the
    others (a barrier before each), and the profile holds the mean over the
    ranks with each rank's own totals and each iteration's spread
    (:func:`_across_ranks`): how far the slowest rank lags is a cost of every
    synchronized step.

    On a GPU (``device``) every clock reading waits for the device (:meth:`Timeline.now`), so each part is
    charged its own kernels' time.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = get_model(model_name).to(device)
    x = torch.randn(batch_size, 3, resolution, resolution).to(device)
    y = torch.randint(0, 10, (batch_size,)).to(device)
    sgd, sgd_iterations = _measure_sgd_passes(model, x, y, iters, comm)
    _barrier(comm)
    # The same passes without communication (every rank at once): the base of the slowdown communication causes.
    local = _measure_sgd_passes(model, x, y, iters, None)[0] if comm is not None and comm.size > 1 else sgd
    _barrier(comm)
    opt = SPDKFACOptimizer(model, lr=1e-4, backend="single", inv_update_freq=10**6, kl_clip=None, timeline=True, fusion="layerwise")
    runs: list[dict[str, float]] = []
    events: list[dict[str, tuple[float, float]]] = []  # per run: factor key -> (ready, compute) seconds
    for it in range(iters + 2):
        opt.zero_grad()
        t0 = Timeline.now()
        out = model(x)
        t1 = Timeline.now()
        torch.autograd.backward(nn.functional.cross_entropy(out, y))
        t2 = Timeline.now()
        opt.step()
        t3 = Timeline.now()
        rec = _timeline(opt).iterations[-1]
        if it < 2:
            continue  # warm-up (and the one inversion)
        run_events = {}
        for key, ev in rec.factors.items():
            start = rec.t0 + ev.compute_start
            end = rec.t0 + ev.compute_end
            base = t0 if ev.kind == FactorKind.A else t1
            run_events[key] = (end - base, end - start)
        events.append(run_events)
        runs.append(
            {
                "forward": t1 - t0,
                "backward": t2 - t1,
                "step": t3 - t2 - rec.inverse_stage,
                "hooks": rec.hooks,
                "precondition": rec.precondition,
                "update": rec.update,
                "work": t3 - t0 - rec.inverse_stage,  # this iteration's pass work with its step()
            }
        )
    # The running averages are kept packed: a rank unpacks each factor it inverts, packs each inverse it
    # broadcasts and unpacks each inverse it receives. Timed per factor (as a factor; an inverse is the same size),
    # with its inversion.
    damping = opt.param_groups[0]["damping"]
    _barrier(comm)  # every rank inverts at once, as in the inversion stage
    per_factor: dict[str, tuple[float, float, float]] = {}  # factor -> (unpack, pack, invert) seconds
    for layer in opt.layers:
        for kind in FACTOR_KINDS:
            t0 = Timeline.now()
            full = layer.factor(kind)
            t1 = Timeline.now()
            if full is None:
                raise RuntimeError(f"the {kind} factor of {layer.name!r} was never computed while profiling")
            layer.shape(kind).pack(full)
            t2 = Timeline.now()
            if layer.preconditions:  # (a tied embedding's factors are decomposed with its output layer's, not alone)
                layer.method.local(layer.shape(kind), full, damping)
            per_factor[f"{kind}:{layer.name}"] = (t1 - t0, t2 - t1, Timeline.now() - t2)
    # Per-layer preconditioning time, for variants that split it across workers.
    precondition = []
    _barrier(comm)
    for layer in (layer for layer in opt.layers if layer.preconditions):
        grad = layer.grad_matrix()
        if grad is None:
            raise RuntimeError(f"layer {layer.name!r} has no gradient to precondition while profiling")
        layer.precondition(grad, damping)
        t0 = Timeline.now()
        for _ in range(3):
            layer.precondition(grad, damping)
        precondition.append(
            LayerPreconditionProfile(layer.name, (Timeline.now() - t0) / 3, layer.a_dim, layer.g_dim, layer.shape("G").blocks)
        )
    opt.remove_hooks()
    n = len(runs)
    by_name = {layer.name: layer for layer in opt.layers}
    factors = []
    counted: set[int] = set()  # a parameter several layers share (attention's in_proj_weight) is all-reduced once
    for key in events[0]:  # the order the factors became ready
        kind, name = key.split(":", 1)
        layer = by_name[name]
        fresh = [p for p in layer.params() if p.requires_grad and id(p) not in counted] if kind == FactorKind.G else []
        counted.update(id(p) for p in fresh)
        factors.append(
            FactorProfile(
                kind=kind,
                layer=name,
                dim=layer.dim(kind),
                ready=sum(e[key][0] for e in events) / n,
                compute=sum(e[key][1] for e in events) / n,
                grad_numel=sum(p.numel() for p in fresh),
                unpack=per_factor[key][0],
                pack=per_factor[key][1],
                invert=per_factor[key][2],
                blocks=layer.shape(kind).blocks,
                diagonal=layer.shape(kind).diagonal,
            )
        )
    covered = {id(p) for layer in opt.layers for p in layer.params()}
    profile = Profile(
        model=model_name,
        resolution=resolution,
        batch_size=batch_size,
        threads=threads,
        forward=sum(r["forward"] for r in runs) / n,
        backward=sum(r["backward"] for r in runs) / n,
        step_other=sum(r["step"] for r in runs) / n,
        sgd_step=float(sgd["sgd_step"]),
        sgd_grad_wait=float(sgd["sgd_grad_wait"]),
        sgd_forward_backward=float(sgd["sgd_forward_backward"]),
        sgd_update=float(sgd["sgd_update"]),
        sgd_forward_backward_local=float(local["sgd_forward_backward"]),
        hooks=sum(r["hooks"] for r in runs) / n,
        precondition_step=sum(r["precondition"] for r in runs) / n,
        update=sum(r["update"] for r in runs) / n,
        comm_workers=int(sgd["comm_workers"]),
        engine_warmed=comm is not None,  # later parts timed with the engine as it is in training
        unpack=sum(u for u, _, _ in per_factor.values()),
        precondition=tuple(precondition),
        other_grad_numel=sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in covered),
        factors=tuple(factors),
    )
    if comm is None or comm.size == 1:
        return profile
    iterations = ([r["work"] for r in runs], sgd_iterations)
    return _across_ranks(profile, comm, iterations)


def _barrier(comm: CommBackend | None) -> None:
    if comm is not None and comm.size > 1:
        comm.barrier()


def _across_ranks(profile: Profile, comm: CommBackend, iterations: tuple[list[float], list[float]]) -> Profile:
    """``profile`` with every time the mean over the ranks, each rank's totals and each iteration's spread.

    The totals are this rank's K-FAC pass work (forward + backward + the
    rest of ``step()``), its inversions of every factor, and its plain-SGD
    pass work (forward + backward + update). ``iterations`` holds this rank's
    K-FAC and plain-SGD pass work iteration by iteration (the same count on
    every rank), gathered with them for :func:`iteration_lag`.
    """
    scalars = (
        "forward",
        "backward",
        "step_other",
        "sgd_step",
        "sgd_grad_wait",
        "sgd_forward_backward",
        "unpack",
        "hooks",
        "precondition_step",
        "update",
        "sgd_update",
        "sgd_forward_backward_local",
    )
    per_factor = ("ready", "compute", "unpack", "pack", "invert")
    values = [float(getattr(profile, k) or 0.0) for k in scalars]
    values += [float(getattr(f, k) or 0.0) for f in profile.factors for k in per_factor]
    values += [p.seconds for p in profile.precondition]
    buf = torch.tensor(values, dtype=torch.float64)
    comm.allreduce_async(buf, "spdkfac.simulate.profile").wait()
    mean = buf.tolist()
    head = dict(zip(scalars, mean[: len(scalars)]))
    pos = len(scalars)
    factors = []
    for f in profile.factors:
        fields = dict(zip(per_factor, mean[pos : pos + len(per_factor)]))
        pos += len(per_factor)
        factors.append(replace(f, **fields))
    precondition = []
    for p in profile.precondition:
        precondition.append(replace(p, seconds=mean[pos]))
        pos += 1
    own = [
        profile.forward + profile.backward + profile.step_other,
        sum(f.invert or 0.0 for f in profile.factors),
        (profile.sgd_forward_backward or 0.0) + (profile.sgd_step or 0.0),
    ]
    kfac_series, sgd_series = iterations
    ranks = comm.gather_values(own + kfac_series + sgd_series, "spdkfac.simulate.profile.ranks")
    split = len(own) + len(kfac_series)
    return replace(
        profile,
        **head,
        factors=tuple(factors),
        precondition=tuple(precondition),
        rank_passes=tuple(r[0] for r in ranks),
        rank_inversions=tuple(r[1] for r in ranks),
        rank_sgd=tuple(r[2] for r in ranks),
        iteration_lag_passes=iteration_lag([r[len(own) : split] for r in ranks]),
        iteration_lag_sgd=iteration_lag([r[split:] for r in ranks]),
    )


def iteration_lag(per_rank: Sequence[Sequence[float]]) -> float:
    """How far the slowest rank lags the ranks' mean in the same iteration, averaged, as a share of the mean.

    ``per_rank[r][i]`` is rank ``r``'s work in iteration ``i``. A step that
    synchronizes the ranks every iteration waits for each iteration's
    slowest: the mean of ``max - mean`` over the iterations, which is larger
    than the lag of the ranks' averages whenever the ranks' times fluctuate
    independently from iteration to iteration.
    """
    columns: list[tuple[float, ...]] = list(zip(*per_rank))
    if len(per_rank) < 2 or not columns:
        return 0.0
    mean_work = sum(sum(c) for c in columns) / (len(columns) * len(per_rank))
    if mean_work <= 0:
        return 0.0
    excess = sum(max(c) - sum(c) / len(c) for c in columns) / len(columns)
    return float(excess / mean_work)


def _timeline(opt: SPDKFACOptimizer) -> Timeline:
    """The optimizer's timeline (the profile builds it with ``timeline=True``)."""
    if opt.timeline is None:
        raise RuntimeError("the profiling optimizer records no timeline")
    return opt.timeline


def _measure_sgd_passes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, iters: int, comm: CommBackend | None
) -> tuple[dict[str, float | int], list[float]]:
    """Plain-SGD passes, with the engine's real gradient all-reduces when ``comm`` is given.

    Three times as many as the K-FAC passes: they are short, and their
    blocked wait (what the simulator charges plain SGD at the profiled worker
    count) varies from pass to pass by as much as the wait itself. Returns the
    means and each iteration's passes and update (the wait apart).
    """
    sgd = SPDKFACOptimizer(model, lr=1e-4, backend=comm if comm is not None else "single", precondition=False, timeline=True)
    steps, waits, passes, updates, work = [], [], [], [], []
    for it in range(3 * iters + 1):
        sgd.zero_grad()
        t0 = Timeline.now()
        torch.autograd.backward(nn.functional.cross_entropy(model(x), y))
        t1 = Timeline.now()
        sgd.step()
        if it:
            record = _timeline(sgd).iterations[-1]
            wait = record.grad_wait  # blocked on the gradient all-reduces
            steps.append(Timeline.now() - t1 - wait)
            waits.append(wait)
            updates.append(record.update)
            passes.append(t1 - t0)
            work.append(passes[-1] + steps[-1])
    sgd.remove_hooks()
    sgd.zero_grad()
    means: dict[str, float | int] = {
        "sgd_step": sum(steps) / len(steps),  # the update alone
        "sgd_grad_wait": sum(waits) / len(waits),  # measured blocked wait, real all-reduces
        "sgd_forward_backward": sum(passes) / len(passes),  # with gradient all-reduces when comm_workers > 1
        "sgd_update": sum(updates) / len(updates),  # the base update inside sgd_step
        "comm_workers": sgd.backend.size,
    }
    return means, work
