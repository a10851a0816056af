"""Communication engines as real processes: clean shutdown of the torch.distributed engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from launch import ROOT, run_workers

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WORKER = str(ROOT / "tests" / "workers" / "exit_check.py")


def _reports(out: str) -> dict[int, tuple[str, int, float]]:
    """rank -> (group alive at exit, gloo threads at exit, exit delay), from the workers' last lines."""
    found = re.findall(r"rank (\d+): group alive at exit=(\w+) gloo threads=(\d+) exit delay=([\d.]+)s", out)
    return {int(r): (alive, int(threads), float(delay)) for r, alive, threads, delay in found}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads by their names in /proc")
def test_torch_engine_destroys_its_process_group_after_all_ranks_finish():
    """Left to interpreter shutdown, gloo groups sometimes abort a finished worker; the engine prevents that."""
    out = run_workers("torch", 3, [WORKER], timeout=120)
    reports = _reports(out)
    assert sorted(reports) == [0, 1, 2], out
    assert all(alive == "False" for alive, _, _ in reports.values()), reports
    # The group was freed, not only unregistered: its threads are gone before interpreter shutdown.
    assert all(threads == 0 for _, threads, _ in reports.values()), reports
    # Ranks 1 and 2 finished ~1.5 s before rank 0 and waited for it in the exit barrier.
    assert reports[1][2] >= 1.0, reports
    assert reports[2][2] >= 1.0, reports


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads by their names in /proc")
def test_a_group_the_script_destroys_is_freed_with_its_threads():
    """The script's own group (DDP, a torch optimizer, the preconditioner), destroyed at its end, takes gloo's threads with it.

    Fails if anything spdkfac or torch made keeps a reference to the group: its threads would then run into
    interpreter shutdown, where one taking the GIL is killed and aborts the finished worker.
    """
    out = run_workers("torch", 2, [WORKER, "--caller-group"], timeout=120)
    reports = _reports(out)
    assert sorted(reports) == [0, 1], out
    assert all(alive == "False" and threads == 0 for alive, threads, _ in reports.values()), reports


#: torch releases the GIL while it destroys a process group from its Python object from 2.8 on (pytorch#154976);
#: before, that destruction deadlocks in the same way (2.4.1: rank 1 hangs releasing the held groups).
_RELEASES_GIL = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 8)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads by their names in /proc")
@pytest.mark.skipif(not _RELEASES_GIL, reason="torch before 2.8 destroys a process group holding the GIL")
def test_a_collective_in_flight_at_exit_does_not_deadlock_the_group_s_destruction():
    """A DDP model's group freed at exit while one of its collectives is still in flight: the exit waits for the
    collective (rank 0 joins it 2 s late) and then ends, instead of deadlocking on the GIL (it hung for good when the
    garbage collector destroyed the group from the model's reducer)."""
    out = run_workers("torch", 2, [str(ROOT / "tests" / "workers" / "exit_in_flight_check.py")], timeout=60)
    found = {int(r): (int(n), float(t)) for r, n, t in re.findall(r"rank (\d+): gloo threads=(\d+) exit took=([\d.]+)s", out)}
    assert sorted(found) == [0, 1], out
    assert all(threads == 0 for threads, _ in found.values()), found
    assert found[1][1] >= 1.0, found  # rank 1's exit waited for its collective to complete
