"""Models wrapped or sharded for data parallelism: DDP's or FSDP2's gradient averaging replaces the optimizer's own.

``SPDKFACOptimizer(DistributedDataParallel(model))`` preconditions
``model`` itself (the K-FAC layers, the collective names and the checkpoint
keys are the bare model's) and lets DDP average the gradients: DDP's buckets
all-reduce each gradient once, during the backward pass, and have finished
when ``backward()`` returns, so the optimizer starts no gradient all-reduce of
its own (the factors are still its own, pipelined and placed as on the bare
model). What DDP does not say in its gradients is checked here: that the last
backward pass before ``step()`` ran outside ``no_sync()`` (else nothing was
averaged), that DDP averages over the optimizer's workers, and that the
parameters are not updated inside ``backward()`` before DDP has averaged them.

A ``torch.compile`` wrapper (``OptimizedModule``, around the model or the
DDP, or inside the DDP) is looked through the same way: the layers, names,
``skip_layers`` and checkpoint keys are the bare model's.

A DDP wrapped around the bare model after the optimizer was built (what
accelerate's ``prepare()``, and so Hugging Face's ``Trainer``, do with an
optimizer built on the bare model) is found at the first forward pass it
runs (up to the model's first training pass) and adopted: from then on DDP
averages the gradients, as if the optimizer had been given the wrapper.

A model sharded by FSDP2 (``fully_shard`` on its root module and any of its
parts, on a mesh over the optimizer's workers: 1-D, or 2-D for hybrid
sharding) is taken as well: FSDP averages the gradients (its reduce-scatter leaves each worker its
rows of the average) and the layers read theirs whole
(:mod:`spdkfac.kfac.sharded_grads`). A model sharded after the optimizer was
built (accelerate's ``prepare()`` with its FSDP2 plugin, which also swaps the
optimizer's parameters for the shards) is found at its first forward pass,
before any step, and taken as if the optimizer had been built on it.

Wrappers that average or shard the gradients some other way (``nn.DataParallel``,
the first FSDP (``FullyShardedDataParallel``), a DDP inside the model or around a larger one, tensor
parallelism, Horovod's ``DistributedOptimizer`` around the optimizer) are refused with an error that
names the fix.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..kfac.sharded_grads import is_sharded
from .compiled_hooks import compiling, run_eagerly
from .module_hooks import HookHandle, register

__all__ = ["ModelWrapping", "bare_model", "refuse_wrapped_optimizer"]

_FIX = "pass the model (or its DistributedDataParallel wrapper) to SPDKFACOptimizer, which averages the gradients itself"


def refuse_wrapped_optimizer(optimizer_class: type) -> None:
    """Raise TypeError for the class Horovod's ``DistributedOptimizer`` derives from the optimizer's (its module is Horovod's)."""
    if optimizer_class.__module__.startswith("horovod"):
        raise TypeError(
            "SPDKFACOptimizer must not be wrapped in hvd.DistributedOptimizer: it averages the gradients itself (with "
            "Horovod under horovodrun), so Horovod's wrapper would average them a second time; use the optimizer directly"
        )


def _compiled_inner(model: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) runs, or None for any other module."""
    inner = getattr(model, "_orig_mod", None)
    return inner if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module) else None


def _unwrap(model: nn.Module) -> tuple[nn.Module, DistributedDataParallel | None]:
    """The bare model inside any ``torch.compile`` wrappers and at most one ``DistributedDataParallel``, and that DDP."""
    ddp = None
    while True:
        inner = _compiled_inner(model)
        if inner is not None:
            model = inner
        elif isinstance(model, DistributedDataParallel) and ddp is None:
            ddp, model = model, model.module
        else:
            return model, ddp


def bare_model(model: nn.Module) -> nn.Module:
    """The model inside its ``DistributedDataParallel`` and ``torch.compile`` wrappers (the model itself if none)."""
    return _unwrap(model)[0]


def _refuse_other_wrappers(model: nn.Module) -> None:
    """Raise ValueError for a wrapper whose gradient averaging or sharding the optimizer cannot work with."""
    for name, module in model.named_modules():
        where = f"the model's submodule {name!r} is" if name else "the model is"
        if isinstance(module, nn.DataParallel):
            raise ValueError(
                f"{where} an nn.DataParallel: it runs replicas on several GPUs of one process, whose factors the "
                f"optimizer never sees; start one process per GPU (torchrun) and {_FIX}"
            )
        if isinstance(module, DistributedDataParallel):  # (the outermost DDP is unwrapped before this check)
            inside = "the model" if name else "another DistributedDataParallel"
            raise ValueError(
                f"{where} a DistributedDataParallel inside {inside}: wrap the whole model once instead, "
                "SPDKFACOptimizer(DistributedDataParallel(model), ...), or pass the bare model"
            )
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                f"{where} wrapped by the first FSDP (FullyShardedDataParallel), whose flattened parameters hide the "
                "layers' weights: shard the model with FSDP2's fully_shard() instead (its root module last), or "
                f"{_FIX}"
            )
        if name and _is_fsdp2(module) and not _is_fsdp2(model):
            raise ValueError(
                f"{where} sharded by fully_shard() but the model's root module is not: apply fully_shard(model) to the "
                "root as well (FSDP2's usage), so that every parameter is sharded and FSDP averages every gradient"
            )
    for name, param in model.named_parameters():
        if not is_sharded(param):
            continue
        sharded: Any = param
        placements = tuple(type(p).__name__ + str(getattr(p, "dim", "")) for p in sharded.placements)
        if not _is_fsdp2(model) or placements not in _FSDP_PLACEMENTS:
            raise ValueError(
                f"the model's parameter {name!r} is a DTensor placed {list(sharded.placements)} on a device mesh of "
                f"shape {tuple(sharded.device_mesh.shape)}: K-FAC takes FSDP2's sharding (fully_shard: rows on each "
                f"worker of a 1-D mesh, or of each replica group of a 2-D one, HSDP) but not tensor or sequence "
                f"parallelism; {_FIX}"
            )


#: How FSDP2 places a parameter: rows over a 1-D mesh; replicated over a 2-D mesh's first dimension and rows over
#: its second (hybrid sharding, HSDP).
_FSDP_PLACEMENTS = (("Shard0",), ("Replicate", "Shard0"))


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether ``fully_shard()`` was applied to ``module`` (its class is then derived from ``FSDPModule``)."""
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def _mesh_size(model: nn.Module) -> int | None:
    """The size of the device mesh FSDP shards the model's parameters over; None where it shards none."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return None


class ModelWrapping:
    """The bare model inside a ``DistributedDataParallel`` (if any), and the checks that DDP's averaging needs.

    Args:
        model: the bare model or its ``DistributedDataParallel`` wrapper
            (other data-parallel wrappers raise ValueError).

    Attributes:
        module: the bare model (inside DDP and ``torch.compile``): the optimizer's layers, names and hooks are its.
        ddp: the wrapper, or None; when set, DDP averages the gradients.
        sharded_over: the number of workers FSDP2 shards the model over (``fully_shard``), or None; when set, FSDP
            averages the gradients.
    """

    def __init__(self, model: nn.Module) -> None:
        self.module, self.ddp = _unwrap(model)
        _refuse_other_wrappers(self.module)
        self.sharded_over = _mesh_size(self.module) if _is_fsdp2(self.module) else None
        if self.ddp is not None and self.sharded_over is not None:
            raise ValueError(
                "the model is sharded by fully_shard() and wrapped in DistributedDataParallel: FSDP averages the "
                "gradients already; pass the sharded model without the DDP"
            )
        self._last_pass_synced = True  # whether the latest forward pass under autograd will have DDP average its gradients
        self._hook: HookHandle | None = None
        self._stale: HookHandle | None = None  # the bare model's hook once a DDP is adopted, until the next step()
        self._adopt: Callable[[], None] = lambda: None
        self._adopt_sharding: Callable[[], None] = lambda: None

    def attach(self, adopt: Callable[[], None], adopt_sharding: Callable[[], None] = lambda: None) -> None:
        """Hook the forward pass (called last in the optimizer's construction, so a refused one leaves no hook).

        On a DDP model: note whether each pass runs inside ``no_sync()``. On a
        bare model: at each forward pass up to its first training pass, look
        for a DDP around it; one found becomes :attr:`ddp`, and ``adopt()`` is
        called (the optimizer then re-plans so that DDP averages the gradients).
        A bare model that ``fully_shard()`` has sharded since sets
        :attr:`sharded_over`, and ``adopt_sharding()`` is called with the
        model's parameters its shards (the optimizer then takes them as its
        construction on the sharded model would).
        """
        self._adopt = adopt
        self._adopt_sharding = adopt_sharding
        self._hook = (
            register(self.ddp.register_forward_pre_hook, self._ddp_forward)
            if self.ddp is not None
            else register(self.module.register_forward_pre_hook, self._bare_forward)
        )

    @property
    def leaves_parameters_unused(self) -> bool:
        """Whether DDP lets a step leave parameters unused on some workers (``find_unused_parameters=True``): a
        layer may then run on some workers only, and the optimizer's collectives need a process group of their own
        (:meth:`~spdkfac.comm.base.CommBackend.apart_from_default_group`)."""
        return self.ddp is not None and bool(getattr(self.ddp, "find_unused_parameters", False))

    @property
    def averages_gradients(self) -> bool:
        """Whether DDP or FSDP averages the gradients (the optimizer then starts no gradient all-reduce)."""
        return self.ddp is not None or self.sharded_over is not None

    def check(self, workers: int, update_fusion: str) -> None:
        """Raise ValueError when DDP or FSDP averages over other processes than the optimizer's, or DDP with backward
        fusion, or FSDP with update fusion, is asked for."""
        if self.sharded_over is not None:
            if self.sharded_over != workers:
                raise ValueError(
                    f"fully_shard() shards the model over {self.sharded_over} processes but the optimizer's backend has "
                    f"{workers} workers: shard on the default process group's mesh (fully_shard's default) and build "
                    "the optimizer with backend='auto' (or 'torch') in the same torchrun job"
                )
            if update_fusion != "none":
                raise ValueError(
                    f"update_fusion={update_fusion!r} cannot be used with a model sharded by fully_shard(): FSDP holds "
                    "the whole weights only inside its forward and backward passes; use update_fusion='none'"
                )
            return
        if self.ddp is None:
            return
        size = _group_size(self.ddp.process_group)
        if size != workers:
            raise ValueError(
                f"DistributedDataParallel averages the gradients over {size} processes but the optimizer's backend has "
                f"{workers} workers: build DDP on the default process group and the optimizer with backend='auto' "
                "(or 'torch') in the same torchrun job"
            )
        if update_fusion == "backward":
            raise ValueError(
                "update_fusion='backward' cannot be used with a DistributedDataParallel model: it updates each layer as "
                "soon as autograd finishes its gradient, before DDP has averaged it; use update_fusion='forward'"
            )

    def check_scaler(self, grad_scaler: Any | None, workers: int) -> None:
        """Raise ValueError for a GradScaler that would decide alone on each worker of a sharded model.

        A ``GradScaler`` checks for overflow in the gradients it holds: under
        FSDP each worker holds its rows only, so one worker can skip a step
        that another takes. FSDP's ``ShardedGradScaler`` agrees over the
        workers first.
        """
        if self.sharded_over is None or workers < 2 or grad_scaler is None:
            return
        if not any(c.__name__ == "ShardedGradScaler" for c in type(grad_scaler).__mro__):
            raise ValueError(
                f"grad_scaler is a {type(grad_scaler).__name__} on a model sharded by fully_shard(): it would look for "
                "an overflow in each worker's shard of the gradients alone, and a worker could skip a step the others "
                "take; use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which agrees over the workers"
            )

    def _ddp_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._last_pass_synced = bool(getattr(module, "require_backward_grad_sync", True))

    def _bare_forward(self, module: nn.Module, args: Any) -> None:
        if self.ddp is not None:  # adopted in this pass
            return
        if self.sharded_over is None and _is_fsdp2(module):
            run_eagerly(self._take_sharding)(module)
            return
        active = DistributedDataParallel._active_ddp_module
        if active is not None:
            run_eagerly(self._take_ddp)(active)  # (compiled: a graph break, once; the graph is traced again after it)
        elif not compiling() and module.training and torch.is_grad_enabled():
            # (traced: the check stays in the graph, a guard on DDP's class attribute)
            self.remove_hooks()  # checked at the first training pass: a model is wrapped before it is trained

    def _take_ddp(self, ddp: DistributedDataParallel) -> None:
        """Adopt the DDP found around the bare model: watch its ``no_sync()`` and let the optimizer re-plan."""
        if _unwrap(ddp)[0] is not self.module:
            raise RuntimeError(
                "the model runs inside a DistributedDataParallel but SPDKFACOptimizer was given a part of the model "
                "DDP wraps: DDP and the optimizer would both average the gradients; pass the wrapper, "
                "SPDKFACOptimizer(ddp_model, ...), and the optimizer lets DDP average them"
            )
        self._stale = self._hook  # removed at the next step(): a compiled bare model may not change its hooks in its pass
        self.ddp = ddp
        self._last_pass_synced = bool(getattr(ddp, "require_backward_grad_sync", True))
        self._hook = register(ddp.register_forward_pre_hook, self._ddp_forward)
        self._adopt()

    def _take_sharding(self, module: Any) -> None:
        """Adopt the FSDP2 sharding applied to the bare model since construction. FSDP's own pre-forward hook (run
        before this one) has put the whole parameters of the root's group in place: they go back to their shards
        while the optimizer takes the model in, and are gathered again for the pass (one all-gather more, once)."""
        module.reshard()
        try:
            _refuse_other_wrappers(self.module)
            self.sharded_over = _mesh_size(self.module)
            self._adopt_sharding()
        finally:
            module.unshard()

    def check_synchronized(self, caller: str) -> None:
        """Raise RuntimeError when the last backward pass ran inside ``no_sync()``: its gradients were not averaged."""
        if self._stale is not None:
            self._stale.remove()
            self._stale = None
        if self.ddp is not None and not self._last_pass_synced:
            raise RuntimeError(
                f"{caller} after a backward pass run inside DistributedDataParallel.no_sync(): DDP has not averaged the "
                "gradients; run the last micro-batch's forward and backward outside no_sync() (and pass "
                "accumulation_steps=k to the optimizer for k micro-batches per step)"
            )

    def remove_hooks(self) -> None:
        """Detach the forward hooks."""
        for handle in (self._hook, self._stale):
            if handle is not None:
                handle.remove()
        self._hook = self._stale = None


def _group_size(group: Any) -> int:
    import torch.distributed as dist  # optional: only a DDP model, which needs it, gets here

    return int(dist.get_world_size(group))
