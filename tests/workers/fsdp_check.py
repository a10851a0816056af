"""Multi-process worker: the optimizer on a model sharded by FSDP2 (``fully_shard``) and on the bare model.

Launched by the tests with ``torchrun`` (gloo), or with ``--backend single``
for the one-process reference on the global batch (every configuration then
runs on the bare model). Each rank trains on its contiguous shard of a fixed
global batch and saves, per configuration, its parameters and the base
optimizer's state gathered whole (``full_tensor()``), the K-FAC state (held
whole on every worker) and the K-FAC layer names, to ``OUT.rank<r>``.

A configuration is optimizer options plus ``fsdp``: shard the model (each
layer with parameters, then the root, as FSDP2's examples do) or not,
``model``: ``'small'`` (convolutions and linear layers), ``'language'``
(embedding, layer norms, attention, MLP: ``norm_layers='kfac'`` in its
options), ``'tied'`` (that model with its output layer tied to the
embedding) or ``'blocks'`` (the small net as two blocks, each sharded
whole), ``attack``: each micro-batch is first perturbed along its input
gradient (``torch.autograd.grad``, an adversarial example's), ``preconditioner``: a :class:`KFACPreconditioner` attached to
``torch.optim.AdamW`` (that name's keyword arguments) instead of the
optimizer's own update, ``no_sync``: accumulate the micro-batches but the
last with ``set_requires_gradient_sync(False)`` (FSDP's ``no_sync()``), ``amp``: the
GradScaler loop (scale 1024; FSDP's ``ShardedGradScaler`` on a sharded
model), ``hybrid``: HSDP, replica groups of 2 workers (on an even number of
workers above 2; plain sharding otherwise), and ``resume``:
halfway, save the model's and the optimizer's ``state_dict()`` (through
``torch.save``'s bytes) and load them into a new model and optimizer, which
train on (``'dcp'``, on a sharded model: save and load with
``torch.distributed.checkpoint``, which keeps the optimizer's ``state`` and
``param_groups`` only, and rank 0's ``kfac_state_dict()`` beside it), and
``compile``: ``'layers'``, each child compiled before the sharding
(torchtitan's order), or ``'root'``, the sharded model compiled, the
optimizer given the compiled one; ``unfreeze``: the first layer frozen
until halfway; ``shard_later``: the optimizer built on the bare model and the
model sharded after, with the optimizer's parameters swapped for the shards by
name as accelerate's ``prepare()`` does (``'swapped'``), or left (``'left'``),
or sharded after the first step (``'after-a-step'``), or after a new
optimizer loaded the first step's state (``'after-a-load'``): the next
step's error is recorded as ``refused``; ``offload``: FSDP's CPU offloading
(on this CPU-only machine the shards stay where they are; its code paths run).

    torchrun --nproc_per_node 2 tests/workers/fsdp_check.py --configs '<json>' --out result.pt
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import fully_sharded, small_net
from rank_results import save_config_results

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import CommBackend
from spdkfac.kfac.sharded_grads import is_sharded, whole

warnings.filterwarnings("ignore", message="no perf_model given")
warnings.filterwarnings("ignore", message="performance model")


class TinyLanguageModel(nn.Module):
    """Token embedding, a pre-norm attention block and MLP, a final norm and an output layer, over 6 tokens of the
    2x6x6 test input (its first channel's rows, quantised into 11 tokens); the last position's output classifies.
    ``tied``: the output layer is the embedding's weight (11 logits, the labels the first 5)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.norm1 = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
        self.head = nn.Linear(8, 11, bias=False) if tied else nn.Linear(8, 5)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x[:, 0, :, 0] * 3).round().long().clamp(-5, 5) + 5
        h = self.embed(tokens)
        q = self.norm1(h)
        h = h + self.attention(q, q, q, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        return self.head(h[:, -1])


def gathered(value: Any) -> Any:
    """``value`` with every sharded tensor replaced by its whole (a copy of every tensor)."""
    if isinstance(value, dict):
        return {k: gathered(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gathered(v) for v in value)
    if isinstance(value, torch.Tensor):
        return whole(value.detach()).clone()
    return value


def resumed_through_dcp(model: nn.Module, opt: SPDKFACOptimizer, build: Any, tag: str) -> tuple[nn.Module, SPDKFACOptimizer, Any]:
    """Save with ``torch.distributed.checkpoint`` (which keeps the optimizer's ``state`` and ``param_groups`` only)
    and rank 0's ``kfac_state_dict()`` beside it; load into a new model and optimizer as docs/fsdp.md says."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(tempfile.gettempdir()) / f"spdkfac-dcp-{tag}"
    model_state, optimizer_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))
    rank = torch.distributed.get_rank()
    if rank == 0:  # (the same on every worker)
        torch.save(opt.kfac_state_dict(), folder / "kfac.pt")
    torch.distributed.barrier()
    opt.remove_hooks()
    model, opt, _ = build()
    model_state, optimizer_state = get_state_dict(model, opt)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    opt.load_kfac_state_dict(torch.load(folder / "kfac.pt", weights_only=False))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return model, opt, opt


def run(backend: CommBackend, configs: dict[str, Any], x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """Every configuration trained for ``steps`` steps on this rank's shard: parameters, states and layers, gathered."""
    results = {}
    for name, cfg in configs.items():
        cfg = dict(cfg)
        sharded, adamw = cfg.pop("fsdp", False) and backend.size > 1, cfg.pop("preconditioner", None)
        hybrid = cfg.pop("hybrid", False) and backend.size % 2 == 0 and backend.size > 2
        kind, resume, no_sync = cfg.pop("model", "small"), cfg.pop("resume", False), cfg.pop("no_sync", False)
        attack, compiled, unfreeze = cfg.pop("attack", False), cfg.pop("compile", None), cfg.pop("unfreeze", False)
        shard_later, offload = cfg.pop("shard_later", None), cfg.pop("offload", False)
        scaler = None
        if cfg.pop("amp", False):  # FSDP's scaler agrees on an overflow over the workers' shards
            scaler = ShardedGradScaler("cpu", init_scale=1024.0) if sharded else torch.amp.GradScaler("cpu", init_scale=1024.0)
            cfg["grad_scaler"] = scaler

        def build(
            kind: str = kind,
            sharded: bool = sharded,
            hybrid: bool = hybrid,
            adamw: Any = adamw,
            cfg: dict = cfg,
            compiled: str | None = compiled,
            unfreeze: bool = unfreeze,
            shard_later: str | None = shard_later,
            offload: bool = offload,
        ) -> tuple[nn.Module, SPDKFACOptimizer, Any]:
            if kind in ("language", "tied"):
                model: nn.Module = TinyLanguageModel(tied=kind == "tied")
            else:
                model = small_net()
                if kind == "blocks":  # two blocks of layers: FSDP's hooks on a block's output run after its last layer's
                    model = nn.Sequential(nn.Sequential(*list(model)[:3]), nn.Sequential(*list(model)[3:]))
            if unfreeze:  # the first layer frozen until halfway
                model[0].requires_grad_(False)
            if compiled:
                torch._dynamo.reset()  # (earlier configurations compiled other instances of these classes)
            if compiled == "layers":  # torchtitan's order: each layer compiled, then sharded
                for child in model.children():
                    child.compile()
            if sharded and not shard_later:
                fully_sharded(model, hybrid, offload)
                assert all(is_sharded(p) for p in model.parameters())
            if compiled == "root":
                model = torch.compile(model)  # type: ignore[assignment]
            if adamw is None:
                opt = SPDKFACOptimizer(model, backend=backend, **cfg)
                base: Any = opt
            else:
                base = torch.optim.AdamW(model.parameters(), **adamw)
                opt = KFACPreconditioner(model, optimizer=base, backend=backend, **cfg).kfac
            if sharded and shard_later in ("swapped", "left"):  # accelerate's prepare(model, optimizer), FSDP2 plugin
                names = {p: n for n, p in model.named_parameters()}
                fully_sharded(model, hybrid)
                shards = dict(model.named_parameters())
                for group in base.param_groups if shard_later == "swapped" else []:
                    group["params"] = [shards[names[p]] for p in group["params"]]
            return model, opt, base

        model, opt, state_of = build()
        accumulate = opt.config.accumulation_steps
        for s in range(steps):
            if resume and s == steps // 2 and resume == "dcp" and sharded:  # FSDP's way: torch.distributed.checkpoint
                model, opt, state_of = resumed_through_dcp(model, opt, build, f"{name}-{os.environ['MASTER_PORT']}")
            elif resume and s == steps // 2:  # through a file's bytes, into a new model and optimizer
                saved = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": state_of.state_dict()}, saved)
                opt.remove_hooks()
                model, opt, state_of = build()
                checkpoint = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
                model.load_state_dict(checkpoint["model"])
                state_of.load_state_dict(checkpoint["optimizer"])
            if unfreeze and s == steps // 2:
                model[0].requires_grad_(True)  # type: ignore[index]
            if sharded and shard_later in ("after-a-step", "after-a-load") and s == 1:
                if shard_later == "after-a-load":  # a new optimizer loads the first step's state, then the sharding
                    saved = state_of.state_dict()
                    opt.remove_hooks()
                    model, opt, state_of = build()
                    state_of.load_state_dict(saved)
                fully_sharded(model, hybrid)
                try:  # (a whole step: the forward pass after the first training pass no longer looks)
                    state_of.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    state_of.step()
                except RuntimeError as exc:
                    results[name] = {"refused": str(exc)}
                break
            state_of.zero_grad()
            for i, (xm, ym) in enumerate(zip((x + 0.1 * s).chunk(accumulate), y.chunk(accumulate))):
                if no_sync and sharded:  # FSDP's no_sync(): reduce-scatter the last micro-batch's sum only
                    model.set_requires_gradient_sync(i == accumulate - 1)  # type: ignore[operator]
                if attack:  # an adversarial example's input gradient first: no weight gradient, no factors
                    xa = xm.clone().requires_grad_(True)
                    (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(xa), ym), xa)
                    xm = (xm + 0.05 * g.sign()).detach()
                loss = nn.functional.cross_entropy(model(xm), ym) / accumulate
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                state_of.step()
            else:
                scaler.step(state_of)
                scaler.update()
        if name in results:
            opt.remove_hooks()
            continue
        results[name] = {
            "params": gathered(model.state_dict()),
            "base_state": gathered(state_of.state_dict()["state"]),
            "kfac_state": opt.state_dict()["kfac"],
            "layers": sorted(layer.name for layer in opt.layers),
            "steps": opt.steps,
        }
        opt.remove_hooks()
        print(f"rank {backend.rank}/{backend.size}: {name} done", flush=True)
    return results


if __name__ == "__main__":
    save_config_results(run, "JSON object: name -> optimizer kwargs + 'fsdp' + 'model' + 'preconditioner'", steps=6)
