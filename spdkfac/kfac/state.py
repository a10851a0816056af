"""What a checkpoint holds of K-FAC: running averages, decompositions, step counter, update frequencies.

Kept apart from ``torch.optim.Optimizer``'s own state (momentum buffers,
``param_groups``), under the ``'kfac'`` entry of the optimizer's
``state_dict``. Loading checks that the checkpoint fits (same compute method,
same layers with the same factor dimensions) before anything is changed; the
layers are matched through the wrappers activation checkpointing and
``torch.compile`` add to module names, so a run resumes with either turned
on or off.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from .layers import FACTOR_KINDS, KFACLayer, unwrapped_name
from .methods import DecompositionMethod, get_method

__all__ = [
    "check_kfac_state",
    "is_base_state",
    "keep_held_decompositions",
    "load_kfac_state",
    "memory_usage",
    "save_kfac_state",
    "saved_uses",
]


def save_kfac_state(
    layers: Sequence[KFACLayer],
    steps: int,
    update_freqs: tuple[int, int],
    method: DecompositionMethod,
    config: dict[str, Any],
    uses: dict[tuple[str, str], int] | None = None,
) -> dict[str, Any]:
    """The ``'kfac'`` entry of a state dict (tensors by reference, as ``torch.optim`` does).

    Per layer: ``dims`` (the factor dimensions, of one block), the running
    averages ``A`` and ``G`` in full form (``(d, d)``, ``(blocks, d, d)``, or
    a diagonal's vector), and the method's decompositions under
    ``A<suffix>`` / ``G<suffix>`` (``A_inv``: a tensor; ``A_eigen``:
    ``{'Q', 'd'}``, with ``'age'`` for a warm-started refresh), and the
    method's per-layer state under ``method_state`` where it has one (EKFAC:
    ``{'scale', 'samples'}``), and ``uses``, the calls per step each factor
    was last seen to take (``{'A': k, 'G': k}``, a layer used ``k`` times;
    absent until the layer ran), so a resumed run sends its factors as the
    uninterrupted run does. Plain tensors, numbers, strings, lists and dicts only.
    """
    uses = uses or {}
    return {
        "steps": steps,
        "update_freqs": list(update_freqs),
        "compute_method": method.name,
        "config": config,  # for the record; only compute_method and the layers must match on load
        "layers": {
            layer.name: {
                "dims": [layer.a_dim, layer.g_dim],
                "A": layer.A,
                "G": layer.G,
                **{
                    f"{kind}{method.suffix}": None if layer.decomposition(kind) is None else method.save(layer.decomposition(kind))
                    for kind in FACTOR_KINDS
                },
                **_method_state(layer, method),
                **_uses(layer, uses),
            }
            for layer in layers
        },
    }


def _method_state(layer: KFACLayer, method: DecompositionMethod) -> dict[str, Any]:
    """``{'method_state': ...}`` of a method with per-layer state, else nothing."""
    saved = method.save_state(layer.method_state)
    return {} if saved is None else {"method_state": saved}


def _uses(layer: KFACLayer, uses: dict[tuple[str, str], int]) -> dict[str, Any]:
    """``{'uses': {kind: calls}}`` for the factors whose calls per step were learned, else nothing."""
    known = {kind: int(uses[(kind, layer.name)]) for kind in FACTOR_KINDS if (kind, layer.name) in uses}
    return {"uses": known} if known else {}


def saved_uses(kfac: dict[str, Any]) -> dict[tuple[str, str], int]:
    """The calls per step of each factor a checked ``'kfac'`` entry holds (none from checkpoints made before)."""
    return {(kind, name): int(calls) for name, entry in kfac["layers"].items() for kind, calls in entry.get("uses", {}).items()}


def is_base_state(state_dict: Any) -> bool:
    """Whether ``state_dict`` is an SPDKFACOptimizer checkpoint's ``state`` and ``param_groups`` alone (the form
    ``torch.distributed.checkpoint`` keeps): its groups carry K-FAC's hyperparameters, a plain optimizer's do not."""
    return (
        isinstance(state_dict, dict)
        and set(state_dict) == {"state", "param_groups"}
        and bool(state_dict["param_groups"])
        and all(isinstance(group, dict) and {"damping", "kl_clip"} <= set(group) for group in state_dict["param_groups"])
    )


def check_kfac_state(state_dict: Any, layers: Sequence[KFACLayer], method: DecompositionMethod) -> dict[str, Any]:
    """The ``'kfac'`` entry of ``state_dict`` if it fits these layers and method; a ValueError saying why not."""
    if not isinstance(state_dict, dict) or "kfac" not in state_dict:
        raise ValueError(
            "not an SPDKFACOptimizer checkpoint: the 'kfac' entry is missing (torch.distributed.checkpoint's "
            "get_state_dict keeps only 'state' and 'param_groups': save optimizer.kfac_state_dict() beside it, and "
            "call optimizer.load_kfac_state_dict(saved) before set_state_dict)"
        )
    kfac: dict[str, Any] = state_dict["kfac"]
    saved_method = kfac.get("compute_method", "inverse")  # checkpoints from before the eigen method hold inverses
    if saved_method != method.name:
        try:
            what = get_method(saved_method).label
        except ValueError:
            what = "decompositions"
        raise ValueError(
            f"checkpoint was saved with compute_method={saved_method!r} but this optimizer uses "
            f"compute_method={method.name!r}: its {what} "
            f"cannot precondition here; construct the optimizer with compute_method={saved_method!r} to resume it"
        )
    saved = kfac.get("layers", {})
    mine = {layer.name: [layer.a_dim, layer.g_dim] for layer in layers}
    theirs = {name: list(entry.get("dims", [])) for name, entry in saved.items()}
    renamed = _renamed_through_wrappers(mine, theirs)
    if renamed is not None:  # the same layers, under wrappers added or removed since
        kfac = {**kfac, "layers": {name: saved[renamed[name]] for name in mine}}
        theirs = mine
    if mine != theirs:
        only_mine = sorted(set(mine) - set(theirs))
        only_theirs = sorted(set(theirs) - set(mine))
        differ = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        tied = [la.name for la in layers if la.name in only_mine and la.tied_embedding is not None]
        hint = (
            f"; an embedding tied to its output layer is now preconditioned, where earlier versions gave it the base "
            f"update: a checkpoint saved so resumes with skip_layers={tied!r}"
            if tied
            else ""
        )
        raise ValueError(
            "checkpoint was saved for a different model: "
            f"layers missing from checkpoint {only_mine}, unknown layers in checkpoint {only_theirs}, "
            f"layers with different factor dimensions {differ}{hint}"
        )
    return kfac


def _renamed_through_wrappers(mine: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict[str, str] | None:
    """For a checkpoint whose layers are these under wrappers added or removed since (activation checkpointing
    turned on or off between runs): each layer's name -> its saved name. None where the names differ otherwise."""
    if mine == theirs:
        return None
    ours = {unwrapped_name(name): name for name in mine}
    saved = {unwrapped_name(name): name for name in theirs}
    if len(ours) != len(mine) or len(saved) != len(theirs) or ours.keys() != saved.keys():
        return None
    if any(mine[ours[key]] != theirs[saved[key]] for key in ours):
        return None
    return {ours[key]: saved[key] for key in ours}


def load_kfac_state(kfac: dict[str, Any], layers: Sequence[KFACLayer]) -> None:
    """Copy a checked ``'kfac'`` entry's factors and decompositions into the layers (onto their devices)."""
    for layer in layers:
        entry = kfac["layers"][layer.name]
        device = layer.helper.weight.device
        method = layer.method
        for kind in FACTOR_KINDS:
            value = entry.get(kind)
            try:
                layer.set_factor(kind, value.detach().clone().to(device) if value is not None else None)
                saved = entry.get(f"{kind}{method.suffix}")
                layer.set_decomposition(kind, None if saved is None else method.load(saved, layer.shape(kind), device))
            except ValueError as exc:
                raise ValueError(f"checkpoint was saved for a different model: layer {layer.name!r}: {exc}") from None
        layer.method_state = method.load_state(entry.get("method_state"), device)


def keep_held_decompositions(kfac: dict[str, Any], layers: Sequence[KFACLayer], held: Collection[str], method: DecompositionMethod) -> None:
    """After :func:`load_kfac_state`: drop the decompositions of the layers not in ``held``; all of them if the
    checkpoint lacks any.

    A checkpoint saved with ``grad_worker_fraction`` < 1 holds only the
    saving worker's decompositions. Every worker reads the same file, so
    all decide alike to recompute every decomposition at the next step
    (from the saved running factors): bit for bit the uninterrupted run
    when decompositions are updated every step, one early refresh
    otherwise.
    """
    entries = [kfac["layers"][layer.name] for layer in layers if layer.preconditions]  # (a tied embedding holds none)
    complete = all(entry.get(f"{kind}{method.suffix}") is not None for entry in entries for kind in FACTOR_KINDS)
    for layer in layers:
        if not complete or layer.name not in held:
            for kind in FACTOR_KINDS:
                layer.set_decomposition(kind, None)


def memory_usage(layers: Sequence[KFACLayer], method: DecompositionMethod) -> dict[str, int]:
    """Bytes held by factors (flat running averages) and the method's decompositions, per kind (and, for a
    method with per-layer state, ``method_state``)."""
    held = tuple(f"{kind}{method.suffix}" for kind in FACTOR_KINDS)
    out = dict.fromkeys(FACTOR_KINDS + held, 0)
    for layer in layers:
        for kind, key in zip(FACTOR_KINDS, held):
            packed = layer.packed_factor(kind)
            if packed is not None:
                out[kind] += packed.numel() * packed.element_size()
            kept = layer.decomposition(kind)
            if kept is not None:
                out[key] += sum(t.numel() * t.element_size() for t in method.tensors(kept))
    if method.stateful:  # EKFAC's per-layer scaling
        out["method_state"] = sum(t.numel() * t.element_size() for layer in layers for t in layer.method_state.tensors())
    return out
