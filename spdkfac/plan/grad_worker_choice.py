"""Choosing KAISA's ``grad_worker_fraction`` from the fitted performance models, under a memory budget.

One implementation, called by the optimizer (``grad_worker_fraction='auto'``)
and by the simulator. For each whole number ``g`` of gradient workers per
layer (every divisor of ``P``) it makes the optimizer's own
:class:`~spdkfac.plan.work_plan.WorkPlan` and charges it with the fitted models:

* the decomposition stage: the busiest rank's decompositions and the
  broadcasts of their results to the layer's gradient workers (the plan's
  makespan), once per ``inv_update_freq`` steps;
* the preconditioning matmuls of the busiest rank, every step, at the
  arithmetic rate of the fitted inversion curve (an inversion and a
  ``G grad A`` product are both about ``d^3`` multiply-adds); with
  ``overlap_preconditioning`` (on several workers), on the steps that keep
  the decompositions, only what exceeds the modelled all-reduce of the
  preconditioned layers' gradients, during which each layer is
  preconditioned as its averaged gradient arrives;
* the broadcasts of the preconditioned gradients, every step: a rank's link
  carries every broadcast it takes part in (:func:`result_broadcast_seconds`).

The memory is exact, not modelled: every rank holds every running factor
(they are all-reduced) and the decompositions of the layers it is a
gradient worker of, as :func:`~spdkfac.kfac.state.memory_usage` counts them.
The parts that do not depend on ``g`` (forward, backward, the factor and
gradient all-reduces) are left out: they change no choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..kfac.methods import DecompositionMethod, get_method
from ..perfmodels import PerfModel
from .grad_workers import grad_worker_count
from .memory_check import layer_memory
from .work_plan import LayerShape, WorkPlan, overlaps_preconditioning, preconditioning_seconds

__all__ = [
    "GradWorkerOption",
    "GradWorkerProblem",
    "grad_worker_record",
    "plan_memory",
    "plan_seconds",
    "rechosen_note",
    "result_broadcast_seconds",
]


@dataclass(frozen=True)
class GradWorkerOption:
    """One number of gradient workers per layer, its plan, modelled seconds per step and largest per-worker memory."""

    grad_workers: int
    workers: int
    seconds: float
    memory: int  # bytes of K-FAC state on the fullest worker
    plan: WorkPlan

    @property
    def fraction(self) -> float:
        return self.grad_workers / self.workers

    def describe(self) -> str:
        return (
            f"grad_worker_fraction={self.grad_workers}/{self.workers} ({self.fraction:g}): "
            f"predicted {self.seconds * 1e3:.2f} ms/step of decompositions, preconditioning and their broadcasts, "
            f"{self.memory / 2**20:.2f} MiB of K-FAC state per worker"
        )


def result_broadcast_seconds(plan: WorkPlan, perf: PerfModel, elements: Mapping[str, int]) -> list[float]:
    """Seconds each rank's link is busy with the broadcasts of preconditioned gradients in one step.

    ``elements`` maps each layer to its gradient's size. A rank takes part in
    several broadcasts at once (the root of its own layers', a receiver of
    the others'); they share its link, so it is busy for the sum of their
    costs, each at its group's size, not for the longest one. That sum is
    what grows as the gradient workers get fewer: at ``1/P`` every rank
    moves the whole preconditioned gradient every step (KAISA §5.5).
    ``perf`` describes the plan's worker count (:meth:`PerfModel.scaled_to`).
    """
    busy = [0.0] * plan.workers
    for b in plan.result_broadcasts(list(elements)):
        model = perf.scaled_to(len(b.members)).broadcast
        cost = model.alpha + model.beta * sum(elements[n] for n in b.layers)
        for r in b.members:
            busy[r] += cost
    return busy


def plan_seconds(
    plan: WorkPlan, perf: PerfModel, method: str | DecompositionMethod, inv_update_freq: int = 1, overlap_preconditioning: bool = False
) -> float:
    """Modelled seconds per step of the parts ``plan``'s gradient workers change (see the module docstring).

    ``perf`` describes the plan's worker count (:meth:`PerfModel.scaled_to`).
    """
    names = [s.name for s in plan.layers]
    shapes = {s.name: s for s in plan.layers}
    m = get_method(method)
    work = {n: preconditioning_seconds(perf, m, s) for n, s in shapes.items()}
    busiest = max((sum(work[n] for n in plan.preconditioned_here(r, names)) for r in range(plan.workers)), default=0.0)
    elements = {n: s.blocks * s.a_dim * s.g_dim for n, s in shapes.items()}
    if overlaps_preconditioning(overlap_preconditioning, True, plan.workers, inverse_step=False):
        # Only steps that keep the decompositions overlap (an inverse step needs this step's factors first).
        hidden = min(busiest, perf.allreduce(sum(elements.values())))
        busiest -= hidden * (1.0 - 1.0 / inv_update_freq)
    links = result_broadcast_seconds(plan, perf, elements)
    return plan.inversion.makespan / inv_update_freq + busiest + max(links, default=0.0)


def plan_memory(plan: WorkPlan, method: str | DecompositionMethod, element_size: int = 4) -> list[int]:
    """Bytes of K-FAC state on each rank: every running factor, and the decompositions of the layers it holds
    (:func:`~spdkfac.plan.memory_check.layer_memory`, summed)."""
    m = get_method(method)
    sizes = {s.name: element_size for s in plan.layers}
    return [sum(la.bytes for la in layer_memory(plan, m, r, sizes)) for r in range(plan.workers)]


@dataclass(frozen=True)
class GradWorkerProblem:
    """What the choice of gradient workers depends on: the layers, the workers and the models that charge a plan."""

    layers: Sequence[LayerShape]
    workers: int
    perf: PerfModel
    placement: str
    method: str | DecompositionMethod
    native_subgroups: bool
    element_size: int = 4
    inv_update_freq: int = 1
    overlap_preconditioning: bool = True

    def options(self) -> list[GradWorkerOption]:
        """Every whole number of gradient workers per layer (each divisor of ``workers``), fewest first."""
        out = []
        for g in (d for d in range(1, self.workers + 1) if self.workers % d == 0):
            plan = WorkPlan.make(
                self.layers,
                self.workers,
                self.perf,
                self.placement,
                self.method,
                grad_workers=g,
                native_subgroups=self.native_subgroups,
                inv_update_freq=self.inv_update_freq,
            )
            seconds = plan_seconds(plan, self.perf, self.method, self.inv_update_freq, self.overlap_preconditioning)
            memory = max(plan_memory(plan, self.method, self.element_size))
            out.append(GradWorkerOption(g, self.workers, seconds, memory, plan))
        return out

    def choose(self, memory_budget: int | None = None) -> GradWorkerOption:
        """The fastest modelled option whose per-worker K-FAC state fits ``memory_budget`` bytes (None: any).

        Ties go to fewer gradient workers (less memory). A budget nothing fits
        raises a ValueError naming the smallest possible.
        """
        options = self.options()
        fits = [o for o in options if memory_budget is None or o.memory <= memory_budget]
        if not fits:
            least = min(options, key=lambda o: o.memory)
            raise ValueError(
                f"memory_budget={memory_budget} bytes fits no grad_worker_fraction on {self.workers} workers: the "
                f"least K-FAC state per worker is {least.memory} bytes ({least.memory / 2**20:.2f} MiB, with "
                f"grad_worker_fraction={least.grad_workers}/{self.workers}); every worker holds all running factors"
            )
        return min(fits, key=lambda o: (o.seconds, o.grad_workers))

    def resolve(
        self, fraction: float | str | None, distribute_preconditioning: bool, memory_budget: int | None = None
    ) -> tuple[int, GradWorkerOption | None]:
        """Gradient workers per layer for the options as given (and the chosen option, for ``'auto'``).

        None: all (COMM-OPT), or one with ``distribute_preconditioning``; a
        number: :func:`~spdkfac.plan.grad_workers.grad_worker_count`; ``'auto'``:
        :meth:`choose`.
        """
        if fraction == "auto":
            option = self.choose(memory_budget)
            return option.grad_workers, option
        if fraction is not None:
            return grad_worker_count(float(fraction), self.workers), None
        return (1 if distribute_preconditioning else self.workers), None


def grad_worker_record(plan: WorkPlan, choice: GradWorkerOption | None) -> dict[str, Any]:
    """The gradient workers in use (and for ``'auto'`` the modelled time and memory), as a ``state_dict`` saves them."""
    return {
        "workers": plan.workers,
        "grad_workers": plan.grad_workers,
        "fraction": plan.grad_worker_fraction,
        "auto": choice is not None,
        "predicted_seconds": None if choice is None else choice.seconds,
        "predicted_memory_bytes": None if choice is None else choice.memory,
    }


def rechosen_note(saved: Mapping[str, Any] | None, plan: WorkPlan, choice: GradWorkerOption | None) -> str | None:
    """The line that says ``'auto'`` chose other gradient workers than the checkpoint's record ``saved`` (None when it
    did not, or the fraction is not ``'auto'``)."""
    if choice is None or saved is None or (saved["workers"], saved["grad_workers"]) == (plan.workers, plan.grad_workers):
        return None
    return (
        f"spdkfac: grad_worker_fraction='auto': the checkpoint ran {saved['grad_workers']}/{saved['workers']} "
        f"gradient workers; re-chosen for {plan.workers} workers: {choice.describe()}"
    )
