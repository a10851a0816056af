"""Ends a worker whose wait on one collective outlasts the collective timeout, for an engine that cannot bound it.

Horovod's own timeout only notices a worker whose Horovod thread stops (a
frozen process); a worker that is alive but never issues the collective (a
deadlock, a hung data loader) keeps its peers waiting in ``synchronize()``,
which no other thread can interrupt. The watchdog then prints the error and
ends the process with exit status 1, so the launcher stops the job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

__all__ = ["WaitWatchdog"]


class WaitWatchdog:
    """Watches the waits entered through :meth:`watching`; ``describe(name)`` words the error for a wait too long."""

    def __init__(self, timeout_s: float, describe: Callable[[str], str], interval_s: float = 1.0) -> None:
        self._timeout = timeout_s
        self._describe = describe
        self._interval = interval_s
        self._waits: dict[int, tuple[str, float]] = {}  # thread id -> (collective, when its wait began)
        self._thread = threading.Thread(target=self._run, name="spdkfac-wait-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, collective: str) -> Iterator[None]:
        key = threading.get_ident()
        self._waits[key] = (collective, time.monotonic())
        try:
            yield
        finally:
            self._waits.pop(key, None)

    def overdue(self) -> str | None:
        """The collective whose wait has lasted longer than the timeout, if any."""
        now = time.monotonic()
        return next((name for name, began in list(self._waits.values()) if now - began > self._timeout), None)

    def _run(self) -> None:
        while True:
            time.sleep(self._interval)
            collective = self.overdue()
            if collective is not None:
                message = self._describe(collective)
                print(
                    f"CollectiveTimeoutError: {message} (ending this worker: the wait cannot be interrupted)", file=sys.stderr, flush=True
                )
                os._exit(1)
