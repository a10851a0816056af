"""What a checkpoint holds of K-FAC: running averages, decompositions, step counter, update frequencies.

Kept apart from ``torch.optim.Optimizer``'s own state (momentum buffers,
``param_groups``), under the ``'kfac'`` entry of the optimizer's
``state_dict``. Loading checks that the checkpoint fits (same compute method,
same layers with the same factor dimensions) before anything is changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .decomposition import Eigen, unpack_eigen
from .layers import FACTOR_KINDS, KFACLayer

__all__ = ["check_kfac_state", "load_kfac_state", "memory_usage", "save_kfac_state"]


def save_kfac_state(
    layers: Sequence[KFACLayer], steps: int, update_freqs: tuple[int, int], compute_method: str, config: dict[str, Any]
) -> dict[str, Any]:
    """The ``'kfac'`` entry of a state dict (tensors by reference, as ``torch.optim`` does)."""
    return {
        "steps": steps,
        "update_freqs": list(update_freqs),
        "compute_method": compute_method,
        "config": config,  # for the record; only compute_method and the layers must match on load
        "layers": {
            layer.name: {
                "dims": [layer.a_dim, layer.g_dim],
                "A": layer.A,
                "G": layer.G,
                "A_inv": layer.A_inv,
                "G_inv": layer.G_inv,
                **{
                    f"{kind}_eigen": None if e is None else {"Q": e.Q, "d": e.d} for kind, e in (("A", layer.A_eigen), ("G", layer.G_eigen))
                },
            }
            for layer in layers
        },
    }


def check_kfac_state(state_dict: Any, layers: Sequence[KFACLayer], compute_method: str) -> dict[str, Any]:
    """The ``'kfac'`` entry of ``state_dict`` if it fits these layers and method; a ValueError saying why not."""
    if not isinstance(state_dict, dict) or "kfac" not in state_dict:
        raise ValueError("not an SPDKFACOptimizer checkpoint: the 'kfac' entry is missing")
    kfac: dict[str, Any] = state_dict["kfac"]
    method = kfac.get("compute_method", "inverse")  # checkpoints from before the eigen method hold inverses
    if method != compute_method:
        raise ValueError(
            f"checkpoint was saved with compute_method={method!r} but this optimizer uses "
            f"compute_method={compute_method!r}: its {'inverses' if method == 'inverse' else 'eigendecompositions'} "
            f"cannot precondition here; construct the optimizer with compute_method={method!r} to resume it"
        )
    saved = kfac.get("layers", {})
    mine = {layer.name: [layer.a_dim, layer.g_dim] for layer in layers}
    theirs = {name: list(entry.get("dims", [])) for name, entry in saved.items()}
    if mine != theirs:
        only_mine = sorted(set(mine) - set(theirs))
        only_theirs = sorted(set(theirs) - set(mine))
        differ = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise ValueError(
            "checkpoint was saved for a different model: "
            f"layers missing from checkpoint {only_mine}, unknown layers in checkpoint {only_theirs}, "
            f"layers with different factor dimensions {differ}"
        )
    return kfac


def load_kfac_state(kfac: dict[str, Any], layers: Sequence[KFACLayer]) -> None:
    """Copy a checked ``'kfac'`` entry's factors and decompositions into the layers (onto their devices)."""
    for layer in layers:
        entry = kfac["layers"][layer.name]
        device = layer.module.weight.device
        for attr in ("A", "G", "A_inv", "G_inv"):
            value = entry.get(attr)
            setattr(layer, attr, value.detach().clone().to(device) if value is not None else None)
        for kind in FACTOR_KINDS:
            eig = entry.get(f"{kind}_eigen")
            if eig is not None:  # one fresh [Q, d] buffer: the layout the decomposition stage leaves
                buffer = torch.cat([eig["Q"].reshape(-1), eig["d"]]).detach().to(device)
                layer.set_eigen(kind, unpack_eigen(buffer, layer.dim(kind)))


def memory_usage(layers: Sequence[KFACLayer], compute_method: str) -> dict[str, int]:
    """Bytes held by factors (packed running averages) and inverses (or eigendecompositions), per kind."""
    held = ("A_inv", "G_inv") if compute_method == "inverse" else ("A_eigen", "G_eigen")
    out = dict.fromkeys(FACTOR_KINDS + held, 0)
    for layer in layers:
        for attr in out:
            value = layer.packed_factor(attr) if attr in FACTOR_KINDS else getattr(layer, attr)
            tensors: list[Any] = [value.Q, value.d] if isinstance(value, Eigen) else [value]
            for t in tensors:
                if t is not None:
                    out[attr] += t.numel() * t.element_size()
    return out
