"""Whether K-FAC's state fits the device, said at construction, before the first factor step allocates it.

A layer's factors grow with the square of its width: an untied language-model
head over a 128k vocabulary has a ``G`` of 128k x 128k, 61 GiB in float32,
and its inverse as much again. Without this check the first factor step
failed with the device's own out-of-memory error, naming neither the layer
nor the remedy, or on a CPU the kernel killed the process without a word.
The estimate is the plan's state per layer (:func:`layer_memory`, the one
count, which :func:`~spdkfac.plan.grad_worker_choice.plan_memory` sums for the
gradient workers' choice) plus the working memory of the largest factor's
computation and decomposition; it warns only when that exceeds what the
device has free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..kfac.layers import FACTOR_KINDS, wider
from ..kfac.methods import DecompositionMethod
from .work_plan import LayerShape, WorkPlan

__all__ = ["LayerMemory", "available_bytes", "fitting_max_factor_dim", "layer_memory", "memory_warning", "memory_warnings"]

#: Working memory of the largest factor, in its squares (``d x d`` matrices): the batch Gram in the hook, and a
#: decomposition's copies (the damped factor, its Cholesky or eigenvectors, the result) at the same time. Measured
#: beyond the state in a first step on the CPU (a 12,000-wide G, float32): 4.6 for the inverse, 3.6 for eigen.
WORKING_SQUARES = 5


@dataclass(frozen=True)
class LayerMemory:
    """The bytes of one layer's K-FAC state on this worker, and the widest of its factors."""

    name: str
    bytes: int
    widest: str  # e.g. "G 32000x32000"
    square_bytes: int  # one (widest dim)^2 matrix


def layer_memory(plan: WorkPlan, method: DecompositionMethod, rank: int, element_sizes: Mapping[str, int]) -> list[LayerMemory]:
    """Per layer: its running factors, and its decompositions where ``rank`` holds them (as ``memory_usage()`` counts
    them once allocated), EKFAC's per-coordinate scaling where ``rank`` preconditions them; ``element_sizes``: each
    layer's factor bytes."""
    return [
        _memory(shape, plan.holds(rank, shape.name), method, element_sizes[shape.name], rank in plan.preconditioning_ranks(shape.name))
        for shape in plan.layers
    ]


def _memory(shape: LayerShape, held: bool, method: DecompositionMethod, element_size: int, keeps_state: bool | None = None) -> LayerMemory:
    """``keeps_state``: whether the method's per-layer state is kept here (where the layer is preconditioned; by
    default where its decompositions are held)."""
    elements = 0
    for kind in FACTOR_KINDS:
        factor = shape.factor_shape(kind)
        elements += factor.packed_size
        if held:
            elements += method.kept_size(factor)
    if method.stateful and (held if keeps_state is None else keeps_state):
        elements += shape.a_dim * shape.g_dim * shape.blocks
    kind, dim = _widest(shape)
    blocks = f"{shape.blocks} blocks of " if shape.blocks > 1 else ""
    return LayerMemory(shape.name, elements * element_size, f"{kind} {blocks}{dim}x{dim}", dim * dim * element_size)


def _needed(layers: Sequence[LayerMemory], sharing: int) -> int:
    """The bytes the state and the largest factor's working memory take, for ``sharing`` workers on the device."""
    return (sum(la.bytes for la in layers) + WORKING_SQUARES * max(la.square_bytes for la in layers)) * sharing


def fitting_max_factor_dim(
    shapes: Sequence[LayerShape],
    held: Callable[[str], bool],
    method: DecompositionMethod,
    element_sizes: Mapping[str, int],
    available: int,
    sharing: int = 1,
) -> tuple[int, int] | None:
    """The largest ``max_factor_dim`` whose state (the factors wider than it diagonal) fits ``available`` bytes, and
    that state's bytes; None where none does (what is left is not wide factors)."""
    dims = sorted({s.dim(k) for s in shapes for k in FACTOR_KINDS if not s.factor_shape(k).diagonal and s.blocks == 1}, reverse=True)
    for limit in dims[1:]:
        narrowed = [
            replace(
                s,
                a_diagonal=s.a_diagonal or wider(s.factor_shape("A"), limit),
                g_diagonal=s.g_diagonal or wider(s.factor_shape("G"), limit),
            )
            for s in shapes
        ]
        layers = [_memory(s, held(s.name), method, element_sizes[s.name]) for s in narrowed]
        if _needed(layers, sharing) <= available:
            return limit, sum(la.bytes for la in layers)
    return None


def _widest(shape: LayerShape) -> tuple[str, int]:
    """The layer's widest square factor and its dimension (a diagonal one counts as none: it is a vector)."""
    kind = max(FACTOR_KINDS, key=lambda k: 0 if shape.factor_shape(k).diagonal else shape.dim(k))
    return kind, 0 if shape.factor_shape(kind).diagonal else shape.dim(kind)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: CUDA's free bytes, or the host's ``MemAvailable`` (Linux); None where unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def memory_warning(
    layers: Sequence[LayerMemory], available: int | None, device: str, sharing: int = 1, fitting: tuple[int, int] | None = None
) -> str | None:
    """The warning to give when this worker's K-FAC state, with ``sharing`` workers like it on the device (CPU
    processes of one node share its memory), exceeds ``available`` bytes; None when it fits or nothing is known.
    ``fitting``: the largest ``max_factor_dim`` that fits, and its state's bytes (:func:`fitting_max_factor_dim`)."""
    if available is None or not layers:
        return None
    state = sum(la.bytes for la in layers)
    working = WORKING_SQUARES * max(la.square_bytes for la in layers)
    if _needed(layers, sharing) <= available:
        return None
    # The layers that matter: up to three, each with a tenth of the state or more (the largest always).
    ranked = sorted(layers, key=lambda la: -la.bytes)
    largest = [la for i, la in enumerate(ranked[:3]) if i == 0 or la.bytes * 10 >= state]
    named = ", ".join(f"{la.name!r} {_gib(la.bytes)} ({la.widest})" for la in largest)
    workers = f" for each of the {sharing} workers on it" if sharing > 1 else ""
    crash = ", and on a CPU the kernel then kills the process without a message" if device == "cpu" else ""
    names = [la.name for la in largest]
    return (
        f"K-FAC's state needs about {_gib(state)} on {device}{workers} (the running factors and their "
        f"decompositions) and about {_gib(working)} more while the largest is computed and decomposed, and "
        f"{_gib(available)} is free: the first factor step will likely run out of memory{crash}. The largest: "
        f"{named}. Leave {'it' if len(names) == 1 else 'them'} to the base update, skip_layers={names!r}; keep each "
        f"factor wider than some d as its diagonal, max_factor_dim=d{_fits(fitting)}; or hold fewer decompositions "
        f"per worker (grad_worker_fraction < 1, or 'auto' with memory_budget=)"
    )


def _fits(fitting: tuple[int, int] | None) -> str:
    return "" if fitting is None else f" (max_factor_dim={fitting[0]} fits: about {_gib(fitting[1])} of state)"


def memory_warnings(
    plan: WorkPlan, method: DecompositionMethod, rank: int, placed: Mapping[str, tuple[torch.device, int]], cpu_workers: int = 1
) -> list[str]:
    """:func:`memory_warning` for each device the layers are on; ``placed``: each layer's device and factor element size,
    ``cpu_workers``: the processes of the job on this node (they share its host memory)."""
    sizes = {name: size for name, (_, size) in placed.items()}
    per_device: dict[torch.device, list[LayerMemory]] = {}
    for layer in layer_memory(plan, method, rank, sizes):
        per_device.setdefault(placed[layer.name][0], []).append(layer)
    out = []
    for device, layers in per_device.items():
        available, sharing = available_bytes(device), cpu_workers if device.type == "cpu" else 1
        fitting = None
        if available is not None and _needed(layers, sharing) > available:  # (it does not fit: say which max_factor_dim would)
            shapes = [shape for shape in plan.layers if placed[shape.name][0] == device]
            fitting = fitting_max_factor_dim(shapes, lambda name: plan.holds(rank, name), method, sizes, available, sharing)
        text = memory_warning(layers, available, str(device), sharing, fitting)
        if text is not None:
            out.append(text)
    return out
