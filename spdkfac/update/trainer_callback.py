"""Hugging Face ``Trainer``'s checkpoints with every worker's K-FAC state: a callback that gathers it before each save.

``Trainer`` saves ``optimizer.state_dict()`` on the main process alone, so the
collective ``consolidate_state_dict()`` (needed with ``grad_worker_fraction``
below 1, where each worker keeps its own layers' decompositions) cannot run
inside that call. Its callbacks run on every worker, and at the end of each
step (and epoch) after ``Trainer`` has decided whether to save
(``control.should_save``, set by its own callback, which runs first); under
``save_strategy='best'`` the decision follows an evaluation, so the gather
runs after every evaluation there. transformers is imported only when the
callback is made: it is not a dependency.
"""

from __future__ import annotations

from typing import Any

from .your_optimizer import CONSOLIDATE

__all__ = ["hugging_face_callback"]


def hugging_face_callback() -> Any:
    """A ``transformers.TrainerCallback`` that calls the Trainer's optimizer's ``consolidate_state_dict()`` on
    every worker before each checkpoint, so that rank 0 saves every worker's K-FAC state and ``resume_from_checkpoint``
    continues the uninterrupted run bit for bit::

        Trainer(model, args, optimizers=(optimizer, None), callbacks=[spdkfac.hugging_face_callback()])

    ``optimizer``: an :class:`~spdkfac.SPDKFACOptimizer`, or your optimizer
    with a :class:`~spdkfac.KFACPreconditioner` attached (``optimizer=``).
    Needed with ``grad_worker_fraction`` below 1 only; elsewhere it sends
    nothing. ImportError without transformers.
    """
    from transformers import TrainerCallback  # (optional: only for this)

    methods = {"on_step_end": _gather_if_saving, "on_epoch_end": _gather_if_saving, "on_evaluate": _gather_if_best_may_save}
    return type("ConsolidateKFACBeforeSave", (TrainerCallback,), methods)()


def _gather_if_saving(callback: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
    if control.should_save:
        _consolidate(kwargs.get("optimizer"))


def _gather_if_best_may_save(callback: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
    if args.save_strategy == "best":  # (transformers' SaveStrategy is a str enum)
        _consolidate(kwargs.get("optimizer"))


def _consolidate(optimizer: Any) -> None:
    if optimizer is None:  # (an evaluate() before train(): no optimizer yet, nothing to gather)
        return
    found = innermost = optimizer
    while found is not None and not hasattr(found, CONSOLIDATE):
        innermost, found = found, getattr(found, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps yours
    if found is None:
        raise TypeError(
            f"hugging_face_callback(): the Trainer's optimizer ({type(innermost).__name__}) has no consolidate_state_dict(): "
            "give Trainer an spdkfac.SPDKFACOptimizer, or your optimizer with spdkfac.KFACPreconditioner(model, "
            "optimizer=optimizer) attached, through optimizers=(optimizer, scheduler)"
        )
    getattr(found, CONSOLIDATE)()
