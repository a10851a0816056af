"""Multi-process worker: trains the small test network under several optimizer configurations.

Launched by the tests with ``horovodrun`` or ``torchrun`` (or run directly for
the single-process reference). Each rank trains on its contiguous shard of a
fixed global batch; rank 0 saves the final parameters of every configuration.

    python tests/workers/train_configs.py --backend torch --configs '<json>' --out result.pt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import asdict

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import batch, mixed_net, small_net, small_transformer, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import get_backend
from spdkfac.perfmodels import PerfModel

warnings.filterwarnings("ignore", message="no perf_model given")
warnings.filterwarnings("ignore", message="performance model")


def perf_model(name: str) -> PerfModel:
    """Named performance models that force interesting decisions on tiny factors."""
    default = PerfModel.default().to_dict()
    if name == "default":
        return PerfModel.default()
    if name == "expensive-inverse":
        # Inversion dearer than broadcast for d >= 6: big factors are owned and broadcast, small ones local.
        default["inverse"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-3], "floor": 1e-6}
        default["broadcast"] = {"alpha": 1e-1, "beta": 1e-6}
        return PerfModel.from_dict(default, "expensive-inverse")
    if name == "expensive-eigen":
        # Inversions free (every factor local if the inverse curve were used), eigendecompositions dearer than
        # the broadcast of Q and d for d >= 5: under 'eigen', big factors are owned and broadcast, small ones local.
        default["inverse"] = {"kind": "cubic", "coeffs": [1e-9, 0.0, 0.0, 1e-12], "floor": 1e-9}
        default["eigen"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-3], "floor": 1e-6}
        default["broadcast"] = {"alpha": 1e-1, "beta": 1e-6}
        return PerfModel.from_dict(default, "expensive-eigen")
    if name == "big-alpha":
        # A huge all-reduce start-up cost: optimal fusion merges groups of factors.
        default["allreduce"] = {"alpha": 10.0, "beta": 1e-9}
        return PerfModel.from_dict(default, "big-alpha")
    raise ValueError(name)


#: Named step schedules (JSON configs cannot hold callables): option -> f(step), the same on every rank.
SCHEDULES = {
    # Damping halves every 2 steps, the KL clip tightens at step 3, and from step 3 on the factors are updated
    # every 2 steps and the inverses every 4: factor steps 0, 1, 2, 4; inverse steps 0, 2, 4.
    "decay": dict(
        damping=lambda s: 0.02 * 0.5 ** (s // 2),
        kl_clip=lambda s: 0.01 if s < 3 else 0.005,
        factor_update_freq=lambda s: 1 if s < 3 else 2,
        inv_update_freq=lambda s: 2 if s < 3 else 4,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--configs", required=True, help="JSON object: name -> optimizer kwargs (+ perf_model name)")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument(
        "--no-accumulation", action="store_true", help="ignore accumulation_steps: the full-batch reference of an accumulated run"
    )
    ap.add_argument("--every-rank", action="store_true", help="every rank saves its results, to OUT.rank<r>")
    ap.add_argument("--device", default="cpu", help="where every rank computes (cuda: all ranks share the current GPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.set_default_dtype(getattr(torch, args.dtype))
    backend = get_backend(args.backend)
    rank, size = backend.rank, backend.size
    if args.global_batch % size:
        raise SystemExit(f"global batch {args.global_batch} not divisible by {size} workers")
    local = args.global_batch // size
    x, y = batch(args.global_batch)
    x, y = x[rank * local : (rank + 1) * local].to(device), y[rank * local : (rank + 1) * local].to(device)
    results = {}
    for name, cfg in json.loads(args.configs).items():
        cfg = dict(cfg)
        pm = perf_model(cfg.pop("perf_model", "default"))
        scaler = poisoned = None
        amp = cfg.pop("amp", None)  # {"init_scale": S, "nan_step": k}: GradScaler loop, NaN in the last sample at step k
        if amp is not None:
            scaler = cfg["grad_scaler"] = torch.amp.GradScaler(device.type, init_scale=amp["init_scale"])
            last = torch.zeros(args.global_batch, dtype=torch.bool)
            last[-1] = True  # on the last rank only: the others see NaN only through the averaged gradients
            poisoned = {amp["nan_step"]: last[rank * local : (rank + 1) * local].to(device)}
        nan_steps = cfg.pop("nan_steps", None)  # NaN in the last sample (on the last rank only) at these steps, no scaler
        if nan_steps is not None:
            last = torch.zeros(args.global_batch, dtype=torch.bool)
            last[-1] = True
            poisoned = dict.fromkeys(nan_steps, last[rank * local : (rank + 1) * local].to(device))
        skip_bad_loss = cfg.pop("skip_bad_loss", False)
        clip = cfg.pop("clip_grad_norm", None)
        clip_synchronized = cfg.pop("clip_synchronized", True)
        attack_steps = cfg.pop("attack_steps", 0)  # training on a PGD attack crafted on the model in train mode
        fast_fgsm = cfg.pop("fast_fgsm", False)  # training on fast FGSM's attack, the gradients cleared after the forward
        cfg.update(SCHEDULES[cfg.pop("schedule")] if "schedule" in cfg else {})
        if args.no_accumulation:
            cfg.pop("accumulation_steps", None)
        accumulate = cfg.get("accumulation_steps", 1)
        if local % accumulate:
            raise SystemExit(f"local batch {local} not divisible into {accumulate} micro-batches")
        models = {"transformer": small_transformer, "transformer-sequence-first": lambda: small_transformer(sequence_first=True)}
        model = {**models, "mixed": mixed_net}.get(cfg.pop("model", None), small_net)().to(device)
        stack_groups = cfg.pop("stack_groups", None)  # same-shape layers stacked (by default on a GPU only)
        outside_head = cfg.pop("outside_head", False)  # a head beside the model, given by add_param_group
        opt = SPDKFACOptimizer(model, backend=backend, perf_model=pm, **cfg)
        opt.kfac_step.preconditioner.stack_groups = stack_groups
        if outside_head:
            torch.manual_seed(7)
            head = nn.Linear(5, 5).to(device)
            opt.add_param_group({"params": head.parameters(), "lr": cfg["lr"] / 2})
            model = nn.Sequential(model, head)  # (the loop's forward; the optimizer's model is the first part)
        train(
            model,
            opt,
            x,
            y,
            args.steps,
            scaler=scaler,
            poisoned=poisoned,
            clip=clip,
            accumulate=accumulate,
            skip_bad_loss=skip_bad_loss,
            clip_synchronized=clip_synchronized,
            attack_steps=attack_steps,
            fast_fgsm=fast_fgsm,
        )
        results[name] = {
            "steps": opt.steps,
            "damping": opt.param_groups[0]["damping"],
            "update_freqs": [opt.factor_update_freq, opt.inv_update_freq],
            "fusion_plans_made": opt.kfac_step.profiler.plans_made,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "fusion_plan": opt.fusion_plan(),
            "owners": {str(a.key): a.owner for a in opt.work_plan.inversion.assignments},
            "precondition_owner": dict(opt.work_plan.preconditioners),
            "overlapped_steps": opt.kfac_step.overlapped_steps,
            "overlapped_factor_steps": opt.kfac_step.overlapped_factor_steps,
            "timeline": [asdict(it) for it in opt.timeline.iterations] if opt.timeline is not None else None,
        }
        if args.every_rank:  # momentum buffers, factors, inverses / eigendecompositions: compared across ranks
            results[name]["optimizer_state"] = opt.state_dict()
        opt.remove_hooks()
        print(f"rank {rank}/{size}: {name} done", flush=True)
    if args.every_rank:
        torch.save(results, f"{args.out}.rank{rank}")
    elif rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
