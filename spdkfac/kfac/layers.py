"""Per-layer K-FAC maths: Kronecker factors, running averages, preconditioning.

One :class:`KFACLayer` class holds the maths for every supported layer; the
layer types differ only in how their inputs and output gradients are turned
into Gram matrices and how their gradient is laid out (a small
:class:`~spdkfac.kfac.layer_types.LayerHelper` per type), and the compute methods
in what the factors are decomposed into (:mod:`spdkfac.kfac.methods`).

Factor conventions (those of the K-FAC code base SPD-KFAC was built on,
Pauloski et al.; chosen so that P workers with local batch ``n`` give the same
factors as one worker with batch ``P*n``). With ``S`` the output positions per
sample that share a convolution's weight (``S = 1`` for Linear):

* ``A = Σ (a/S)(a/S)^T / n`` over the layer-input rows ``a`` (im2col patches
  for a convolution, ``n*S`` rows, with a ones column for the bias);
* ``G = Σ (n*S*g)(n*S*g)^T / (n*S)`` over the output-gradient rows ``g`` of a
  batch-*mean* loss (PyTorch's default reduction): ``n*S*g`` undoes the mean.

For Linear that is ``A = a^T a / n`` and ``G = n g^T g``. ``A ⊗ G`` is the KFC
approximation of a convolution's Fisher (Grosse & Martens); the split between
the two factors matters because damping is added to each. Linear layers on
sequence input (``n*T`` rows) average ``A`` over all rows and keep
``G = n g^T g``. Both factors are means over the local batch's samples, so
averaging them over workers gives the mean over the global batch.
A grouped convolution has these factors per group (block-diagonal ``A`` and
``G``); an embedding is a Linear layer on one-hot rows (diagonal ``A``).

Running averages start from the identity, as the reference's do: the first
factor step gives ``F = decay*I + (1-decay)*F_batch``. A single batch's factor
is rank-deficient; starting from it, the first inverses would amplify its null
space by ``1/damping``.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from .factor_shape import FactorKind, FactorShape
from .layer_types import EmbeddingHelper, LayerHelper, LinearHelper, helper_class, make_helper, split_helpers
from .layer_types.shared_input import SharedInputGram
from .layer_types.transformer_layers import sequence_layouts
from .methods import DecompositionMethod, MethodState, get_method
from .sharded_grads import is_sharded, whole_gradients
from .tensor_cores import keeps_half_rows
from .tied_factors import tied_factors

__all__ = [
    "FACTOR_KINDS",
    "FactorKey",
    "FactorKind",
    "KFACLayer",
    "LayerHelper",
    "factor_list",
    "functional_submodules",
    "kfac_layers",
    "link_tied_pairs",
    "make_helper",
    "preconditioned_layers",
    "split_layers",
    "unhooked_submodules",
    "unwrapped_name",
    "wider",
]

#: Both kinds' names, in the order every rank handles them.
FACTOR_KINDS: tuple[str, ...] = FactorKind.choices()
#: A factor by (kind 'A' | 'G', layer name), the same on every rank.
FactorKey = tuple[str, str]
#: Module attributes a wrapper puts into its module's name that the model's ``state_dict()`` keys need not show:
#: torch's activation-checkpoint wrapper (``checkpoint_wrapper``, which accelerate's and Lightning's FSDP
#: activation checkpointing apply, strips it from them) and a compiled submodule (``torch.compile(block)``).
WRAPPER_ATTRIBUTES = ("_checkpoint_wrapped_module", "_orig_mod")


def unwrapped_name(name: str) -> str:
    """A module name without the wrappers' attributes (``blocks.0._checkpoint_wrapped_module.fc`` -> ``blocks.0.fc``)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


class KFACLayer:
    """K-FAC state and maths of one preconditioned layer.

    Holds the running averages ``A`` and ``G`` and, per factor, one
    decomposition slot holding what the compute method
    (:mod:`spdkfac.kfac.methods`) preconditions with: for ``'inverse'`` the damped
    inverses ``(A + γI)^-1`` and ``(G + γI)^-1``, the gradient becoming
    ``G_inv @ grad @ A_inv``, which equals ``((A+γI) ⊗ (G+γI))^-1 vec(grad)``
    for column-stacked ``vec``; for ``'eigen'`` the eigendecompositions, the
    gradient becoming ``(A ⊗ G + γI)^-1 vec(grad)``. How the layer's inputs,
    output gradients and gradient are read and written belongs to its
    :class:`~spdkfac.kfac.layer_types.LayerHelper`.

    The running averages are kept in the flat form of their
    :class:`~spdkfac.kfac.factor_shape.FactorShape` (packed upper triangles, or a
    diagonal): the all-reduced factors arrive that way and are folded in as
    they are (half the memory and traffic, no unpacking every factor step);
    ``A`` / ``G`` unpack on access, which the decomposition stage does once
    per decomposition.
    """

    def __init__(
        self, name: str, helper: LayerHelper, method: str | DecompositionMethod = "inverse", max_factor_dim: int | None = None
    ) -> None:
        self.name = name
        self.method = get_method(method)
        self.module = helper.module
        #: Every module whose forward uses the weight (more than one for tied modules): each use is counted.
        self.modules: list[nn.Module] = [helper.module]
        self.helper = helper
        self.has_bias = helper.has_bias
        self.shapes: dict[str, FactorShape] = {"A": helper.a_shape, "G": helper.g_shape}
        #: The factors kept as their diagonal because they are wider than ``max_factor_dim`` (dense by the layer's type).
        self.diagonal_by_width: frozenset[str] = frozenset(
            kind for kind, shape in self.shapes.items() if max_factor_dim is not None and wider(shape, max_factor_dim)
        )
        for kind in self.diagonal_by_width:
            self.shapes[kind] = FactorShape(self.shapes[kind].dim, diagonal=True)
        self.a_dim = self.shapes["A"].dim
        self.g_dim = self.shapes["G"].dim
        self._packed: dict[str, torch.Tensor | None] = {"A": None, "G": None}
        self._decomposed: dict[str, Any] = {"A": None, "G": None}
        #: Counts the decompositions set, so that what is derived from them can tell it is out of date.
        self.decomposition_version = 0
        #: The method's own per-layer state (EKFAC's scaling; empty for the others), :meth:`DecompositionMethod.commit`.
        self.method_state: MethodState = self.method.new_state()
        #: A diagonal ``A``'s rows that its first batch factor has none of, until :func:`used_outside_forward` reads them.
        self.first_unseen: torch.Tensor | None = None
        #: Samples per worker in the last batch the factor hooks saw (EKFAC scales its statistic by the global batch).
        self.local_samples = 1
        #: Samples in the input of the last call of :meth:`compute_a` (this worker's).
        self.input_samples = 1
        #: An embedding's: the output layer its weight is tied to. Its factors join that layer's (:mod:`.tied_factors`),
        #: which preconditions the weight; this layer preconditions nothing.
        self.tied_output: KFACLayer | None = None
        #: An output layer's: the embedding its weight is tied to, whose factors join its own.
        self.tied_embedding: KFACLayer | None = None
        #: Where a module holds the weight under FSDP2, which registers its whole copy there for its passes
        #: (:meth:`weight_now`); None: the weight is always ``helper.weight``.
        self.weight_slot: tuple[nn.Module, str] | None = None

    def __repr__(self) -> str:
        a, g = self.shapes["A"].describe(), self.shapes["G"].describe()
        return f"KFACLayer({self.name!r}, {type(self.module).__name__}, A {a}, G {g})"

    @property
    def compute_method(self) -> str:
        return self.method.name

    def dim(self, kind: str) -> int:
        """Dimension of (one block of) factor ``kind`` ('A' or 'G')."""
        return self.shapes[kind].dim

    def shape(self, kind: str) -> FactorShape:
        """The shape of factor ``kind``: dense, block-diagonal or diagonal."""
        return self.shapes[kind]

    def params(self) -> list[torch.Tensor]:
        """The parameters this layer preconditions (weight, and bias if any)."""
        return self.helper.params()

    @property
    def preconditions(self) -> bool:
        """Whether the layer preconditions its gradient: all but an embedding tied to an output layer, whose factors
        serve that layer's preconditioning of the one weight."""
        return self.tied_output is None

    # -- factor computation (called from hooks) ---------------------------------
    @property
    def factor_dtype(self) -> torch.dtype:
        """The weight's dtype, but at least float32: inverses need it, and half precision overflows."""
        dtype = self.helper.weight.dtype
        return dtype if dtype in (torch.float32, torch.float64) else torch.float32

    def _samples(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """An input or output gradient as the helper's Grams read it, and its number of samples ``n``.

        One sample without its batch dimension (a Linear layer's 1-D input,
        a sequence model's 2-D ``(L, E)``) counts as ``n = 1``; a layer of a
        sequence-first model counts its second dimension.
        """
        layout = self.helper.sequence
        if layout is None:
            t = t.unsqueeze(0) if self.helper.unbatched(t) else t
            return t, t.shape[0]
        if t.dim() == 2:
            return t.unsqueeze(0), 1
        if layout == "batch_first":
            return t, t.shape[0]
        return self.helper.samples_first(t), t.shape[1]

    def compute_a(self, x: torch.Tensor) -> torch.Tensor:
        """Batch factor ``A = Σ (a/S)(a/S)^T / n`` from the layer input, in flat form."""
        x, batch = self._samples(x)
        self.input_samples = batch
        diagonal = "A" in self.diagonal_by_width
        half = not diagonal and self.helper.half_rows and keeps_half_rows(x, self.factor_dtype)  # (exact float32 Grams of half rows)
        gram_of = self.helper.input_diagonal if diagonal else self.helper.input_gram
        with torch.autocast(x.device.type, enabled=False):  # under AMP the input may be half precision
            gram, count = gram_of(x.detach(), x.dtype if half else self.factor_dtype)
            # count = n*S rows: Σ (a/S)(a/S)^T / n = gram / (count * S).
            return self.shapes["A"].pack(gram.div_(count * self.helper.positions(count, batch)))

    def compute_g(self, grad_output: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """Batch factor ``G = Σ (n*S*g)(n*S*g)^T / (n*S)`` from the output gradient of a mean loss, in flat form.

        ``loss_scale`` is the factor a GradScaler multiplied the loss by; it is
        divided out so that ``G`` describes the true gradients.
        """
        grad_output, batch = self._samples(grad_output)
        self.local_samples = batch
        diagonal = "G" in self.diagonal_by_width
        half = not diagonal and self.helper.half_rows and keeps_half_rows(grad_output, self.factor_dtype)
        gram_of = self.helper.output_diagonal if diagonal else self.helper.output_gram
        with torch.autocast(grad_output.device.type, enabled=False):
            g = grad_output.detach() if half else grad_output.detach().to(self.factor_dtype)
            if loss_scale != 1.0 and not half:
                g = g / loss_scale
            gram, rows = gram_of(g)
            if loss_scale != 1.0 and half:  # (out of the float32 Gram: dividing fp16 values could underflow)
                gram.div_(loss_scale * loss_scale)
            return self.shapes["G"].pack(gram.mul_(batch * self.helper.positions(rows, batch)))

    # -- running averages and decompositions --------------------------------------
    def update_factor(self, kind: str, batch_factor: torch.Tensor, decay: float) -> None:
        """Fold a (worker-averaged) batch factor into the running average.

        ``batch_factor`` is the full factor or its flat form (as the fused
        all-reduce delivers it). The average starts from the identity:
        ``F <- decay * F + (1 - decay) * batch`` with ``F = I`` before the
        first factor.
        """
        packed = self._as_packed(kind, batch_factor)
        current = self._packed[kind]
        if current is None:
            current = self._packed[kind] = self.shapes[kind].identity(packed.dtype, packed.device)
            if kind == "A" and self.shapes[kind].diagonal:  # rows no worker looked up in the first factor step (exactly 0 there)
                self.first_unseen = packed == 0
        current.mul_(decay).add_(packed, alpha=1.0 - decay)

    def set_factor(self, kind: str, value: torch.Tensor | None) -> None:
        """Replace the running average (full or flat form; None clears it)."""
        if value is None:
            self._packed[kind] = None
            return
        packed = self._as_packed(kind, value)
        # Our own copy: a packed value may be a view into a buffer its owner reuses.
        self._packed[kind] = packed.clone() if packed is value else packed

    def _as_packed(self, kind: str, factor: torch.Tensor) -> torch.Tensor:
        """The flat form of a full or already flat factor of this layer, checked for size."""
        try:
            return self.shapes[kind].as_packed(factor)
        except ValueError as exc:
            raise ValueError(f"{kind} factor of {self.name!r}: {exc}") from None

    def packed_factor(self, kind: str) -> torch.Tensor | None:
        """The running average as stored: its flat form (no copy)."""
        return self._packed[kind]

    def factor(self, kind: str) -> torch.Tensor | None:
        """The running average in full form (unpacked afresh on each call)."""
        packed = self._packed[kind]
        return None if packed is None else self.shapes[kind].unpack(packed)

    @property
    def A(self) -> torch.Tensor | None:
        """Running average of the input-covariance factor (full form, unpacked on access)."""
        return self.factor("A")

    @A.setter
    def A(self, value: torch.Tensor | None) -> None:
        self.set_factor("A", value)

    @property
    def G(self) -> torch.Tensor | None:
        """Running average of the output-gradient-covariance factor (full form, unpacked on access)."""
        return self.factor("G")

    @G.setter
    def G(self, value: torch.Tensor | None) -> None:
        self.set_factor("G", value)

    def factors_to_decompose(self) -> dict[str, torch.Tensor]:
        """The running averages the decompositions are made of, in flat form: the layer's own, or for an output layer
        tied to an embedding the nearest Kronecker product of both uses' terms (:func:`.tied_factors.tied_factors`).

        Raises RuntimeError for a factor never computed."""
        own = {kind: self._computed(kind) for kind in FACTOR_KINDS}
        embedding = self.tied_embedding
        if embedding is None:
            return own
        counts, embedding_g = (embedding.shapes[k].unpack(embedding._computed(k)) for k in FACTOR_KINDS)
        x, y = tied_factors(counts, embedding_g, self.shapes["G"].unpack(own["G"]), self.shapes["A"].unpack(own["A"]))
        return {"A": self.shapes["A"].pack(y), "G": self.shapes["G"].pack(x)}

    def _computed(self, kind: str) -> torch.Tensor:
        packed = self._packed[kind]
        if packed is None:
            raise RuntimeError(f"factor {kind} of layer {self.name!r} was never computed; nothing to decompose")
        return packed

    def decomposition(self, kind: str) -> Any:
        """What the method preconditions with for factor ``kind`` (None before the first decomposition)."""
        return self._decomposed[kind]

    def set_decomposition(self, kind: str, value: Any) -> None:
        self._decomposed[kind] = value
        self.decomposition_version += 1

    @property
    def decomposed(self) -> bool:
        """Whether the layer holds both factors' decompositions."""
        return all(value is not None for value in self._decomposed.values())

    @property
    def update_dtype(self) -> torch.dtype:
        """The dtype :meth:`precondition` returns (that of the G decomposition, made from the G factor).

        A worker that is not one of the layer's gradient workers holds no
        decomposition and reads the factor's dtype, which it was made in.
        """
        held = self._decomposed["G"]
        if held is None:
            factor = self.packed_factor("G")
            if factor is None:
                raise RuntimeError(f"layer {self.name!r} has no {self.method.label} yet; factors were never updated")
            return factor.dtype
        return self.method.tensors(held)[0].dtype

    def weight_now(self) -> torch.Tensor:
        """The weight the layer's forward and backward passes use now: ``helper.weight``, but inside FSDP2's passes
        the whole copy it registers in the weight's place (the tensor autograd computes a gradient for)."""
        if self.weight_slot is None:
            return self.helper.weight
        module, name = self.weight_slot
        weight: torch.Tensor = module._parameters[name]  # type: ignore[assignment]  # (a slot found holding a tensor)
        return weight

    # -- gradients -----------------------------------------------------------------
    @property
    def grad_shape(self) -> tuple[int, ...]:
        """Shape of :meth:`grad_matrix`: ``(g_dim, a_dim)``, or ``(blocks, g_dim, a_dim)`` for block-diagonal factors."""
        return self.helper.grad_shape

    def grad_matrix(self) -> torch.Tensor | None:
        """The layer gradient as a ``g_dim x a_dim`` matrix (bias as the last column), per block for grouped layers;
        whole where FSDP shards the weight (all-gathered: :mod:`.sharded_grads`)."""
        if not is_sharded(self.helper.weight):
            return self.helper.grad()
        with whole_gradients([self.helper], write_back=False):
            return self.helper.grad()

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient, in the decomposition's precision (the caller casts back on writing).

        ``'inverse'`` has the damping inside the inverses (``damping`` is not
        read); ``'eigen'`` applies it here.
        """
        if not self.decomposed:
            raise RuntimeError(f"layer {self.name!r} has no {self.method.label} yet; factors were never updated")
        return self.method.precondition(grad, self._decomposed["A"], self._decomposed["G"], damping, self.method_state)

    def write_grad(self, grad: torch.Tensor) -> None:
        """Copy an update shaped as :meth:`grad_matrix` back into the weight (and bias) gradients (where FSDP shards
        them, each worker its rows of the update, the same on every worker)."""
        if not is_sharded(self.helper.weight):
            self.helper.write_grad(grad)
            return
        with whole_gradients([self.helper]):
            self.helper.write_grad(grad)


def used_outside_forward(layer: KFACLayer) -> bool:
    """Whether a layer with a diagonal ``A`` (an embedding) has gradient in a row its forward never looked up.

    Its weight is then used outside its forward as well (a tied output layer
    written as ``x @ emb.weight.T``), which its factors do not describe: rows
    never looked up have ``A = 0`` and their gradient is multiplied by
    ``1/damping``. Read once, at the layer's first factor step, from the rows
    its batch ``A`` (every worker's lookups) has none of; exact on the
    gradient before or after preconditioning (a diagonal ``A`` keeps each
    column's zero); one host synchronisation.
    """
    unseen, grad = layer.first_unseen, layer.grad_matrix()
    layer.first_unseen = None
    if unseen is None or grad is None or unseen.shape[-1] != grad.shape[-1]:
        return False
    return bool(grad[..., unseen].ne(0).any())


LayerFilter = Union[str, type]


def wider(shape: FactorShape, max_factor_dim: int) -> bool:
    """Whether a factor is kept as its diagonal under ``max_factor_dim``: a dense one (not block-diagonal) wider than it.

    A diagonal costs ``d`` memory and an elementwise decomposition where the
    dense factor costs ``d^2`` and ``d^3`` (a language model's output layer: ``G``
    as wide as the vocabulary); it keeps each coordinate's curvature and drops
    their correlations. A block-diagonal factor keeps its blocks.
    """
    return not shape.diagonal and shape.blocks == 1 and shape.dim > max_factor_dim


def functional_submodules(model: nn.Module) -> dict[str, str]:
    """``{name: why}`` of supported layers whose weight their parent's own forward uses without calling their ``forward()``.

    ``nn.MultiheadAttention``'s torch forward computes with ``out_proj.weight``
    directly. Once the attention module is split
    (:func:`split_layers`), its explicit forward calls ``out_proj``, which is
    then a layer like any other (:func:`unhooked_submodules`).
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and isinstance(getattr(module, "out_proj", None), nn.Linear):
            found[f"{name}.out_proj" if name else "out_proj"] = "nn.MultiheadAttention uses out_proj.weight without calling out_proj"
    return found


def split_layers(model: nn.Module, skip: Sequence[LayerFilter] = ()) -> dict[str, list[tuple[str, LayerHelper]]]:
    """``{module name: [(suffix, helper)]}`` of the modules split into several blocks (``nn.MultiheadAttention``).

    Splitting gives each such module (not matched by ``skip``) a forward whose
    blocks K-FAC's hooks see; see :mod:`spdkfac.kfac.layer_types.attention`.
    """
    found: dict[str, list[tuple[str, LayerHelper]]] = {}
    for name, module in model.named_modules():
        if skipped(name, module, skip):
            continue
        parts = split_helpers(module)
        if parts is not None:
            found[name] = parts
    return found


def unhooked_submodules(model: nn.Module, split: dict[str, list[tuple[str, LayerHelper]]]) -> dict[str, str]:
    """:func:`functional_submodules` but those whose parent is split (its forward then calls them): no hook sees these."""
    return {name: why for name, why in functional_submodules(model).items() if name.rpartition(".")[0] not in split}


#: ``skip_layers`` entries ``'kind:NAME'``: layers of a shape rather than of a name or class.
LAYER_KINDS: dict[str, Callable[[nn.Module], bool]] = {
    # groups == in_channels > 1: one filter per input channel (MobileNet, EfficientNet)
    "depthwise": lambda m: isinstance(m, nn.modules.conv._ConvNd) and m.groups > 1 and m.groups == m.in_channels,
    # any groups > 1, depthwise included (ResNeXt, RegNet)
    "grouped": lambda m: isinstance(m, nn.modules.conv._ConvNd) and m.groups > 1,
}


def _kind_matches(entry: str, module: nn.Module) -> bool:
    kind = entry.removeprefix("kind:")
    if kind not in LAYER_KINDS:
        raise ValueError(f"skip_layers entry {entry!r}: unknown layer kind; known: {['kind:' + k for k in LAYER_KINDS]}")
    return LAYER_KINDS[kind](module)


def skipped(name: str, module: nn.Module, skip: Sequence[LayerFilter]) -> bool:
    """Whether ``skip`` names the module: by name (shell-style wildcards allowed), class name, class or ``'kind:...'``.

    A name matches with or without the wrappers' attributes on either side
    (:func:`unwrapped_name`): the same ``skip_layers`` serves a script with
    activation checkpointing turned on or off.
    """
    for entry in skip:
        if isinstance(entry, str) and entry.startswith("kind:"):
            if _kind_matches(entry, module):
                return True
        elif isinstance(entry, str) and (
            fnmatch.fnmatchcase(name, entry)
            or fnmatch.fnmatchcase(unwrapped_name(name), unwrapped_name(entry))
            or entry == type(module).__name__
        ):
            return True
        if isinstance(entry, type) and isinstance(module, entry):
            return True
    return False


def kfac_layers(
    model: nn.Module,
    compute_method: str | DecompositionMethod = "inverse",
    skip: Sequence[LayerFilter] = (),
    norm_layers: bool = False,
    max_factor_dim: int | None = None,
) -> list[KFACLayer]:
    """A :class:`KFACLayer` for every supported layer with a trainable weight, in module order.

    With ``norm_layers`` the normalisation layers' affine parameters too
    (:mod:`spdkfac.kfac.layer_types.norm`). A dense factor wider than
    ``max_factor_dim`` is kept as its diagonal (:func:`wider`).

    Left out (the base update alone): modules matched by ``skip`` (a module name,
    a class name, or a class) and layers used without their ``forward()``
    (:func:`unhooked_submodules`). A split module (:func:`split_layers`)
    gives a layer per block, named ``<module>.<suffix>`` (``attn.q_proj``).

    Modules that share one weight (tied weights) become one layer whose
    factors count the uses of every one of them, when they are of one type
    and configuration with one shared bias (or none); a module registered
    at several places is one layer too. Those that cannot be one layer are
    left out (:func:`untied_layers`).

    Raises:
        ValueError: a lazy module not initialised yet (its shapes are not known).
    """
    lazy = [name for name, param in model.named_parameters() if is_lazy(param)]
    if lazy:
        raise ValueError(
            f"the model has uninitialised lazy parameters ({', '.join(lazy[:6])}{' ...' if len(lazy) > 6 else ''}): K-FAC "
            "plans its factors from every layer's shape when the optimizer is built. Run one forward pass with a batch "
            "of the right size, dtype and device first (torch's dry run for lazy modules), then build the optimizer."
        )
    for entry in skip:
        if not isinstance(entry, (str, type)):
            raise TypeError(f"skip_layers entries are module names, class names or classes, got {entry!r}")
    unmatched = [e for e in skip if not any(skipped(n, m, [e]) for n, m in model.named_modules())]
    if unmatched:
        raise ValueError(
            f"skip_layers entries {unmatched} match no module of the model (names: {[n for n, _ in model.named_modules() if n][:12]} ...)"
        )
    method = get_method(compute_method)
    layouts = sequence_layouts(model)
    split = split_layers(model, skip)
    functional = unhooked_submodules(model, split)
    untied = untied_layers(model, skip, norm_layers)
    layers: list[KFACLayer] = []
    by_weight: dict[tuple[int, type[LayerHelper]], KFACLayer] = {}
    for name, module in model.named_modules():
        for suffix, part in split.get(name, []):
            layers.append(KFACLayer(f"{name or type(module).__name__}.{suffix}", part, method, max_factor_dim))
        if parametrize.is_parametrized(module, "weight"):
            continue  # (its weight is computed, and reading it runs the parametrization: spectral_norm's power step)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.requires_grad or name in functional or skipped(name, module, skip):
            continue
        if name in untied:
            continue
        helper = make_helper(module, norm_layers)
        if helper is None:
            continue
        helper.sequence = layouts.get(module)
        layer_name = name or type(module).__name__
        # A weight another layer of this type holds (untied_layers() left out those that cannot be one layer).
        tied = by_weight.get((id(weight), type(helper)))
        if tied is not None:
            tied.modules.append(module)
            continue
        layer = KFACLayer(layer_name, helper, method, max_factor_dim)
        by_weight[(id(weight), type(helper))] = layer
        layers.append(layer)
    link_tied_pairs(layers)
    shared = SharedInputGram()  # Linear layers reading one input in a row (q, k, v; gate and up) compute its Gram once
    for layer in layers:
        if isinstance(layer.helper, LinearHelper):
            layer.helper.shared = shared
    return layers


def link_tied_pairs(layers: list[KFACLayer]) -> None:
    """Link the embedding and the output layer that hold one weight (:attr:`KFACLayer.tied_output`,
    :attr:`KFACLayer.tied_embedding`), and no others (untied_layers() admitted only such pairs)."""
    by_weight: dict[int, list[KFACLayer]] = {}
    for layer in layers:
        layer.tied_output = layer.tied_embedding = None
        by_weight.setdefault(id(layer.helper.weight), []).append(layer)
    for holders in by_weight.values():
        if len(holders) == 2 and tied_pair(holders[0].module, holders[1].module):
            embedding, output = sorted(holders, key=lambda layer: not isinstance(layer.helper, EmbeddingHelper))
            embedding.tied_output, output.tied_embedding = output, embedding


def untied_layers(model: nn.Module, skip: Sequence[LayerFilter] = (), norm_layers: bool = False) -> dict[str, str]:
    """The layers whose trainable weight is shared (tied) in a way that cannot be one K-FAC layer, and why.

    Tied modules are one layer when every holder of the weight is the weight
    of a layer K-FAC preconditions, of one type and configuration, with one
    shared bias (or none), all in ``skip`` or none. Otherwise the gradient
    sums every use but the factors would describe only some (a language
    model's embedding and output layer): those layers are left out, with a
    notice, and get the base update, as if listed in ``skip``.
    """
    holders: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            holders.setdefault(id(param), []).append(pname)
    modules = dict(model.named_modules(remove_duplicate=False))
    out: dict[str, str] = {}
    for names in (names for names in holders.values() if len(names) > 1):
        owners: list[tuple[str, nn.Module]] = []
        why = None
        for holder in names:
            owner_name, _, leaf = holder.rpartition(".")
            owner = modules.get(owner_name)
            if leaf != "weight" or owner is None or make_helper(owner, norm_layers) is None:
                why = f"{holder!r} is not the weight of a layer K-FAC preconditions"
            else:
                owners.append((owner_name, owner))
        left = [(n, m) for n, m in owners if skipped(n, m, skip)]
        if why is None and left and len(left) < len(owners):
            kept = next(n for n, m in owners if not skipped(n, m, skip))
            why = f"{left[0][0]!r} is in skip_layers but {kept!r} is not"
        if why is None:  # (then every holder is a layer's weight)
            why = _not_one_layer(owners, norm_layers)
        if why is not None:
            for n, m in owners:
                if not skipped(n, m, skip):
                    out[n] = f"its weight is shared by {names} (tied weights) and {why}"
    return out


def _not_one_layer(owners: list[tuple[str, nn.Module]], norm_layers: bool) -> str | None:
    """Why the layers holding one weight cannot be preconditioned as one, or None: all of one type and
    configuration with one shared bias (or none), or so among embeddings and so among output layers
    (:func:`tied_pair`)."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    for n, m in owners:
        groups.setdefault(type(m), []).append((n, m))
    firsts = [group[0] for group in groups.values()]
    if len(groups) > 2 or (len(groups) == 2 and not tied_pair(firsts[0][1], firsts[1][1], norm_layers)):
        n, m = firsts[1]
        return f"{n!r} is a different layer ({m} against {firsts[0][1]})"
    for group in groups.values():
        first = group[0][1]
        for n, m in group[1:]:
            if m.extra_repr() != first.extra_repr():
                return f"{n!r} is a different layer ({m} against {first})"
            if getattr(m, "bias", None) is not getattr(first, "bias", None):
                return f"{n!r} has its own bias (one shared bias, or none, makes them one layer)"
    return None


def tied_pair(a: nn.Module, b: nn.Module, norm_layers: bool = False) -> bool:
    """Whether two modules of different types holding one weight are an embedding and a Linear layer, in either
    order: a language model's tied input and output layers, preconditioned together (:mod:`.tied_factors`)."""
    kinds = {helper_class(a, norm_layers), helper_class(b, norm_layers)}
    return LinearHelper in kinds and any(kind is not None and issubclass(kind, EmbeddingHelper) for kind in kinds)


def factor_list(layers: list[KFACLayer]) -> list[tuple[tuple[str, str], int]]:
    """``[((kind, layer name), dim)]``: A then G of each layer, the order placements follow (Eq. 22)."""
    return [((kind, layer.name), layer.dim(kind)) for layer in layers for kind in FACTOR_KINDS]


def preconditioned_layers(
    model: nn.Module,
    compute_method: str | DecompositionMethod,
    skip: Sequence[LayerFilter] = (),
    norm_layers: bool = False,
    max_factor_dim: int | None = None,
) -> list[KFACLayer]:
    """:func:`kfac_layers`, with a notice naming the layers used without ``forward()``; at least one layer, or an error."""
    functional = unhooked_submodules(model, split_layers(model, skip))
    if functional:  # a notice, once: these layers are not preconditioned
        warnings.warn(f"these layers get the plain momentum-SGD update, without K-FAC: {functional}", stacklevel=3)
    untied = untied_layers(model, skip, norm_layers)
    if untied:
        listed = "; ".join(f"{name!r}: {why}" for name, why in untied.items())
        warnings.warn(
            f"these layers get the base update, without K-FAC ({listed}): their gradient sums every use of the weight, "
            "but their factors would describe only some (skip_layers=[their names] says so and silences this)",
            stacklevel=3,
        )
    layers = kfac_layers(model, compute_method, skip, norm_layers, max_factor_dim)
    if not layers:
        raise ValueError(
            "model has no layer SPDKFACOptimizer can precondition (nn.Linear, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, a "
            "dense nn.Embedding, nn.MultiheadAttention or Hugging Face's Conv1D, with a trainable weight); use torch.optim.SGD for this model"
        )
    return layers
