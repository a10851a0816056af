"""The preconditioning stage: every layer's gradient replaced by its K-FAC update, KL-clipped.

Each layer's averaged gradient becomes ``G_inv @ grad @ A_inv`` (or the eigen
form, :mod:`spdkfac.kfac.eigenbasis`), computed by every rank (COMM-OPT), or
by the layer's gradient workers (:mod:`spdkfac.plan.grad_workers`), each of which
broadcasts its group's results in one fused buffer to its receivers. All updates
are then scaled by the reference's KL clip
``ν = min(1, sqrt(kl_clip / |Σ lr² v·grad|))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import CommBackend, Handle
from ..kfac.layers import KFACLayer
from ..kfac.sharded_grads import whole_gradients
from ..plan.work_plan import WorkPlan
from .gradient_views import GradientWrites, StackedGradients
from .stacked_preconditioning import StackedDecompositions
from .timeline import IterationRecord, Timeline

__all__ = ["Preconditioner", "kl_clip_scale", "scale_updates_", "sums_stacks_at_once"]

#: Blocks until the given parameters' averaged gradients are in place.
GradWaiter = Callable[[list[torch.Tensor]], None]


#: ``(positions among the layers, gradient stack, update stack)`` of layers preconditioned stacked.
Stack = tuple[Sequence[int], torch.Tensor, torch.Tensor]


def kl_clip_scale(
    grads: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float | Sequence[float],
    kl_clip: float | None,
    stacks: Sequence[Stack] = (),
) -> torch.Tensor | None:
    """The factor every update is multiplied by, ``min(1, sqrt(kl_clip / |Σ lr² v·grad|))``, as a float64 scalar
    tensor on the updates' device (None without a clip). ``lr``: one for every layer, or each layer's own (its
    parameter group's: layers trained at different rates each enter the sum with their own step).

    Computed where the updates are, so that a GPU step needs no host
    synchronisation for it (the host would otherwise wait for the whole
    preconditioning before issuing the rest of the step). The arithmetic is
    the float64 one of summing the layers' float32 products in order (a
    sequential cumulative sum), then the square root and the clamp. The
    layers of ``stacks`` (slices of those stacks in ``grads`` and
    ``updates``) have their products summed by one reduction per stack on a
    GPU, where each sum is a kernel launch (to rounding the per-layer sums);
    on the CPU layer by layer, bitwise as unstacked.
    """
    if kl_clip is None:
        return None
    if not updates:
        return torch.ones((), dtype=torch.float64)
    home = updates[0].device
    found: dict[int, torch.Tensor] = {}
    for positions, grad, update in stacks:
        if sums_stacks_at_once(update.device):
            found.update(zip(positions, torch.mul(update, grad).sum(dim=(1, 2)).unbind(0)))
    rest = [i for i in range(len(updates)) if i not in found]
    if rest:  # (none where every layer is in a stack)
        # The products in one multi-tensor call (the same per-element products as ``update * grad``: fewer launches).
        elementwise = torch._foreach_mul([updates[i] for i in rest], [grads[i] for i in rest])
        found.update(zip(rest, (product.sum() for product in elementwise)))
    products = [found[i] for i in range(len(updates))]
    if len({(p.dtype, p.device) for p in products}) == 1:
        per_layer = torch.stack(products).to(torch.float64)
    else:
        per_layer = torch.stack([p.to(home, torch.float64) for p in products])
    if isinstance(lr, (int, float)):
        vg_sum = per_layer.cumsum(0)[-1].mul(lr**2).abs()
    else:
        squares = torch.tensor([float(r) ** 2 for r in lr], dtype=torch.float64, device=per_layer.device)
        vg_sum = per_layer.mul(squares).cumsum(0)[-1].abs()
    scale = torch.sqrt(torch.div(kl_clip, vg_sum)).clamp_(max=1.0)
    return torch.where(vg_sum > 0, scale, torch.ones_like(scale))  # (NaN or no product: 1; the NaN check follows)


def sums_stacks_at_once(device: torch.device) -> bool:
    """Whether the KL clip sums a stack's per-layer products by one reduction: off the CPU (see :func:`kl_clip_scale`)."""
    return device.type != "cpu"


def scale_updates_(updates: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every update by the clip's ``scale`` in place, as ``update.mul_(float(scale))`` would (the scale
    rounded to the update's arithmetic precision), with one multi-tensor call per dtype."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for update in updates:
        groups.setdefault((update.dtype, update.device), []).append(update)
    for (dtype, device), group in groups.items():
        factor = scale.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
        torch._foreach_mul_(group, factor)


@dataclass
class _Stacked:
    """A group preconditioned stacked: its positions among the step's layers, its gradient and update stacks, and
    the views its gradients were read by as one (None: layer by layer)."""

    positions: list[int]
    grad: torch.Tensor
    update: torch.Tensor
    views: StackedGradients | None


class Preconditioner:
    """Preconditions the layers' gradients in place, locally or split across ranks per the work plan."""

    def __init__(self, layers: list[KFACLayer], backend: CommBackend, plan: WorkPlan, wait_grads: GradWaiter) -> None:
        self.layers = layers
        self.backend = backend
        self.plan = plan
        self.wait_grads = wait_grads
        self.stacks = StackedDecompositions()
        #: Whether same-shape layers are preconditioned stacked: None (the default) on a GPU only, where the step is
        #: paced by kernel launches; on the CPU the arithmetic paces it and stacking measured slower (ResNet-50's
        #: step() 1.13x on 2 cores, benchmarks/stacked_preconditioning.py). True or False forces it (tests, comparisons).
        self.stack_groups: bool | None = None

    def run(
        self,
        damping: float,
        lr: float,
        kl_clip: float | None,
        wait_for_grads: bool = False,
        record: IterationRecord | None = None,
        layer_lrs: Mapping[str, float] | None = None,
    ) -> None:
        """Replace each layer's gradient by its KL-clipped update.

        With ``wait_for_grads`` the gradient all-reduces are still running:
        layers are taken last first (the order their gradients were sent in)
        and each waits only for its own gradient. ``layer_lrs``: the layers'
        own learning rates in the clip, where they differ from ``lr``.
        """
        t0 = Timeline.now() if record is not None else 0.0
        waited0 = record.grad_wait if record is not None else 0.0
        layers = [layer for layer in self.layers if layer.preconditions and layer.helper.weight.grad is not None]
        # Gradients sharded by FSDP are read whole, all-gathered in one order on every rank before any rank reads its
        # own layers' (with the layers split across ranks, each would reach them at another point), and written back.
        with whole_gradients([layer.helper for layer in layers]):
            stacked: list[_Stacked] = []
            if self.plan.groups is not None:
                grads, updates = self._distributed(layers, damping, wait_for_grads, record)
            else:
                grads, updates = self._local(layers, damping, wait_for_grads, stacked)
            in_stacks = {i for group in stacked for i in group.positions}
            alone = [i for i in range(len(layers)) if i not in in_stacks]
            rates = lr if layer_lrs is None else [layer_lrs.get(layer.name, lr) for layer in layers]
            scale = kl_clip_scale(grads, updates, rates, kl_clip, [(group.positions, group.grad, group.update) for group in stacked])
            if scale is not None:
                scale_updates_([group.update for group in stacked] + [updates[i] for i in alone], scale)
            writes = GradientWrites()
            viewed: set[int] = set()  # the layers of stacks read by their views: written from the stack
            for group in stacked:
                if group.views is not None:
                    writes.add_stack(group.views, group.update)
                    viewed.update(group.positions)
            for i, (layer, update) in enumerate(zip(layers, updates)):
                if i not in viewed:
                    writes.add(layer, update)
            writes.write()
        if record is not None:
            t1 = Timeline.now()
            record.precondition += t1 - t0 - (record.grad_wait - waited0)
            record.span("precondition", t0, t1)

    def _local(
        self, layers: list[KFACLayer], damping: float, wait_for_grads: bool, stacked: list[_Stacked]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer preconditioned here, same-shape layers stacked (:mod:`.stacked_preconditioning`).

        A group is preconditioned stacked when all its layers have a gradient
        this step (else layer by layer), and appended to ``stacked``; where
        their types give their gradients as views, it is read as one stack.
        With ``wait_for_grads`` the groups are taken in the order their
        gradients complete: the last-sent (first) layer of each last.
        """
        present = {layer.name: i for i, layer in enumerate(layers)}
        stack = self.stack_groups
        if stack is None:
            stack = bool(layers) and layers[0].helper.weight.device.type != "cpu"
        units: list[list[int]] = []
        for group in self.stacks.groups(self.layers) if stack else [[j] for j in range(len(self.layers))]:
            indices = [present[self.layers[j].name] for j in group if self.layers[j].name in present]
            units += [indices] if len(indices) == len(group) else [[i] for i in indices]
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for unit in sorted(units, key=min, reverse=True) if wait_for_grads else sorted(units, key=min):
            members = [layers[i] for i in unit]
            if wait_for_grads:
                for layer in reversed(members):
                    self.wait_grads(layer.params())
            if len(unit) == 1:
                grad = self._grad(members[0], wait=False)
                found[unit[0]] = (grad, members[0].precondition(grad, damping))
                continue
            views = StackedGradients.of(members)
            if views is not None:
                grad = views.read()
                grads = list(grad.unbind(0))
            else:
                grads = [self._grad(layer, wait=False) for layer in members]
                grad = torch.stack(grads)
            a, g = self.stacks.stacked(members)
            update = members[0].method.precondition(grad, a, g, damping)
            stacked.append(_Stacked(unit, grad, update, views))
            for i, layer_grad, layer_update in zip(unit, grads, update.unbind(0)):
                found[i] = (layer_grad, layer_update)
        return [found[i][0] for i in range(len(layers))], [found[i][1] for i in range(len(layers))]

    def _grad(self, layer: KFACLayer, wait: bool) -> torch.Tensor:
        """The layer's averaged gradient matrix, first waiting for its all-reduces if ``wait``."""
        if wait:
            self.wait_grads(layer.params())
        grad = layer.grad_matrix()
        assert grad is not None  # callers pass layers whose weight has a gradient
        return grad

    def _distributed(
        self, layers: list[KFACLayer], damping: float, wait_for_grads: bool, record: IterationRecord | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Precondition this rank's layers, broadcast them fused to their receivers, receive the others'.

        The broadcasts are issued in the plan's order on every rank; this
        rank computes its layers when it reaches its own broadcast, so the
        receives posted before complete while it computes. Returns every
        layer's averaged gradient and update.
        """
        rank = self.backend.rank
        missing = [layer.name for layer in layers if self.plan.holds(rank, layer.name) and not layer.decomposed]
        if missing:  # checked before any broadcast
            raise RuntimeError(f"layers {missing} have no {layers[0].method.label} yet; factors were never updated")
        names = [layer.name for layer in layers]
        index = {name: i for i, name in enumerate(names)}
        here = [index[n] for n in self.plan.preconditioned_here(rank, names)]
        grads: dict[int, torch.Tensor] = {}
        results: dict[int, torch.Tensor] = {}

        def precondition_mine() -> None:
            for i in reversed(here) if wait_for_grads else here:
                grads[i] = grad = self._grad(layers[i], wait_for_grads)
                results[i] = layers[i].precondition(grad, damping)

        pending: list[tuple[Handle, torch.Tensor, list[int]]] = []
        for b in self.plan.result_broadcasts(names):
            indices = [index[n] for n in b.layers]
            dtype = layers[indices[0]].update_dtype
            for i in indices[1:]:
                dtype = torch.promote_types(dtype, layers[i].update_dtype)
            device = layers[indices[0]].helper.weight.device
            if b.root == rank:
                if not results:
                    precondition_mine()
                buffer = torch.cat([results[i].reshape(-1).to(dtype) for i in indices])
            else:
                member = rank in b.members
                numel = sum(math.prod(layers[i].grad_shape) for i in indices) if member else 0
                buffer = torch.empty(numel, dtype=dtype, device=device)
            handle = self.backend.broadcast_within_async(buffer, b.root, b.members, f"spdkfac.precondition.{b.root}")
            pending.append((handle, buffer, indices if rank in b.members else []))
        t0 = Timeline.now()
        updates: dict[int, torch.Tensor] = {}
        for handle, buffer, indices in pending:
            handle.wait()
            offset = 0
            for i in indices:
                shape = layers[i].grad_shape
                updates[i] = buffer[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
        if record is not None:
            t1 = Timeline.now()
            record.precondition_wait += t1 - t0
            record.span("wait: preconditioned gradients", t0, t1)
        for i, layer in enumerate(layers):
            if i not in grads:  # another rank's layer: its gradient is still needed for the KL clip
                grads[i] = self._grad(layer, wait_for_grads)
        return [grads[i] for i in range(len(layers))], [updates[i] for i in range(len(layers))]
