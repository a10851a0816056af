"""Gradient averaging: one asynchronous all-reduce per parameter, started the moment autograd finishes it.

As Horovod's ``DistributedOptimizer``: a post-accumulate-grad hook on every
parameter starts its all-reduce, so the communication of the last layers'
gradients runs while the backward pass computes the earlier ones; the
optimizer waits for each only when it needs it. With gradient accumulation the
hook counts the backward passes and sends at the k-th. With a GradScaler the
wait is queued at the end of ``backward()``, because the scaler reads the
gradients before ``step()``; so it is where the script changes the gradients
between ``backward()`` and ``step()`` (clipping): the first step with
all-reduces waits there and tells (:meth:`GradientSync.learn_edits`). On a ``DistributedDataParallel`` model DDP
averages the gradients (:mod:`spdkfac.step.data_parallel`): the hooks only
count the passes. With a :class:`~spdkfac.step.collective_order.CollectiveOrder`
the all-reduces are issued in the order every rank agrees on, and a
parameter with a gradient on some ranks only gets the average with zeros
for the others (the gradient of the mean loss over all the workers' samples).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn as nn

from ..comm import CommBackend, Handle
from ..kfac.sharded_grads import parameter_slots
from .collective_order import CollectiveOrder, DeferredHandle, Slot
from .data_parallel import ModelWrapping
from .module_hooks import HookHandle, register
from .timeline import IterationRecord, Timeline

__all__ = ["GradNote", "GradientSync", "changed_since", "collective_names", "note_grad"]

#: A parameter's gradient tensor and that tensor's version counter when noted (:func:`note_grad`).
GradNote = tuple[torch.Tensor, int]


def note_grad(p: torch.Tensor) -> GradNote:
    """``p``'s gradient as it is now, for :func:`changed_since` (``p.grad`` must be set)."""
    assert p.grad is not None
    return p.grad, p.grad._version


def changed_since(p: torch.Tensor, note: GradNote) -> bool:
    """Whether ``p``'s gradient was replaced or changed in place since ``note`` (clipped, scaled, edited)."""
    grad, version = note
    return p.grad is not grad or grad._version != version


def collective_names(model: nn.Module, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, str]:
    """A name for every parameter that every rank agrees on (collectives are matched by name).

    The model's parameter name, else the position in ``param_groups``; never
    an object id, which differs between processes.
    """
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    for i, p in enumerate(p for group in param_groups for p in group["params"]):
        names.setdefault(p, f"param{i}")
    return names


class GradientSync:
    """Starts, counts and waits for the gradient all-reduces of one optimizer's parameters.

    Args:
        backend: the communication engine.
        param_groups: the optimizer's ``param_groups`` (read live: every parameter is averaged).
        names: parameter -> a name identical on every rank (collectives are
            matched by name).
        accumulation_steps: backward passes per step.
        grad_scaler: the mixed-precision ``GradScaler``, if any.
        on_final: called with each parameter whose gradient is final (its
            all-reduce started), from its hook: backward update fusion.
        wrapping: the model's data-parallel wrapping; when DDP averages the
            gradients, no all-reduce is started here.
        order: the step's all-reduce order (None: each all-reduce issued from its hook; then every rank must
            produce the same gradients).
    """

    def __init__(
        self,
        backend: CommBackend,
        param_groups: list[dict[str, Any]],
        names: dict[torch.Tensor, str],
        accumulation_steps: int,
        grad_scaler: Any | None,
        on_final: Callable[[torch.Tensor], None] | None = None,
        wrapping: ModelWrapping | None = None,
        order: CollectiveOrder | None = None,
    ) -> None:
        self.backend = backend
        self.order = order
        self.param_groups = param_groups
        self.names = names
        self.accumulation_steps = accumulation_steps
        self.grad_scaler = grad_scaler
        self.on_final = on_final
        self.wrapping = wrapping
        self._reduces = backend.size > 1 and not (wrapping is not None and wrapping.averages_gradients)
        self.record: IterationRecord | None = None
        self._handles: dict[torch.Tensor, Handle] = {}
        self._counts: dict[torch.Tensor, int] = {}  # backward passes that reached each parameter this step
        self.synchronized = False
        self.backward_seen = False  # a gradient hook fired since reset()
        self._sync_queued = False
        self._by_name: dict[str, torch.Tensor] = {}
        self._zeroed: list[torch.Tensor] = []  # parameters given a zero gradient for the all-reduce (no gradient here)
        self._short = False  # whether this step is a short window (fewer passes than accumulation_steps)
        self._last_short = False  # whether the previous step was
        #: Per parameter: its gradient and that tensor's version when its all-reduce started, until first waited for.
        self._sent: dict[torch.Tensor, GradNote] = {}
        #: Whether the script changes the gradients between backward() and step() (clipping, as most loops do): then
        #: their averages are completed at the end of backward(), as DDP does, so that it changes the averages. None
        #: until a step tells (:meth:`learn_edits`); until then they are completed there too.
        self.edits_gradients: bool | None = None
        #: The gradients and their versions when they were averaged at the end of this step's backward(), while the
        #: first step that can tell is under way.
        self._probe: dict[torch.Tensor, GradNote] | None = None
        #: Called when a backward pass begins after the gradients of this step's earlier passes were cleared (no
        #: step() between): True when it dropped those passes (the optimizer's _drop_cleared, which resets this).
        self.on_cleared: Callable[[], bool] | None = None
        self._hook_handles: list[HookHandle] = []
        #: Under FSDP2: each sharded parameter's whole copy, which its passes compute the gradient into (once seen).
        self._whole: dict[torch.Tensor, torch.Tensor] = {}
        if order is not None and self._reduces:
            order.add(self)
        if backend.size > 1 or accumulation_steps > 1 or on_final is not None:  # all-reduce, count the passes, or fuse
            # Held weakly by the parameters (:mod:`~spdkfac.step.module_hooks`): their hooks live in C++, where the
            # garbage collector cannot see them, so a hook holding the optimizer would keep it alive for good.
            hook = self._grad_hook
            params = [p for group in param_groups for p in group["params"] if p.requires_grad]  # (an added group's frozen)
            if wrapping is not None and wrapping.sharded_over is not None:
                self._hook_handles = self._hook_whole_copies(wrapping.module, params)
            else:
                self._hook_handles = [register(p.register_post_accumulate_grad_hook, hook) for p in params]

    def _hook_whole_copies(self, model: nn.Module, params: Iterable[torch.Tensor]) -> list[HookHandle]:
        """Count the passes of a model FSDP2 shards on the whole copies of its parameters.

        FSDP2 computes each gradient into the parameter's whole copy, which it
        registers in the parameter's place for its passes, and reduce-scatters
        it into the shard's gradient, where the shard's hooks run, only on the
        passes with gradient sync on: a micro-batch accumulated with
        ``set_requires_gradient_sync(False)`` (FSDP's ``no_sync()``) reaches the
        copy alone. Each module's forward pre-hook (after FSDP's, which puts the
        copies in place) hooks its parameters' copies the first time it sees
        them (FSDP keeps them from its first pass on).
        """
        slots = parameter_slots(model)
        by_module: dict[nn.Module, list[tuple[str, torch.Tensor]]] = {}
        for p in params:
            if id(p) in slots:
                module, name = slots[id(p)]
                by_module.setdefault(module, []).append((name, p))

        def see(module: nn.Module, args: Any) -> None:
            for name, sharded in by_module[module]:
                whole = module._parameters[name]
                if whole is not None and whole is not sharded and sharded not in self._whole:
                    self._whole[sharded] = whole
                    hook = functools.partial(self._whole_grad_hook, sharded)
                    self._hook_handles.append(register(whole.register_post_accumulate_grad_hook, hook))

        return [register(module.register_forward_pre_hook, see) for module in by_module]

    def _whole_grad_hook(self, sharded: torch.Tensor, whole: torch.Tensor) -> None:
        self._grad_hook(sharded)

    def reset(self, record: IterationRecord | None) -> None:
        """Forget the finished (or abandoned) step's handles and counts."""
        self.record = record
        self._handles.clear()
        self._counts = {}
        self.synchronized = False
        self.backward_seen = False
        self._sync_queued = False
        self._zeroed = []
        self._sent = {}
        self._probe = None
        self._last_short, self._short = self._short, False  # (a short window's step is reset after it)

    def cleared(self, but: torch.Tensor | None = None) -> bool:
        """Whether every parameter (``but`` one) that got a gradient in this step's backward passes has none now:
        the script cleared them (``model.zero_grad()``, as the DCGAN example does) without a ``step()``."""
        counted = False
        for p in self._counts:  # (stops at the first gradient kept: at once while accumulating)
            if p is not but:
                whole = self._whole.get(p)  # (FSDP2 accumulates there with gradient sync off)
                if p.grad is not None or (whole is not None and whole.grad is not None):
                    return False
                counted = True
        return counted

    @property
    def pending(self) -> int:
        """Gradient all-reduces started and not yet reset (0 after every ``step()``)."""
        return len(self._handles)

    def _grad_hook(self, p: torch.Tensor) -> None:
        passes = self._counts.get(p, 0) + 1
        if passes > 1 and self.on_cleared is not None and self.cleared(but=p) and self.on_cleared():
            passes = 1  # this backward pass runs on cleared gradients: the passes before were dropped (reset)
        if passes > self.accumulation_steps or p in self._handles:
            raise RuntimeError(
                f"parameter {self.names.get(p, '?')!r} received gradient number {passes} before step(), but "
                f"accumulation_steps is {self.accumulation_steps}: SPDKFACOptimizer averages gradients once per step, "
                f"after accumulation_steps backward passes (pass accumulation_steps=k to accumulate k micro-batches; for several "
                "losses of one forward pass, call backward() once on their sum)"
            )
        self._counts[p] = passes
        self.backward_seen = True
        if passes < self.accumulation_steps:  # accumulating: autograd sums into p.grad, nothing to send yet
            return
        if self._reduces:
            self._start(p)
        if self.grad_scaler is not None and not self._sync_queued:
            # GradScaler reads the gradients between backward() and step(): average them before it does.
            torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
            self._sync_queued = True
        elif self._reduces and self.on_final is None and self.edits_gradients is not False and not self._sync_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._synchronize_for_edits)
            self._sync_queued = True
        if self.on_final is not None:
            self.on_final(p)

    def _start(self, p: torch.Tensor) -> None:
        assert p.grad is not None  # called for parameters whose gradient is set
        name = f"spdkfac.grad.{self.names[p]}"
        # The transport writes the average through an alias with a version counter of its own (``.data``: the same
        # storage), so that only the script's changes move the gradient's: gloo copies a CUDA tensor's result back
        # with copy_(), which counts, where it writes a CPU tensor and NCCL a CUDA one without counting.
        alias = p.grad.data
        self._handles[p] = self.backend.allreduce_async(alias, name) if self.order is None else self.order.allreduce(alias, name)
        self._sent[p] = note_grad(p)

    def start_missing(self) -> None:
        """Start the all-reduce of every gradient whose hook did not (set outside autograd's accumulation)."""
        if not self._reduces:
            return
        for p in (p for group in self.param_groups for p in group["params"]):
            if p.grad is not None and p not in self._handles:
                self._start(p)

    def _settle(self) -> None:
        """Before waiting: with an order, every rank's all-reduces issued alike (the step's agreement), else the
        gradients set outside autograd started."""
        if self.order is not None:
            self.order.settle()
        else:
            self.start_missing()

    # -- the step's all-reduce order (OrderParticipant) ------------------------------------
    def universe(self) -> list[Slot]:
        """Every gradient all-reduce this step may start: one per trainable parameter (guessed in reverse order)."""
        assert self.order is not None
        self._by_name = {f"spdkfac.grad.{self.names[p]}": p for group in self.param_groups for p in group["params"] if p.requires_grad}
        end = 2 * len(self.order.position)
        return [Slot(name, end - self.order.position.get(p, 0)) for name, p in self._by_name.items()]

    def send_held(self) -> None:
        """Start the gradients set outside autograd's accumulation."""
        self.start_missing()

    def fill(self, name: str) -> None:
        """A zero gradient for a parameter that has none here (its layer did not run on this worker), all-reduced."""
        p = self._by_name[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            self._zeroed.append(p)
        self._start(p)

    def report(self) -> list[float]:
        return []

    def agreed(self, present: dict[str, int], summed: list[int], workers: int) -> None:
        """A parameter no worker had a gradient for keeps none (it is not updated), as on one worker."""
        for p in self._zeroed:
            if present[f"spdkfac.grad.{self.names[p]}"] == 0:
                self._handles.pop(p).wait()
                self._sent.pop(p, None)
                p.grad = None
        self._zeroed = []

    def _synchronize_for_edits(self) -> None:
        """At the end of backward(): every average complete before the script may change the gradients; while it is
        not known whether it does, their versions noted for :meth:`learn_edits`."""
        self.synchronize()
        if self.edits_gradients is None:
            self._probe = {p: note_grad(p) for p in self._counts if p.grad is not None}

    def learn_edits(self) -> None:
        """At ``step()``: whether the script changed the gradients since backward() averaged them (the first step that
        tells decides for the run). If it did not, later steps complete the averages only when ``step()`` needs them,
        overlapped with its work; a script that begins changing them later is refused (:meth:`_check_untouched`).
        The K-FAC step asks; an optimizer that waits for every gradient as its ``step()`` begins (DistributedAdamW,
        DHO2) need not, and its averages are completed at the end of backward() on every step."""
        if self._probe is not None:
            self.edits_gradients = any(changed_since(p, note) for p, note in self._probe.items())
            self._probe = None

    def _check_untouched(self, p: torch.Tensor, sent: GradNote) -> None:
        """Raise RuntimeError when ``p``'s gradient (``sent``: as its all-reduce started) was changed in place or
        replaced while its all-reduce ran."""
        if changed_since(p, sent):
            raise RuntimeError(
                f"the gradient of {self.names.get(p, '?')!r} was changed (clipped, scaled, edited or replaced) between "
                "backward() and step() while its all-reduce was still running: the average would mix the change with "
                "the other workers' unchanged gradients, so the step is refused. The first step changed no gradient, so "
                "their averages are completed in step(); to clip or edit the gradients from a later step on, call "
                "optimizer.synchronize() (preconditioner.synchronize()) first: it returns when every gradient holds its "
                "average over the workers"
            )

    def wait(self, params: Iterable[torch.Tensor], checked: bool = True) -> None:
        """Block until these parameters' gradients are averaged (timed as non-overlapped GradComm); ``checked``:
        refuse a gradient the script changed while its all-reduce ran (not for gradients being dropped)."""
        if self.order is not None and not self.order.settled:
            params = list(params)  # (settling may change the handles of this iterable's source)
            if any(isinstance(h, DeferredHandle) and h.handle is None for h in (self._handles.get(p) for p in params)):
                self.order.settle()
        t0 = Timeline.now() if self.record is not None else 0.0
        for p in params:
            handle = self._handles.get(p)
            if handle is not None:
                sent = self._sent.pop(p, None)  # (checked at the first wait only)
                if sent is not None and checked:
                    self._check_untouched(p, sent)
                handle.wait()
        if self.record is not None:
            t1 = Timeline.now()
            self.record.grad_wait += t1 - t0
            self.record.span("wait: gradients", t0, t1)

    def done(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether these parameters' gradients are averaged already (non-blocking)."""
        return all(handle.done() for handle in (self._handles.get(p) for p in params) if handle is not None)

    def check_accumulated(self, caller: str, short_ok: bool = False) -> None:
        """Raise unless accumulation_steps backward passes ran (checked before any collective: the same on every worker).

        ``short_ok``: fewer passes are a short last window (an epoch's last
        micro-batches, which trainers step as they are), once: not in two steps
        in a row (then ``accumulation_steps`` does not match the loop), and not
        with a GradScaler on workers whose gradients are averaged here (it read
        them before their all-reduce, which a full window's last pass starts).
        """
        k = self.accumulation_steps
        passes = max(self._counts.values(), default=k)  # no backward: other checks apply
        short = short_ok and 0 < passes < k
        if passes != k and not short:
            raise RuntimeError(
                f"{caller} after {passes} backward pass(es), but accumulation_steps is {k}: run "
                f"backward() exactly {k} times (each micro-batch loss divided by "
                f"{k}) before every step(); zero_grad() discards the partial accumulation"
            )
        if short and self._last_short:
            raise RuntimeError(
                f"{caller} after {passes} backward pass(es) twice in a row, but accumulation_steps is {k}: a step after "
                f"fewer than {k} micro-batches is taken as the short last window of an epoch, once; pass the number of "
                "micro-batches the loop accumulates per step (the trainer's gradient_accumulation_steps)"
            )
        if short and self.grad_scaler is not None and self._reduces:
            raise RuntimeError(
                f"{caller} after {passes} of {k} micro-batches (a short last window) with a GradScaler on several "
                "workers: the scaler read the gradients before their average, which only a full window starts in "
                "backward(); wrap the model in DistributedDataParallel, or drop the incomplete last window "
                "(DataLoader(drop_last=True) with a multiple of accumulation_steps batches)"
            )
        self._short = short
        if self.wrapping is not None:
            self.wrapping.check_synchronized(caller)

    def synchronize(self, dropping: bool = False) -> None:
        """Wait until every gradient holds its average over the workers (idempotent within a step); ``dropping``:
        for gradients about to be dropped, which the script may have cleared meanwhile."""
        if not self.synchronized:
            self.check_accumulated("synchronize()", short_ok=not dropping)
        if self.synchronized or not self._reduces:
            if self.order is not None:  # (the factors' order, under DDP)
                self.order.settle()
            self.synchronized = True
            return
        self._settle()
        self.wait(list(self._handles), checked=not dropping)
        self.synchronized = True

    def remove_hooks(self) -> None:
        """Detach the parameter hooks."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
