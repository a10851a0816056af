"""Horovod's elastic mode (``horovodrun --min-np/--max-np``): the K-FAC state committed, restored, synced and re-planned.

Use :class:`ElasticState` where a Horovod script uses ``hvd.elastic.TorchState``::

    hvd.init()
    optimizer = SPDKFACOptimizer(model, lr=0.1)
    state = ElasticState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...  # read rank and size from hvd here: they change at every reset
        state.commit()  # every few steps: a copy in memory, and the point where added workers join

    train(state)

Horovod's elastic loop calls :meth:`ElasticState.restore` after a lost
worker (a collective raised ``HorovodInternalError``), re-initialises Horovod
at the new size, calls :meth:`ElasticState.on_reset` and then
:meth:`ElasticState.sync`. The reset re-plans every object that can
(``SPDKFACOptimizer.replan``, ``KFACPreconditioner.replan``): fusion, placement
and gradient workers are planned for the new size as a job started at that
size plans them (the torchrun restart of :mod:`spdkfac.train.run` does the same
in a new process), the committed state is loaded back and the reset callbacks
run (e.g. to scale the learning rate). ``sync`` then sends rank 0's state to
every worker, so an added worker starts from it and every replica is bitwise
equal.

What is committed: the model's ``state_dict()`` (parameters and buffers), the
``state_dict()`` of every object given that has one (the K-FAC optimizer or
preconditioner: step counter, factors, decompositions, base-optimizer state,
schedule values; a torch optimizer under a preconditioner, LR schedulers,
:class:`~spdkfac.schedules.KFACParamScheduler`, a GradScaler), and the plain
values given as keywords. Every load is from a copy: the commit is never
aliased by the live objects, so a restore always gives back the commit, bit
for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch.nn as nn

from ..optimizer import SPDKFACOptimizer
from ..preconditioner import KFACPreconditioner

__all__ = ["ElasticState", "Replannable", "Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """An object whose state is its ``state_dict()``, restored by ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class Replannable(Protocol):
    """An object that plans for the current number of workers and re-plans after a reset."""

    def replan(self) -> None: ...


class ElasticState:
    """``hvd.elastic.TorchState`` for a model trained with spdkfac: the state that survives workers coming and going.

    Args:
        model: the model; its ``state_dict()`` is committed.
        optimizer: the :class:`~spdkfac.SPDKFACOptimizer`, a
            :class:`~spdkfac.KFACPreconditioner`, or any object with
            ``state_dict()`` / ``load_state_dict()``.
        bcast_object, get_rank: how rank 0's commit reaches the others, and
            this worker's rank (default: Horovod's ``broadcast_object`` and
            ``rank``; tests pass their own).
        **values: more objects with ``state_dict()`` / ``load_state_dict()``
            (your torch optimizer under a preconditioner, LR schedulers,
            :class:`~spdkfac.schedules.KFACParamScheduler`, a GradScaler) and
            plain values (``epoch=0``, ``batch=0``). Each is an attribute of
            the state (``state.epoch += 1``; ``state.optimizer``).

    Every object with a ``replan()`` method is re-planned after each reset.
    Callable schedules are not committed (as in ``state_dict()``): they are
    the same functions in every process of the script.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Stateful,
        *,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **values: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, Stateful):
            raise TypeError(f"optimizer must have state_dict() and load_state_dict(), got {type(optimizer).__name__}")
        kfac = optimizer.kfac if isinstance(optimizer, KFACPreconditioner) else optimizer
        if isinstance(kfac, SPDKFACOptimizer) and kfac.method.stateful and kfac.config.splits_preconditioning:
            raise ValueError(
                f"compute_method={kfac.method.name!r} keeps each layer's per-layer state where the layer is "
                "preconditioned, and with grad_worker_fraction below 1 a worker restored from its own commit, or "
                "re-planned for another size, would need state that other workers kept: not supported in Horovod's "
                "elastic mode; use grad_worker_fraction=1 (or compute_method='eigen'), or restart from checkpoints "
                "(spdkfac.train --resume auto)"
            )
        if bcast_object is None or get_rank is None:
            from horovod.torch import broadcast_object, rank

            bcast_object, get_rank = bcast_object or broadcast_object, get_rank or rank
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._notices = _host_notices(bcast_object, get_rank)
        self.model = model
        self.optimizer = optimizer
        self._objects: dict[str, Stateful] = {"optimizer": optimizer}
        self._values: list[str] = []
        for name, value in values.items():
            if hasattr(type(self), name) or name in ("model", "optimizer"):
                raise ValueError(f"{name!r} is a name of ElasticState itself; pass that value under another name")
            setattr(self, name, value)
            if isinstance(value, Stateful):
                self._objects[name] = value
            else:
                self._values.append(name)
        self._committed: dict[str, Any] = self._snapshot()

    # ------------------------------------------------------------ Horovod's State interface
    def commit(self) -> None:
        """Keep a copy of the state in memory, then raise ``HostsUpdatedInterrupt`` if workers are to join or leave.

        Horovod's contract: every worker commits at the same step. A commit
        copies every tensor (the factors and decompositions too), so commit
        every few steps, not every step, on large models; a lost worker costs
        the steps since the last commit.
        """
        self.save()
        self.check_host_updates()

    def save(self) -> None:
        """Keep a copy of the current state (the commit, without the check for joining or leaving workers)."""
        self._committed = self._snapshot()

    def restore(self) -> None:
        """Undo everything since the last commit: the committed state, bit for bit, in every object and value.

        The K-FAC objects drop the step in progress first (a failed step's
        collectives never complete), by re-planning for the size Horovod
        still reports; the reset that follows re-plans for the new size.
        """
        self._replan()
        self._load(self._committed)

    def sync(self) -> None:
        """Give every worker rank 0's state, loaded and kept as its commit (an added worker starts from it).

        Rank 0's state is its commit as the reset loaded it, plus what the
        reset callbacks changed (the learning rate for the new size), so
        every worker starts alike.
        """
        mine = self._snapshot() if self._get_rank() == 0 else self._committed  # a dict everywhere: Horovod names the collective by its type
        state = self._bcast_object(mine)
        self._load(state)
        self._committed = state

    def reset(self) -> None:
        """After Horovod re-initialised at the new size: re-plan every object that plans, and load the commit again."""
        self._replan()
        self._load(self._committed)

    def on_reset(self) -> None:
        """Called by ``hvd.elastic.run`` after each reset: :meth:`reset`, then the callbacks registered."""
        self.reset()
        self._notices.on_reset()  # drops the host notices already acted on; runs the callbacks

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after each reset, once the state is re-planned (e.g. to scale the LR with ``hvd.size()``)."""
        self._notices.register_reset_callbacks(list(callbacks))

    def on_hosts_updated(self, timestamp: int, update_res: Any) -> None:
        """Horovod's notice that hosts were added or removed (acted on at the next :meth:`commit`)."""
        self._notices.on_hosts_updated(timestamp, update_res)

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every worker alike if Horovod announced added or removed hosts."""
        self._notices.check_host_updates()

    # ------------------------------------------------------------ inside
    @property
    def committed(self) -> dict[str, Any]:
        """The last commit: ``{'model': ..., 'objects': {name: state_dict}, 'values': {name: value}}`` (do not modify)."""
        return self._committed

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "objects": {name: obj.state_dict() for name, obj in self._objects.items()},
                "values": {name: getattr(self, name) for name in self._values},
            }
        )

    def _load(self, committed: dict[str, Any]) -> None:
        """Load a copy of ``committed`` (the live objects must never share a tensor with the commit)."""
        state = copy.deepcopy(committed)
        self.model.load_state_dict(state["model"])
        for name, obj in self._objects.items():
            obj.load_state_dict(state["objects"][name])
        for name, value in state["values"].items():
            setattr(self, name, value)

    def _replan(self) -> None:
        for obj in self._objects.values():
            if isinstance(obj, Replannable):
                obj.replan()


def _host_notices(bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> Any:
    """Horovod's own bookkeeping of host notices and reset callbacks (``horovod.common.elastic.State``)."""
    from horovod.common.elastic import State

    return State(bcast_object=bcast_object, get_rank=get_rank)
