"""Which workers still run: one heartbeat counter per rank in the rendezvous store.

A collective that times out only says that some peer did not answer. Each
worker bumps its own counter every ``interval_s`` from a daemon thread; after a
timeout, the counters that stay still for a few intervals are the workers that
stopped (a frozen or killed process, an unreachable host). A worker that is
alive but stuck elsewhere keeps counting, so it is not blamed.
"""

from __future__ import annotations

import atexit
import threading
import time

from torch.distributed.distributed_c10d import Store

__all__ = ["Liveness"]

#: Intervals a counter must stay still for its worker to count as stopped.
_STILL_INTERVALS = 3


class Liveness:
    """Heartbeats of ``size`` workers through ``store`` (shared by them all, e.g. torchrun's)."""

    def __init__(self, store: Store, rank: int, size: int, interval_s: float = 1.0) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"spdkfac-liveness-{rank}", daemon=True)

    def _key(self, rank: int) -> str:
        return f"spdkfac/liveness/{rank}"

    def _beat(self) -> None:
        try:
            while True:
                self._store.add(self._key(self._rank), 1)
                if self._stop.wait(self._interval):
                    return
        except Exception:  # the store is gone (the job is ending): nothing left to report to
            return

    def start(self) -> None:
        """Start beating; the beats stop at interpreter exit, before finalisation.

        A daemon thread still running at finalisation is ended where it next
        takes the GIL: inside the store's C++ call, that unwinds through
        frames that cannot be unwound and the process aborts ("terminate
        called without an active exception") after all its work is done.
        """
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._interval + 1)

    def silent_ranks(self) -> list[int] | None:
        """The other ranks whose counters did not move for a few intervals; None if the store did not answer in time.

        Blocks for about ``3 * interval_s``. The store is read from a helper
        thread: a store hosted by a frozen worker would never answer.
        """
        others = [r for r in range(self._size) if r != self._rank]
        found: list[list[int]] = []

        def probe() -> None:
            try:
                before = [self._store.add(self._key(r), 0) for r in others]
                time.sleep(_STILL_INTERVALS * self._interval)
                after = [self._store.add(self._key(r), 0) for r in others]
            except Exception:  # the store failed: nothing can be told
                return
            found.append([r for r, b, a in zip(others, before, after) if a == b])

        helper = threading.Thread(target=probe, name="spdkfac-liveness-probe", daemon=True)
        helper.start()
        helper.join(timeout=(_STILL_INTERVALS + 2) * self._interval + 5)
        return found[0] if found else None
