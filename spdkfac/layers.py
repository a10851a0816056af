"""Per-layer K-FAC maths: Kronecker factors, running averages, preconditioning.

One :class:`KFACLayer` class holds the maths for every supported layer; the
only thing Linear and Conv2d differ in is how their inputs and output
gradients are turned into rows (a small :class:`RowExtractor`).

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

Running averages start from the identity, as the reference's do: the first
factor step gives ``F = decay*I + (1-decay)*F_batch``. A single batch's factor
is rank-deficient; starting from it, the first inverses would amplify its null
space by ``1/damping``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Union

import torch
import torch.nn as nn

from .decomposition import Eigen, check_method, eigen_precondition
from .layer_rows import RowExtractor, SupportedLayer, make_extractor
from .linalg import pack_upper, symmetric_gram, triangle_size, unpack_upper

__all__ = [
    "FACTOR_KINDS",
    "FactorKey",
    "KFACLayer",
    "RowExtractor",
    "factor_list",
    "functional_submodules",
    "kfac_layers",
    "make_extractor",
    "preconditioned_layers",
]

FACTOR_KINDS = ("A", "G")
#: A factor by (kind 'A' | 'G', layer name), the same on every rank.
FactorKey = tuple[str, str]
#: The module types K-FAC preconditions (:func:`make_extractor`).


class KFACLayer:
    """K-FAC state and maths of one preconditioned layer.

    Holds the running averages ``A`` and ``G`` and what ``compute_method``
    preconditions with: for ``'inverse'`` the damped inverses
    ``A_inv = (A + γI)^-1`` and ``G_inv = (G + γI)^-1``, the gradient becoming
    ``G_inv @ grad @ A_inv``, which equals ``((A+γI) ⊗ (G+γI))^-1 vec(grad)``
    for column-stacked ``vec``; for ``'eigen'`` the eigendecompositions
    ``A_eigen`` and ``G_eigen``, the gradient becoming
    ``(A ⊗ G + γI)^-1 vec(grad)`` (:mod:`spdkfac.decomposition`).

    The running averages are kept as packed upper triangles: the all-reduced
    factors arrive packed and are folded in as they are (half the memory and
    traffic, no unpacking every factor step); ``A`` / ``G`` unpack on access,
    which the inversion stage does once per inverse update.
    """

    def __init__(self, name: str, module: SupportedLayer, extractor: RowExtractor, compute_method: str = "inverse") -> None:
        self.name = name
        self.compute_method = check_method(compute_method)
        self.module = module
        self.rows = extractor
        self.has_bias = extractor.has_bias
        self.a_dim = extractor.in_dim + (1 if self.has_bias else 0)
        self.g_dim = extractor.out_dim
        self._packed: dict[str, torch.Tensor | None] = {"A": None, "G": None}
        self.A_inv: torch.Tensor | None = None
        self.G_inv: torch.Tensor | None = None
        self.A_eigen: Eigen | None = None
        self.G_eigen: Eigen | None = None

    def __repr__(self) -> str:
        return f"KFACLayer({self.name!r}, {type(self.module).__name__}, A {self.a_dim}x{self.a_dim}, G {self.g_dim}x{self.g_dim})"

    def dim(self, kind: str) -> int:
        """Dimension of factor ``kind`` ('A' or 'G')."""
        return self.a_dim if kind == "A" else self.g_dim

    # -- factor computation (called from hooks) ---------------------------------
    @property
    def factor_dtype(self) -> torch.dtype:
        """The weight's dtype, but at least float32: inverses need it, and half precision overflows."""
        dtype = self.module.weight.dtype
        return dtype if dtype in (torch.float32, torch.float64) else torch.float32

    def compute_a(self, x: torch.Tensor) -> torch.Tensor:
        """Batch factor ``A = Σ (a/S)(a/S)^T / n`` from the layer input."""
        batch = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # under AMP the input may be half precision
            x = x.detach().to(self.factor_dtype)
            shared = self.rows.input_gram(x, self.has_bias)
            if shared is not None:
                gram, count = shared
            else:
                rows = self.rows.input_rows(x)
                if self.has_bias:
                    rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
                gram, count = symmetric_gram(rows), rows.shape[0]
            # count = n*S rows: Σ (a/S)(a/S)^T / n = gram / (count * S).
            return gram.div_(count * self.rows.positions(count, batch))

    def compute_g(self, grad_output: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """Batch factor ``G = Σ (n*S*g)(n*S*g)^T / (n*S)`` from the output gradient of a mean loss.

        ``loss_scale`` is the factor a GradScaler multiplied the loss by; it is
        divided out so that ``G`` describes the true gradients.
        """
        batch = grad_output.shape[0]
        with torch.autocast(grad_output.device.type, enabled=False):
            g = grad_output.detach().to(self.factor_dtype)
            if loss_scale != 1.0:
                g = g / loss_scale
            positions = self.rows.positions(g.numel() // self.g_dim, batch)  # the rows are g.numel() / g_dim
            return self.rows.output_gram(g).mul_(batch * positions)

    # -- running averages and inverses -------------------------------------------
    def update_factor(self, kind: str, batch_factor: torch.Tensor, decay: float) -> None:
        """Fold a (worker-averaged) batch factor into the running average.

        ``batch_factor`` is the full symmetric matrix or its packed upper
        triangle (as the fused all-reduce delivers it). The average starts
        from the identity: ``F <- decay * F + (1 - decay) * batch`` with
        ``F = I`` before the first factor.
        """
        packed = self._as_packed(kind, batch_factor)
        current = self._packed[kind]
        if current is None:
            current = self._packed[kind] = pack_upper(torch.eye(self.dim(kind), dtype=packed.dtype, device=packed.device))
        current.mul_(decay).add_(packed, alpha=1.0 - decay)

    def set_factor(self, kind: str, value: torch.Tensor | None) -> None:
        """Replace the running average (full matrix or packed triangle; None clears it)."""
        if value is None:
            self._packed[kind] = None
            return
        packed = self._as_packed(kind, value)
        # Our own copy: a packed value may be a view into a buffer its owner reuses.
        self._packed[kind] = packed.clone() if packed is value else packed

    def _as_packed(self, kind: str, factor: torch.Tensor) -> torch.Tensor:
        """The packed upper triangle of a full or already packed factor of this layer, checked for size."""
        dim = self.dim(kind)
        if factor.dim() == 2:
            if factor.shape != (dim, dim):
                raise ValueError(f"{kind} factor of {self.name!r} is {tuple(factor.shape)}, expected {(dim, dim)}")
            return pack_upper(factor)
        if factor.numel() == triangle_size(dim):
            return factor
        raise ValueError(f"packed {kind} factor of {self.name!r} has {factor.numel()} elements, expected {triangle_size(dim)}")

    def packed_factor(self, kind: str) -> torch.Tensor | None:
        """The running average as stored: its packed upper triangle (no copy)."""
        return self._packed[kind]

    def factor(self, kind: str) -> torch.Tensor | None:
        """The running average as a full symmetric matrix (unpacked afresh on each call)."""
        packed = self._packed[kind]
        return None if packed is None else unpack_upper(packed, self.dim(kind))

    @property
    def A(self) -> torch.Tensor | None:
        """Running average of the input-covariance factor (full matrix, unpacked on access)."""
        return self.factor("A")

    @A.setter
    def A(self, value: torch.Tensor | None) -> None:
        self.set_factor("A", value)

    @property
    def G(self) -> torch.Tensor | None:
        """Running average of the output-gradient-covariance factor (full matrix, unpacked on access)."""
        return self.factor("G")

    @G.setter
    def G(self, value: torch.Tensor | None) -> None:
        self.set_factor("G", value)

    def set_inverse(self, kind: str, inverse: torch.Tensor) -> None:
        if kind == "A":
            self.A_inv = inverse
        else:
            self.G_inv = inverse

    def set_eigen(self, kind: str, eigen: Eigen) -> None:
        if kind == "A":
            self.A_eigen = eigen
        else:
            self.G_eigen = eigen

    @property
    def decomposed(self) -> bool:
        """Whether the layer holds what its ``compute_method`` preconditions with (both factors)."""
        if self.compute_method == "eigen":
            return self.A_eigen is not None and self.G_eigen is not None
        return self.A_inv is not None and self.G_inv is not None

    @property
    def update_dtype(self) -> torch.dtype:
        """The dtype :meth:`precondition` returns (that of the inverses or eigenvectors)."""
        held = self.G_eigen.Q if self.compute_method == "eigen" and self.G_eigen is not None else self.G_inv
        if held is None:
            raise RuntimeError(f"layer {self.name!r} has no {self.compute_method} decomposition yet; factors were never updated")
        return held.dtype

    # -- gradients -----------------------------------------------------------------
    def grad_matrix(self) -> torch.Tensor | None:
        """The layer gradient as a ``g_dim x a_dim`` matrix (bias as the last column)."""
        weight = self.module.weight
        if weight.grad is None:
            return None
        grad = weight.grad.reshape(weight.shape[0], -1)
        if self.has_bias:
            bias = self.module.bias
            assert bias is not None  # has_bias
            bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            grad = torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)
        return grad

    def precondition(self, grad: torch.Tensor, damping: float | None = None) -> torch.Tensor:
        """The preconditioned gradient, in the decomposition's precision (the caller casts back on writing).

        ``'inverse'``: ``G_inv @ grad @ A_inv`` (the damping is inside the
        inverses; ``damping`` is not read). ``'eigen'``: the damping is applied
        here, so ``damping`` is required.
        """
        if not self.decomposed:
            what = "inverses" if self.compute_method == "inverse" else "eigendecompositions"
            raise RuntimeError(f"layer {self.name!r} has no {what} yet; factors were never updated")
        if self.compute_method == "eigen":
            if damping is None:
                raise ValueError(f"layer {self.name!r} preconditions with eigendecompositions: pass the damping")
            assert self.A_eigen is not None  # decomposed
            assert self.G_eigen is not None
            return eigen_precondition(grad, self.A_eigen, self.G_eigen, damping)
        assert self.A_inv is not None  # decomposed
        assert self.G_inv is not None
        return self.G_inv @ grad.to(self.G_inv.dtype) @ self.A_inv

    def write_grad(self, grad: torch.Tensor) -> None:
        """Copy a ``g_dim x a_dim`` matrix back into the weight (and bias) gradients."""
        weight = self.module.weight
        if self.has_bias:
            w_part, b_part = grad[:, :-1], grad[:, -1]
            bias = self.module.bias
            assert bias is not None  # has_bias
            if bias.grad is None:
                bias.grad = torch.zeros_like(bias)
            bias.grad.copy_(b_part.reshape(bias.shape))
        else:
            w_part = grad
        assert weight.grad is not None  # the caller preconditioned grad_matrix(), which needs it
        weight.grad.copy_(w_part.reshape(weight.shape))


LayerFilter = Union[str, type]


def functional_submodules(model: nn.Module) -> dict[str, str]:
    """``{name: why}`` of supported layers whose weight their parent uses without calling their ``forward()``.

    ``nn.MultiheadAttention`` computes with ``out_proj.weight`` directly, so
    no hook of ``out_proj`` ever fires: there is no factor to precondition it
    with. Such layers get the plain momentum-SGD update.
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and isinstance(getattr(module, "out_proj", None), nn.Linear):
            found[f"{name}.out_proj" if name else "out_proj"] = "nn.MultiheadAttention uses out_proj.weight without calling out_proj"
    return found


def _skipped(name: str, module: nn.Module, skip: Sequence[LayerFilter]) -> bool:
    for entry in skip:
        if isinstance(entry, str) and (entry == name or entry == type(module).__name__):
            return True
        if isinstance(entry, type) and isinstance(module, entry):
            return True
    return False


def kfac_layers(model: nn.Module, compute_method: str = "inverse", skip: Sequence[LayerFilter] = ()) -> list[KFACLayer]:
    """A :class:`KFACLayer` for every supported layer with a trainable weight, in module order.

    Left out (plain momentum SGD): modules matched by ``skip`` (a module name,
    a class name, or a class) and layers used without their ``forward()``
    (:func:`functional_submodules`).

    Raises:
        ValueError: two preconditioned layers share a weight (tied weights):
            each would precondition it with half of the statistics.
    """
    for entry in skip:
        if not isinstance(entry, (str, type)):
            raise TypeError(f"skip_layers entries are module names, class names or classes, got {entry!r}")
    unmatched = [e for e in skip if not any(_skipped(n, m, [e]) for n, m in model.named_modules())]
    if unmatched:
        raise ValueError(
            f"skip_layers entries {unmatched} match no module of the model (names: {[n for n, _ in model.named_modules() if n][:12]} ...)"
        )
    functional = functional_submodules(model)
    holders: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(pname)
    layers: list[KFACLayer] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not weight.requires_grad or name in functional or _skipped(name, module, skip):
            continue
        extractor = make_extractor(module)
        if extractor is None:
            continue
        layer_name = name or type(module).__name__
        if len(holders.get(id(weight), [])) > 1:
            raise ValueError(
                f"the weight of layer {layer_name!r} is shared by {holders[id(weight)]} (tied weights): its gradient "
                f"sums every use, but its factors would describe only this layer's; exclude the layers that share it "
                f"with skip_layers (they then get the plain update)"
            )
        layers.append(KFACLayer(layer_name, extractor.module, extractor, compute_method))  # extractor.module is module
    return layers


def factor_list(layers: list[KFACLayer]) -> list[tuple[tuple[str, str], int]]:
    """``[((kind, layer name), dim)]``: A then G of each layer, the order placements follow (Eq. 22)."""
    return [((kind, layer.name), layer.dim(kind)) for layer in layers for kind in FACTOR_KINDS]


def preconditioned_layers(model: nn.Module, compute_method: str, skip: Sequence[LayerFilter] = ()) -> list[KFACLayer]:
    """:func:`kfac_layers`, with a notice naming the layers used without ``forward()``; at least one layer, or an error."""
    functional = functional_submodules(model)
    if functional:  # a notice, once: these layers are not preconditioned
        warnings.warn(f"these layers get the plain momentum-SGD update, without K-FAC: {functional}", stacklevel=3)
    layers = kfac_layers(model, compute_method, skip)
    if not layers:
        raise ValueError(
            "model has no layer SPDKFACOptimizer can precondition (nn.Linear or nn.Conv2d with groups=1 "
            "and zero padding, with a trainable weight); use torch.optim.SGD for this model"
        )
    return layers
