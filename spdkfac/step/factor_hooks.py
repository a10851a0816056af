"""The Kronecker factors of each step: computed in the layers' hooks, sent while the passes go on.

A forward pre-hook computes each layer's ``A`` from its input; a gradient
hook on the layer's output computes ``G`` as soon as the backward pass reaches
it. Each goes straight to the :class:`~spdkfac.step.factor_allreduce.TensorFusionController`
(pipelining), or is kept until ``step()`` (D-KFAC's all-at-once). With
gradient accumulation the early micro-batches' factors are summed locally and
only the k-th is sent, as their mean (weighed by their samples where those
differ between the micro-batches: a routed layer's, :meth:`FactorCollector._complete`). While a fusion plan is being made, or a
timeline recorded, each factor's computation is timed, and the hook's own
work beyond it (bookkeeping, packing into a fusion buffer, launching the
all-reduce).

How the hooks count (docs/shared-layers.md):

* a layer used ``k`` times in a pass (one module at several places, two views
  through one encoder, a recurrent cell, tied modules) sends one factor per
  step: ``A`` the mean of its uses' ``A``, ``G`` their sum (the "expand"
  setting of Eschenhagen et al., 2023). The number of calls a factor takes per
  step is learned from the last step (one per pass to start with), so the
  common case sends from the hook that completes it, as before; the calls
  beyond the expected number are summed apart, sent at ``step()`` and folded
  in, and a factor that took fewer is sent at ``step()``;
* the forward pass an activation checkpoint recomputes during backward is not
  counted (:func:`recomputing`);
* a layer that did not run in a step keeps its running averages and
  decompositions; its gradient, if any, is preconditioned with those
  decompositions (the identity's if it never ran). A layer that
  ran on some workers only gets the mean of their factors: the workers agree
  on who ran what through the step's
  :class:`~spdkfac.step.collective_order.CollectiveOrder`, which also keeps
  the all-reduces paired;
* an embedding that looks positions up once, ``wpe(torch.arange(T))``, beside
  a lookup of ``(N, T)`` tokens, presumably broadcast over the batch, is one
  sample to K-FAC: a warning says so once (:mod:`~spdkfac.step.broadcast_lookup`);
* a forward use with gradients on that no backward pass reaches (a metric's
  pass, a detached branch) cannot be told apart when its ``A`` is taken: it
  is counted, and a warning says so once;
* a forward pass whose backward pass computes no weight gradient and builds
  no graph (an adversarial attack's ``torch.autograd.grad`` with respect to
  the input: FGSM, PGD) adds nothing to the step's gradient. Before the
  step's first weight gradient, the next forward pass drops the factors
  taken so far (:attr:`FactorCollector.input_gradient_passes`), so the step's
  ``A`` is that of the training pass alone; after it (such passes in a later
  micro-batch) they stay counted, and a warning says so once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..kfac.layer_types import EmbeddingHelper, LinearHelper
from ..kfac.layers import FACTOR_KINDS, FactorKey, FactorKind, KFACLayer
from ..kfac.linalg import non_finite_indices
from ..kfac.sharded_grads import is_sharded
from .broadcast_lookup import BroadcastLookups
from .collective_order import CollectiveOrder, Slot
from .compiled_hooks import register_factor_pre_hook, register_output_grad_hook
from .factor_allreduce import TensorFusionController, group_name
from .factor_profiler import FusionProfiler
from .nonfinite import NonFiniteFactorError, NonFiniteGuard
from .timeline import IterationRecord, Timeline

__all__ = ["FactorCollector", "computes_grad_of", "recomputing", "warn_if_float16_autocast"]

#: The autograd node of a reentrant ``torch.utils.checkpoint`` segment: its backward re-runs the forward, counted.
_REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"
#: Suffix of the name under which a layer's calls beyond those expected travel (no module name holds '#').
_MORE = "#more"
#: Suffix of the name under which the sample-count correction of a layer with uneven samples travels.
_UNEVEN = "#uneven"
#: Entries per layer in :meth:`FactorCollector.report`: four per factor, then G's samples in its last call, and summed
#: over the step's calls with their square, then whether it was called more than once in a pass.
_REPORT_ROW = 4 * len(FACTOR_KINDS) + 4
#: What to do about one backward pass too many before step().
_ACCUMULATION_ADVICE = (
    "To accumulate k micro-batches, each backward()ed before one step() (gradient accumulation, a trainer's "
    "gradient_accumulation_steps, a discriminator's real and fake batches), pass accumulation_steps=k; otherwise call "
    "step() after every forward/backward pass. To skip a batch after its forward pass, decide with "
    "optimizer.finite_everywhere(loss), which drops its factors on every worker; after its backward pass (an "
    "adversarial attack's, as fast FGSM takes), clear its gradients (optimizer.zero_grad(), or the model's) before the "
    "next backward pass"
)


def recomputing() -> bool:
    """Whether a forward pass runs inside a backward pass to recompute checkpointed activations, already counted.

    A non-reentrant checkpoint (``use_reentrant=False``) recomputes its
    segment from inside the autograd node that unpacks a saved tensor; the
    segment's first forward pass ran with gradients on and was counted. A
    reentrant checkpoint ran its first forward without gradients (nothing
    counted), so its recomputation, inside ``CheckpointFunctionBackward``, is
    the pass that counts.
    """
    if torch._C._current_graph_task_id() == -1:  # not in a backward pass: the common case, one cheap call
        return False
    node = torch._C._current_autograd_node()
    return node is None or type(node).__name__ != _REENTRANT_CHECKPOINT_NODE


def computes_grad_of(weight: torch.Tensor) -> bool:
    """Whether the backward pass running now computes ``weight``'s gradient (called from a gradient hook).

    Only such passes give a layer's ``G``: the factor describes the
    gradient the step uses. A ``torch.autograd.grad(out, inputs)`` or
    ``backward(inputs=...)`` that needs other tensors' gradients only (a
    gradient penalty's derivative with respect to the input, as WGAN-GP, R1
    and physics-informed losses take with ``create_graph=True``) still
    passes through the layer's output, with the output gradient of another
    scalar than the loss: left out. A ``torch.autograd.grad`` with respect to
    the weight itself computes it (torch cannot say more there), and so
    does a compiled backward (which cannot take a penalty's double backward),
    and so does a weight FSDP2 still holds sharded when the hook runs (the last
    layer of a sharded part: FSDP registers its whole copy in a hook on the
    same output, which runs after this one).
    """
    if is_sharded(weight):  # FSDP2's shard, before its hook (on the same output) put the whole copy in its place
        return True
    try:
        return bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(weight).node))
    except (RuntimeError, AttributeError):  # autograd.grad with respect to the weight; a compiled graph's tap
        return True


def warn_if_float16_autocast(x: torch.Tensor) -> None:
    """Warn when the first factor step's forward pass runs under float16 autocast and no ``grad_scaler`` was given.

    A float16 loop scales its loss with a GradScaler (Lightning's
    ``precision='16-mixed'``, Hugging Face's ``fp16=True``, or the script's
    own); unless the optimizer is given that scaler it cannot divide the scale
    out, and every G factor is the scale squared (some 4e9) times too large:
    the damping then counts for nothing.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
        warnings.warn(
            "the forward pass runs under float16 autocast but the optimizer was given no grad_scaler: if a "
            "torch.amp.GradScaler scales the loss (as float16 training does: Lightning's precision='16-mixed', its "
            "self.trainer.precision_plugin.scaler; Hugging Face's fp16=True, the Trainer's self.accelerator.scaler "
            "in create_optimizer()), pass it, SPDKFACOptimizer(..., grad_scaler=scaler) or "
            "KFACPreconditioner(..., grad_scaler=scaler); without it the G factors hold the loss scale squared "
            "and the damping counts for nothing",
            stacklevel=2,
        )


@dataclass
class _Tally:
    """One factor's calls in this step: their local sum until sent, and the calls beyond those expected."""

    calls: int = 0
    total: torch.Tensor | None = None
    sent: int = 0  # calls in the factor sent under the layer's key (0: not sent yet)
    samples: int = 0  # the samples of its calls, summed
    count: int = 0  # the samples of its first call
    #: Once a call's samples differ from the first call's (a routed layer's micro-batches): the calls' factors weighed
    #: by their samples, ``Σ n F`` (A) or ``Σ F / n`` (G), beside the plain sum ``total``.
    weighted: torch.Tensor | None = None
    extra: torch.Tensor | None = None  # the sum of the calls after it, sent at step() and folded in

    def add(self, kind: str, factor: torch.Tensor, samples: int, passes: bool) -> None:
        """Add a call's factor to the sums (not to ``extra``); ``passes``: the step has several (accumulation), the
        only case that weighs them (:meth:`FactorCollector._complete`)."""
        if self.total is None:
            self.total, self.count = factor, samples
        else:
            if self.weighted is None and passes and samples != self.count:  # (the calls before had the first's samples)
                self.weighted = self.total.mul(self.count) if kind == "A" else self.total.div(self.count)
            self.total.add_(factor)
            if self.weighted is not None:
                self.weighted.add_(factor, alpha=samples if kind == "A" else 1.0 / samples)
        self.samples += samples


def _call_samples(layer: KFACLayer, kind: str) -> int:
    """The samples of the factor call ``layer`` just computed (its input's for A, its output gradient's for G)."""
    return layer.input_samples if kind == "A" else layer.local_samples


class FactorCollector:
    """Hooks on every preconditioned layer that compute and send its batch factors.

    Args:
        layers: the preconditioned layers.
        controller: where the factors are sent.
        profiler: times the factors while a fusion plan is being made.
        pipelining: send each factor from its hook (else at ``step()``).
        accumulation_steps: backward passes per step.
        collecting: whether a forward pass of this module computes factors
            (training mode, gradients on, a factor step).
        loss_scale: the loss scale of this backward pass (GradScaler; 1 without).
        factor_step: whether this step computes factors (fixed for the step, the same on every rank).
        order: the step's all-reduce order (None: the controller's; then every rank must run the same layers).
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        controller: TensorFusionController,
        profiler: FusionProfiler,
        pipelining: bool,
        accumulation_steps: int,
        collecting: Callable[[nn.Module], bool],
        loss_scale: Callable[[], float],
        factor_step: Callable[[], bool] = lambda: True,
        order: CollectiveOrder | None = None,
    ) -> None:
        self.layers = layers
        self.factor_step = factor_step
        self.workers = controller.backend.size
        #: Per factor: how many workers computed it in the last factor step (agreed through the order).
        self.ranks_ran: dict[FactorKey, int] = {}
        #: Per layer: the global batch its G saw in the last factor step (EKFAC's ``B``), over the workers and the
        #: accumulation_steps micro-batches, where each pass gives it its last call's samples unless it takes at most
        #: one per pass (then all its samples: a routed layer's differ between passes).
        self.samples: dict[str, int] = {}
        self.controller = controller
        self.profiler = profiler
        self.pipelining = pipelining
        self.accumulation_steps = accumulation_steps
        self.collecting = collecting
        self.loss_scale = loss_scale
        self.record: IterationRecord | None = None
        self.arrived: dict[str, list[FactorKey]] = {"A": [], "G": []}
        self.backward_seen = False  # a G factor was computed since reset()
        #: Calls each factor takes per step, learned from the last factor step that ran the layer.
        self.expected: dict[FactorKey, int] = {}
        #: Layers whose factors the last factor step did not fold in (they did not run).
        self.skipped: list[str] = []
        #: The factors of the last factor step that did not take their expected calls on every worker, or ran on some
        #: workers only: sent at step() somewhere, or not at their usual call.
        self.irregular: set[FactorKey] = set()
        self._by_name = {layer.name: layer for layer in layers}
        self._names: dict[str, list[FactorKey]] = {}  # this step's factor all-reduces (the order's universe)
        #: (calls, calls sent under the key, calls expected), every rank alike.
        self._agreed: dict[FactorKey, tuple[int, int, int]] = {}
        self._more: set[FactorKey] = set()  # factors some worker sent extra calls for (folded in at take())
        self._order = order
        if order is not None:
            order.add(self)
        self._stash: list[tuple[FactorKey, torch.Tensor]] = []
        self._a_taken: set[str] = set()
        self.empty_inputs = False  # whether a layer was called with no sample in this step (here)
        self._tally: dict[FactorKey, _Tally] = {}
        self._passes = 0  # forward passes that computed a factor this step
        self._g_since_a = True  # a G hook ran since the last A hook (the next A hook starts a pass)
        #: Called when a forward pass begins after backward passes of this step (with whether it is one more than
        #: accumulation_steps): True when it dropped those passes (their step() is not coming: the optimizer's
        #: _drop_unstepped, which always does for one pass too many, at least provisionally), which makes this pass
        #: the step's first; False counts it as the next. The default drops nothing and refuses one pass too many.
        self.unstepped: Callable[[bool], bool] = lambda exceeded: False
        #: Called when a forward pass begins after a backward pass that computed no weight gradient and built no
        #: graph, with no weight gradient since: True when it dropped the step's factors taken so far (the passes
        #: were an attack's, with no weight gradient in the step yet: the optimizer's _drop_input_gradient_passes).
        self.input_gradient_passes: Callable[[], bool] = lambda: False
        #: Set by the optimizer when it let a forward pass beyond accumulation_steps through, on gradients not cleared,
        #: having dropped the passes before (fast adversarial training clears them between that forward pass and its
        #: backward): the K-FAC weights that had gradients then. The next backward pass must find those cleared, or
        #: it is refused (:meth:`_check_cleared`), after ``refused`` forgets the step.
        self.must_be_cleared: list[torch.Tensor] | None = None
        self.refused: Callable[[], None] = lambda: None
        self._input_gradient_pass = False  # such a backward pass reached a use since the last A hook
        self._attack_noted = False  # whether such passes counted in a later micro-batch were warned about
        self._repeat_noted = False  # whether a second backward pass through one forward pass was warned about
        self._unused_noted = False  # whether a forward use whose output got no gradient was warned about
        self._uneven_noted = False  # whether layers that took different numbers of samples on the workers were warned about
        #: Layers that took different numbers of samples on the workers in some factor step (a routed expert), and
        #: those that ran in some factor step: agreed, alike on every rank. A layer in the first, or not in the second,
        #: keeps its local factors until step() (:meth:`_keep_local`), so that uneven samples can be weighed exactly.
        self.uneven_layers: set[str] = set()
        self._agreed_layers: set[str] = set()
        self._local: dict[FactorKey, torch.Tensor] = {}  # this step's local factors kept for the correction
        self._corrected: set[FactorKey] = set()  # factors whose sample-count correction was sent (folded in at take())
        self._corrections: list[tuple[FactorKey, torch.Tensor]] = []  # those corrections, sent together after the agreement
        self._reached: dict[str, int] = {}  # per layer: the uses whose output a backward pass reached this step (here)
        self._lookups = BroadcastLookups()  # position embeddings looked up once for the batch: said once
        #: Called once, with the input of the first factor computed (then set to None): the optimizer's first look
        #: at the forward pass's precision.
        self.first_input: Callable[[torch.Tensor], None] | None = None
        self._hook_handles: list[Any] = []
        for layer in layers:
            # (registered so that a torch.compile'd forward calls them without a graph break: compiled_hooks)
            for module in layer.modules:
                self._hook_handles.append(register_factor_pre_hook(module, self._a_hook(layer)))
                self._hook_handles.append(register_output_grad_hook(module, *self._g_hook(layer), self._repeated_backward))

    def carry_over(self, previous: FactorCollector) -> None:
        """Continue what a replaced collector learned across steps: the layers' use counts, which layers took
        uneven samples and which ran."""
        self.expected.update(previous.expected)
        self.uneven_layers |= previous.uneven_layers
        self._agreed_layers |= previous._agreed_layers

    def reset(self, record: IterationRecord | None) -> None:
        """Start a new step: nothing computed, nothing kept back."""
        self.record = record
        self.arrived = {"A": [], "G": []}
        self.backward_seen = False
        self._stash = []
        self.empty_inputs = False
        self._a_taken = set()
        self._tally = {}
        self._reached = {}
        self._passes = 0
        self._g_since_a = True
        self._input_gradient_pass = False
        self.must_be_cleared = None
        self._names = {}
        self._agreed = {}
        self._more = set()
        self._local = {}
        self._corrected = set()
        self._corrections = []
        self._lookups.reset()
        for layer in self.layers:
            layer.helper.forget()  # inputs a forward pass kept for a backward pass that never came

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if self.collecting(module) and not recomputing():
                if not inputs:  # (a forward pre-hook sees positional arguments only)
                    raise TypeError(
                        f"layer {layer.name!r} was called with its input as a keyword argument ({type(module).__name__}"
                        "(input=x)), which K-FAC's forward hooks cannot see: pass it positionally, or list the layer "
                        "in skip_layers"
                    )
                if isinstance(inputs[0], torch.Tensor) and inputs[0].numel() == 0:
                    self.empty_inputs = True  # no sample (an empty batch, a branch nothing was routed to): as if not run
                    return
                if isinstance(inputs[0], torch.Tensor):
                    self._see_sequences(layer, inputs[0])
                    if self.first_input is not None:
                        first_input, self.first_input = self.first_input, None
                        first_input(inputs[0])
                self._submit(layer, "A", lambda: layer.compute_a(inputs[0]))

        return hook

    def _see_sequences(self, layer: KFACLayer, x: torch.Tensor) -> None:
        """Shows :class:`BroadcastLookups` the batch of sequences a layer took, or an embedding's 1-D lookup."""
        helper = layer.helper
        if isinstance(helper, EmbeddingHelper):
            if x.dim() == 2:
                self._lookups.batch(layer.name, x.shape[0], x.shape[1])
            elif x.dim() == 1:
                self._lookups.lookup(layer.name, x)
        elif isinstance(helper, LinearHelper) and x.dim() == 3 and helper.sequence != "sequence_first":
            self._lookups.batch(layer.name, x.shape[0], x.shape[1])

    def _g_hook(self, layer: KFACLayer) -> tuple[Callable[[], bool], Callable[[torch.Tensor], bool]]:
        """When the layer's output gradient is wanted (its A was taken this step), and what computes G from it.

        Registered as a hook on the layer output's gradient
        (:func:`~spdkfac.step.compiled_hooks.register_output_grad_hook`): it
        fires in the backward pass as soon as the gradient with respect to
        this layer's output is known, like a full backward hook, but it also
        works when the next operation modifies the output in place
        (``ReLU(inplace=True)``) and for a first layer whose input needs no
        gradient. Each use of the layer attaches its own. A non-reentrant
        checkpoint's recomputation attaches one too, to an output that no
        backward pass goes through (the recomputed tensors only replace the
        saved ones), so it never fires: G needs no recomputation check, only
        A does (:func:`recomputing`).
        """

        def g_ready(grad_output: torch.Tensor) -> bool:
            """Compute G from the gradient (True), unless no sample reached the use or this pass computes no weight gradient."""
            if grad_output.numel() == 0:  # the output of a use with no sample (its A was not taken either)
                return False
            if self.must_be_cleared is not None:
                self._check_cleared(layer)
            self._reached[layer.name] = self._reached.get(layer.name, 0) + 1  # (any backward pass, a penalty's too)
            if not computes_grad_of(layer.weight_now()):  # torch.autograd.grad(..., inputs): a penalty's, an attack's
                if not torch.is_grad_enabled():  # no graph built (create_graph=False): nothing of it reaches a loss
                    self._input_gradient_pass = True
                return False
            # Each micro-batch loss carries 1/accumulation_steps: dividing it out like a loss scale gives its true G.
            scale = self.loss_scale() / self.accumulation_steps
            self._submit(layer, "G", lambda: layer.compute_g(grad_output, scale))
            return True

        return (lambda: layer.name in self._a_taken), g_ready

    @property
    def took_a(self) -> bool:
        """Whether a forward pass of this step took factors (on a factor step, any; on the others, none)."""
        return bool(self._a_taken)

    def gradients_cleared(self) -> bool:
        """Whether every layer whose G this step took has no weight gradient now: the script cleared them
        (``model.zero_grad()``) without a ``step()``."""
        taken = False
        for kind, name in self._tally:  # (stops at the first gradient kept)
            if kind == "G":
                if self._by_name[name].helper.weight.grad is not None:
                    return False
                taken = True
        return taken

    def _repeated_backward(self) -> None:
        """A layer output got gradients from a second backward pass through one forward pass: say once what G is then."""
        if self._repeat_noted:
            return
        self._repeat_noted = True
        warnings.warn(
            "a second backward pass went through the same forward pass before step() (backward(retain_graph=True), "
            "then another backward()): the gradients add up as for the summed losses, but K-FAC's G then adds each "
            "pass's own output-gradient products, without the cross terms that one backward() of the summed loss "
            "gives, so the preconditioner differs from that of (loss1 + loss2).backward(). To precondition for the "
            "total loss, sum the losses and call backward() once (this is said once)",
            stacklevel=2,
        )

    def _unused_forward(self, name: str, uses: int, reached: int) -> None:
        """A layer's ``A`` took more forward uses here than backward passes reached the output of: say once that
        ``A`` then describes inputs the step's gradient does not."""
        if self._unused_noted:
            return
        self._unused_noted = True
        warnings.warn(
            f"layer {name!r} ran {uses} time(s) with gradients enabled in this step, but a backward pass reached the "
            f"output of {reached} of those uses: K-FAC's A averages the inputs of all of them, including those of a "
            "forward pass that no backward pass reached (one run for a metric or a log, a detached branch, a batch "
            "skipped after its forward pass), so the preconditioner describes inputs the step's gradient does not. Run "
            "such passes under torch.no_grad() or with the model in eval() mode; to skip a batch whose loss is not "
            "finite, decide with optimizer.finite_everywhere(loss), which drops its factors on every worker (this is "
            "said once)",
            stacklevel=2,
        )

    def _uneven_samples(self, layers: list[str]) -> None:
        """Layers took different numbers of samples on different workers where their factors could not be weighed
        exactly (:meth:`_correct_uneven`): say once that their factors then differ from one worker's on the whole batch."""
        if self._uneven_noted:
            return
        self._uneven_noted = True
        why = "with several calls of the layer in a pass, or for the first time after steps with even samples"
        warnings.warn(
            f"layer(s) {', '.join(layers[:6])}{' ...' if len(layers) > 6 else ''} took different numbers of samples on "
            "different workers in this step (a data-dependent selection: tokens routed to an expert, masked positions; "
            f"or local batches of different sizes), {why}. Their factors are then the mean of the workers' own, each "
            "normalised by its own samples, where one worker on the whole batch weighs every sample alike: N workers "
            "differ from one there (docs/layers.md). With at most one call per forward pass the factors are "
            "weighed by the samples exactly, from the layer's next uneven step on. This is said once",
            stacklevel=2,
        )

    def _after_input_gradient_pass(self, layer: KFACLayer) -> None:
        """An A hook after a backward pass that computed no weight gradient and built no graph (an attack's input
        gradient), with no weight gradient since: the forward passes before gave the step nothing."""
        self._input_gradient_pass = False
        if not self.backward_seen and self.input_gradient_passes():
            self._new_pass(layer)  # the factors taken so far were dropped (reset): this pass is the step's first
            return
        if self._attack_noted:
            return
        self._attack_noted = True
        warnings.warn(
            "a forward pass began after a backward pass that computed no weight gradient (torch.autograd.grad with "
            "respect to the input, as an adversarial attack takes), in a step whose earlier micro-batches already "
            "took gradients: K-FAC's A then also averages the inputs of the attack's forward passes. With one "
            "micro-batch per step (accumulation_steps=1) those passes are dropped exactly; or craft the attack with "
            "the model in eval() mode, whose passes take no factors (this is said once)",
            stacklevel=3,
        )

    def weights_with_gradients(self) -> list[torch.Tensor]:
        """The K-FAC weights that hold a gradient now, each once."""
        weights = {id(w): w for w in (layer.helper.weight for layer in self.layers)}.values()
        return [w for w in weights if w.grad is not None]

    def _check_cleared(self, layer: KFACLayer) -> None:
        """The first backward pass after a forward pass let through beyond accumulation_steps: refused unless the
        gradients of the passes before it were cleared since (None, or zeroed in place: a gradient only scaled,
        by clipping, still holds them). Called from the first output-gradient hook, before this pass adds to any
        K-FAC weight's gradient; one host synchronisation per weight, on this path only."""
        kept, self.must_be_cleared = self.must_be_cleared, None
        assert kept is not None
        if all(w.grad is None or not bool(w.grad.any()) for w in kept):
            return
        self.refused()  # (the step is forgotten: the script may clear the gradients and go on)
        raise RuntimeError(
            f"a backward pass through layer {layer.name!r} adds to the gradients of {self.accumulation_steps} backward "
            f"pass(es) before it with no step() between, but accumulation_steps is {self.accumulation_steps}. " + _ACCUMULATION_ADVICE
        )

    def _new_pass(self, layer: KFACLayer) -> None:
        """An A hook after backward began: the next forward pass (micro-batch). One beyond accumulation_steps is
        refused only where ``unstepped`` did not drop the passes before (the optimizer's always does, and the
        backward pass refuses instead: :meth:`_check_cleared`)."""
        if self.backward_seen and self.unstepped(self._passes + 1 > self.accumulation_steps):
            self._new_pass(layer)  # the passes before were dropped (reset): this pass is the step's first
            return
        self._passes += 1
        self._g_since_a = self._input_gradient_pass = False
        if self._passes > self.accumulation_steps:
            times = "twice" if self._passes == 2 else f"{self._passes} times"
            raise RuntimeError(
                f"factor A of layer {layer.name!r} was computed {times} in one step, but accumulation_steps is "
                f"{self.accumulation_steps}: a forward pass after {self.accumulation_steps} backward pass(es) with no "
                "step() between. " + _ACCUMULATION_ADVICE
            )

    def _divisor(self, kind: str, calls: int) -> int:
        """What a factor's sum over ``calls`` calls is divided by: A is the mean of its uses, G their sum per pass."""
        return calls if kind == "A" else self.accumulation_steps

    def _submit(self, layer: KFACLayer, kind: str, compute: Callable[[], torch.Tensor]) -> None:
        t_enter = Timeline.now() if self.record is not None else 0.0
        key = (kind, layer.name)
        if kind == "G":
            self.backward_seen = self._g_since_a = True
            self._input_gradient_pass = False
        else:
            if (self._g_since_a or self._input_gradient_pass) and torch._C._current_graph_task_id() == -1:
                if self._g_since_a:  # (a reentrant recomputation, inside backward, is no pass)
                    self._new_pass(layer)
                else:
                    self._after_input_gradient_pass(layer)
            self._a_taken.add(layer.name)
        tally = self._tally.get(key)
        if tally is None:
            tally = self._tally[key] = _Tally()
        tally.calls += 1
        expected = self.expected.get(key, self.accumulation_steps)
        if tally.sent:  # a call beyond those expected: summed apart, sent at step() and folded in
            factor = compute()
            tally.samples += _call_samples(layer, kind)
            tally.extra = factor if tally.extra is None else tally.extra.add_(factor)
            return
        if tally.calls < expected or self._more_passes(tally):  # an early call: sum locally, communicate nothing
            tally.add(kind, compute(), _call_samples(layer, kind), self.accumulation_steps > 1)
            return
        # The call that completes the factor (the only one in the common case): timed and pipelined as usual.
        profiling = self.profiler.active
        timed = self.record is not None or profiling
        t_start = t_end = 0.0
        if timed:
            if profiling and torch.cuda.is_available():
                torch.cuda.synchronize()
            t_start = Timeline.now()
        tally.add(kind, compute(), _call_samples(layer, kind), self.accumulation_steps > 1)
        factor = self._complete(kind, tally)
        if timed:
            if profiling and factor.is_cuda:
                torch.cuda.synchronize()
            t_end = Timeline.now()
            self.profiler.factor_timed(key, t_start, t_end)
            if self.record is not None:
                self.record.factor_computed(key, t_start, t_end)
                self.controller.poll()
        self._send(key, factor)
        if self.record is not None:  # the hook's own cost: all but the factor's computation (a cost model charges it apart)
            self.record.hooks += Timeline.now() - t_enter - (t_end - t_start)

    def _more_passes(self, tally: _Tally) -> bool:
        """Whether a factor that took its expected calls waits for the micro-batches still to come: one called at
        most once per pass, in fewer passes than accumulation_steps so far (a routed expert, a micro-batch no
        sample of which reached it), is weighed by its samples at step(), where the passes are known."""
        return tally.calls < self.accumulation_steps and tally.calls <= self._passes

    def _complete(self, kind: str, tally: _Tally) -> torch.Tensor:
        """This worker's factor from a tally's calls (all that came), marked sent.

        A factor the same layer computed several times in one pass is the
        mean of the calls' ``A`` and the sum of their ``G`` per pass. Under
        gradient accumulation, a layer called at most once per pass is the
        one of all the step's samples at once: ``A = Σ n_m A_m / N`` and
        ``G = (N / p²) Σ G_m / n_m`` over the ``p`` passes (as one worker on
        the whole batch has it: :meth:`_correct_uneven`), which is the plain
        mean where every pass gave it the same ``n`` samples. Here ``G`` leaves
        out the ``k / p`` of a short last window (``p`` of ``accumulation_steps``
        ``k`` passes), applied to every layer at :meth:`take`.
        """
        calls, passes, total, weighted = tally.calls, self._passes, tally.total, tally.weighted
        assert total is not None  # a call was made
        tally.total, tally.weighted, tally.sent = None, None, calls
        if self.accumulation_steps > 1 and calls <= passes and (weighted is not None or calls < passes):
            if kind == "A":  # (samples alike in every call, missing passes aside: the plain mean)
                return total.div_(calls) if weighted is None else weighted.div_(tally.samples)
            weighted = total.div_(tally.count) if weighted is None else weighted
            return weighted.mul_(tally.samples / (passes * self.accumulation_steps))
        divisor = self._divisor(kind, calls)
        if calls > 1:  # the mean over the calls (G: their sum per pass)
            return total.div_(divisor)
        return total.div(divisor) if divisor != 1 else total  # (one call of a G expected once in several passes: per pass too)

    def _keep_local(self, key: FactorKey, factor: torch.Tensor) -> None:
        """Keep a reference to this worker's factor of a layer that took (or may take) uneven samples: the
        correction :meth:`agreed` sends is made of it."""
        name = key[1]
        if self.workers > 1 and (name in self.uneven_layers or name not in self._agreed_layers):
            self._local[key] = factor

    def _send(self, key: FactorKey, factor: torch.Tensor) -> None:
        self._keep_local(key, factor)
        if self.pipelining:
            self.arrived[key[0]].append(key)
            self.controller.submit(key, factor)
        else:
            self._stash.append((key, factor))

    def send_stashed(self) -> None:
        """Without pipelining, send the factors the hooks kept back (D-KFAC: all at once after backward)."""
        for key, factor in self._stash:
            self.arrived[key[0]].append(key)
            self.controller.submit(key, factor)
        self._stash = []

    def computed(self, key: FactorKey) -> bool:
        """Whether this worker computed factor ``key`` in this step (so far)."""
        return key in self._tally

    def _zeros(self, key: FactorKey) -> torch.Tensor:
        layer = self._by_name[key[1]]
        return layer.shape(key[0]).identity(layer.factor_dtype, layer.helper.weight.device).zero_()

    # -- the step's all-reduce order (OrderParticipant) ------------------------------------
    def universe(self) -> list[Slot]:
        """Every factor all-reduce of this step: the fusion plan's groups, the other factors alone (A, then G).

        Guessed places: A at its layer's first parameter (forward order), G
        just before its layer's last parameter's gradient (reverse order), a
        group at its last member's.
        """
        self._names = {}
        if not self.factor_step() or self._order is None:
            return []
        position, end = self._order.position, 2 * len(self._order.position)

        def guess(key: FactorKey) -> float:
            places = [position.get(p, 0) for p in self._by_name[key[1]].params()] or [0]
            return float(min(places)) if key[0] == "A" else end - max(places) - 0.5

        slots = []
        for kind in FACTOR_KINDS:
            forward = kind == FactorKind.A  # the forward hooks compute A; G comes with the backward pass
            planned = self.controller.plan(kind) or []
            held = {key for members in planned for key in members}
            for members in planned:
                name = group_name(members)
                self._names[name] = list(members)
                slots.append(Slot(name, max(guess(k) for k in members), tuple(group_name([k]) for k in members), forward))
            for layer in self.layers:
                key = (kind, layer.name)
                if key not in held:
                    self._names[group_name([key])] = [key]
                    slots.append(Slot(group_name([key]), guess(key), forward=forward))
        return slots

    def send_held(self) -> None:
        """Send what waits for ``step()``: the stash (no pipelining), the factors that took fewer calls than
        expected (in layer order), and zeros for the members of fused groups missing here."""
        self.send_stashed()
        for layer in self.layers:
            for kind in FACTOR_KINDS:
                tally = self._tally.get((kind, layer.name))
                if tally is not None and not tally.sent:
                    factor = self._complete(kind, tally)
                    self._keep_local((kind, layer.name), factor)
                    self.controller.submit((kind, layer.name), factor)
        for key in self.controller.incomplete():
            self.controller.submit(key, self._zeros(key))

    def fill(self, name: str) -> None:
        """Zeros for the factors of ``name`` this worker did not compute (its layers did not run here)."""
        for key in self._names[name]:
            if not self.controller.submitted(key):
                self.controller.submit(key, self._zeros(key))

    def report(self) -> list[float]:
        """Per layer and factor: computed here (0/1), its calls and their square, extra calls sent apart (0/1);
        then the samples its G's last call saw, those of all its calls and their square, and whether a factor of it
        took more calls than there were passes here (0/1: a layer used several times in a pass)."""
        values: list[float] = []
        for layer in self.layers:
            several = False
            for kind in FACTOR_KINDS:
                tally = self._tally.get((kind, layer.name))
                calls = 0 if tally is None else tally.calls
                extra = tally is not None and tally.extra is not None
                several = several or calls > self._passes
                values += [float(calls > 0), float(calls), float(calls * calls), float(extra)]
            g = self._tally.get(("G", layer.name))
            samples, total = (0, 0) if g is None else (layer.local_samples, g.samples)
            values += [float(samples), float(total), float(total * total), float(several)]
        return values

    def agreed(self, present: dict[str, int], summed: list[int], workers: int) -> None:
        """Fix, alike on every worker, which layers ran where, their calls, and send the extra calls' sums."""
        uneven: list[str] = []
        for i, layer in enumerate(self.layers):
            row = summed[_REPORT_ROW * i : _REPORT_ROW * (i + 1)]
            a_here, g_ran = self._tally.get(("A", layer.name)), row[4]  # (G's entries follow A's four)
            uses, reached = (0 if a_here is None else a_here.calls), self._reached.get(layer.name, 0)
            if g_ran and uses > reached:  # (where no worker took its G, the layer counts as not run: nothing to say)
                self._unused_forward(layer.name, uses, reached)
            several = row[11] > 0  # some worker called it more than once in a pass
            for j, kind in enumerate(FACTOR_KINDS):
                key = (kind, layer.name)
                ran, calls, squares, extra = row[4 * j : 4 * j + 4]
                self.ranks_ran[key] = ran
                if ran == 0:
                    continue
                if ran * squares != calls * calls and several:  # (at most once per pass: micro-batches it took no sample of)
                    raise RuntimeError(
                        f"layer {layer.name!r} ran a different number of times on different workers in this step "
                        f"(factor {kind}: {calls} calls over {ran} workers): a layer used several times must be used "
                        "the same number of times on every worker that runs it (draw data-dependent choices from a seed "
                        "shared by the workers)"
                    )
                calls //= ran
                expected = self.expected.get(key, self.accumulation_steps)
                self._agreed[key] = (calls, min(calls, expected), expected)
                self.expected[key] = calls
                if extra:  # some worker used the layer more often than expected: every worker sends the sum apart
                    tally = self._tally.get(key)
                    local = tally.extra if tally is not None and tally.extra is not None else self._zeros(key)
                    self.controller.submit((kind, f"{layer.name}{_MORE}"), local, alone=True)
                    self._more.add(key)
            if several or not self._passes:  # its last call's samples, in every pass
                self.samples[layer.name] = row[8] * self.accumulation_steps
            else:  # all its samples (a routed layer's differ between passes), in a window of accumulation_steps passes
                self.samples[layer.name] = round(row[9] * self.accumulation_steps / self._passes)
            if g_ran and g_ran * row[10] != row[9] * row[9] and not self._correct_uneven(layer, g_ran, row[9], several):
                uneven.append(f"{layer.name!r} ({row[9]} samples over {g_ran} workers)")
            if g_ran:
                self._agreed_layers.add(layer.name)
        if self._corrections:  # (all in one all-reduce: a mixture of experts has many)
            self.controller.submit_together(self._corrections)
            self._corrections = []
        if uneven:
            self._uneven_samples(uneven)

    def _correct_uneven(self, layer: KFACLayer, ran: int, samples: int, several: bool) -> bool:
        """Send the correction that weighs each worker's factors of a layer with uneven samples by its samples, as
        one worker on the whole batch does (folded in at :meth:`take`); False where that cannot be done exactly.

        The all-reduce averaged ``F_i`` over the ``P`` workers; one worker on
        the whole batch has ``A = Σ n_i A_i / N`` (each sample weighed alike)
        and ``G = (N / P²) Σ G_i / n_i`` (its ``G = n g gᵀ`` counts all ``N``
        rows, while its loss, the mean over the whole batch, makes each
        output gradient ``1/P`` of a worker's). With ``n̄ = N / k`` over the
        ``k`` workers that ran it, both are the average plus the average of
        ``(w_i - 1) F_i`` (``w_i = n_i / n̄`` for A, ``n̄ / n_i`` for G), then
        scaled by ``P / k`` (A) or ``k / P`` (G) as for any layer that ran on
        some workers only. Under gradient accumulation ``F_i`` and ``n_i`` are
        those of all the worker's micro-batches (:meth:`_complete`). Exact for
        a layer called at most once per pass (not ``several`` times on some
        worker), with this worker's factors kept (:meth:`_keep_local`); the
        layer is watched from now on either way.
        """
        name = layer.name
        watched = name in self.uneven_layers or name not in self._agreed_layers
        self.uneven_layers.add(name)
        keys = [(kind, name) for kind in FACTOR_KINDS]
        if not watched or several or any(self.ranks_ran.get(key) != ran for key in keys):
            return False
        mean = samples / ran
        g = self._tally.get(("G", name))
        here = 0 if g is None else g.samples
        for key in keys:
            local = self._local.get(key)
            if local is None or here == 0:
                correction = self._zeros(key)
            else:
                weight = here / mean if key[0] == "A" else mean / here
                correction = local.mul(weight - 1.0)
            self._corrections.append(((key[0], f"{name}{_UNEVEN}"), correction))
            self._corrected.add(key)
        return True

    def take(self, nonfinite: NonFiniteGuard, step: int) -> dict[FactorKey, torch.Tensor]:
        """Wait for this step's averaged factors (packed) of the layers that ran; raise if one is non-finite.

        A layer that did not run in this step (on any worker) is left out and
        named in :attr:`skipped`; one that ran on some workers only gets the
        mean of their factors. A factor whose calls were not the expected
        number is completed here.
        """
        if self._order is None:  # (the settling an order does at step())
            self.send_held()
            report = self.report()
            self.agreed({}, [round(v) for v in report], 1)
        factors = self.controller.wait_all()  # (an order settles first: send_held, the agreement, agreed())
        ran = [layer.name for layer in self.layers if all(self.ranks_ran.get((kind, layer.name), 0) for kind in FACTOR_KINDS)]
        if not ran:
            empty = " (here the layers were called with no sample: an empty batch)" if self.empty_inputs else ""
            raise RuntimeError(
                f"step() was called on a factor-update step but no Kronecker factor was computed{empty}: run the "
                "forward and backward pass in training mode (model.train()) with gradients enabled before step(); "
                "a torch.compile'd model must first run after the optimizer is built (Dynamo does not see hooks added "
                "to a model, or to another instance of its class, it has already compiled; torch._dynamo.reset() forgets "
                "those). Another instance of the model's class compiled in this process (a teacher, a copy) needs "
                "torch._dynamo.config.skip_nnmodule_hook_guards = False, set before either runs"
            )
        for key in self._more:  # the sum over every call, then the mean as usual
            calls, sent, _ = self._agreed[key]
            extra = factors.pop((key[0], f"{key[1]}{_MORE}"))
            total = factors[key].mul(self._divisor(key[0], sent)).add_(extra)
            factors[key] = total.div_(self._divisor(key[0], calls))
        for key in self._corrected:  # uneven samples weighed as one worker on the whole batch (_correct_uneven)
            factors[key] = factors[key].add(factors.pop((key[0], f"{key[1]}{_UNEVEN}")))
        partial = {key: n for key, n in self.ranks_ran.items() if 0 < n < self.workers}
        for key, n in partial.items():  # ran on k of P workers (the all-reduce averaged over all): A times P/k, G k/P
            if key in factors:
                factors[key] = factors[key].mul(self.workers / n if key[0] == "A" else n / self.workers)
        if 0 < self._passes < self.accumulation_steps:  # a short last window: G the mean over the passes it ran
            for key in factors:
                if key[0] == "G":
                    factors[key] = factors[key].mul(self.accumulation_steps / self._passes)
        kept = set(ran)
        self.skipped = [layer.name for layer in self.layers if layer.name not in kept]
        factors = {key: mat for key, mat in factors.items() if key[1] in kept}
        self.irregular = set(partial) | {key for key, (calls, _, expected) in self._agreed.items() if calls != expected}
        keys = list(factors)
        bad = [keys[i] for i in non_finite_indices([factors[key] for key in keys])]
        if bad:
            nonfinite.bad_step(NonFiniteFactorError(sorted(bad), step))
        return factors

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
