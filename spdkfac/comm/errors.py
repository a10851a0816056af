"""Errors about collectives, and the collective timeout every engine takes.

A worker that stops answering (a frozen process, a hung host, a rank stuck
before a collective the others already issued) would otherwise leave its
peers waiting for the engine's own limit: 30 minutes for torch.distributed.
The engines bound each collective by ``collective_timeout`` seconds and then
raise :class:`CollectiveTimeoutError` naming the collective and, when it can
be known, the rank(s) that did not answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "CollectiveError",
    "CollectiveTimeoutError",
    "WorkerLostError",
    "check_collective_timeout",
    "lost_message",
    "timeout_message",
]

#: Seconds a worker may wait for the others in one collective. Legitimate waits are far shorter (the longest
#: known: rank 0 writing a checkpoint, a first step's warm-up on a loaded node, an epoch's uneven evaluation),
#: and five minutes still ends a job with a frozen worker six times sooner than torch.distributed's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class CollectiveError(RuntimeError):
    """Base class of the errors the engines raise about collectives."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete in time: some worker stopped answering or never issued it."""


class WorkerLostError(CollectiveError):
    """A collective failed because a worker stopped answering (frozen past the timeout, killed, or unreachable)."""


def check_collective_timeout(value: object) -> float:
    """``value`` as seconds, or a ValueError/TypeError that names the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"collective_timeout must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"collective_timeout must be a positive, finite number of seconds, got {value!r}")
    return seconds


def timeout_message(collective: str, rank: int, size: int, timeout_s: float | None, silent: Sequence[int] | None) -> str:
    """What a rank says when ``collective`` timed out on it.

    ``silent``: the ranks known to have stopped answering (their processes
    are frozen or gone), ``[]`` when every other rank is known to be alive,
    ``None`` when nothing is known (then, with two workers, the other one is
    named: it is the only one this rank waits for).
    """
    after = f" after {timeout_s:g} s (collective_timeout)" if timeout_s is not None else ""
    head = f"collective {collective!r} timed out on rank {rank}{after}: "
    others = [r for r in range(size) if r != rank]
    if silent:
        who = f"rank {silent[0]}" if len(silent) == 1 else "ranks " + ", ".join(str(r) for r in silent)
        return head + f"{who} stopped answering (frozen, killed or unreachable)"
    if silent is not None:
        return head + (
            "every other worker is alive but one of them did not reach this collective "
            "(a step far slower than the timeout, or workers issuing collectives in different orders)"
        )
    if len(others) == 1:
        return head + f"rank {others[0]} did not answer (frozen, hung, or far behind)"
    return head + f"a worker among ranks {', '.join(str(r) for r in others)} did not answer (frozen, hung, or far behind)"


def lost_message(collective: str, rank: int, silent: Sequence[int], why: str) -> str:
    """What a rank says when ``collective`` failed because the ``silent`` ranks stopped answering; ``why``: the engine's part."""
    who = f"rank {silent[0]}" if len(silent) == 1 else "ranks " + ", ".join(str(r) for r in silent)
    return f"collective {collective!r} failed on rank {rank}: {who} stopped answering (frozen, killed or unreachable); {why}"
