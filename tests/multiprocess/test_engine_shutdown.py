"""Communication engines as real processes: clean shutdown of the torch.distributed engine."""

from __future__ import annotations

import re

import pytest
from launch import ROOT, run_workers

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WORKER = str(ROOT / "tests" / "workers" / "exit_check.py")


def test_torch_engine_destroys_its_process_group_after_all_ranks_finish():
    """Left to interpreter shutdown, gloo groups sometimes abort a finished worker; the engine prevents that."""
    out = run_workers("torch", 3, [WORKER], timeout=120)
    reports = {
        int(r): (alive, float(delay)) for r, alive, delay in re.findall(r"rank (\d+): group alive at exit=(\w+) exit delay=([\d.]+)s", out)
    }
    assert sorted(reports) == [0, 1, 2], out
    assert all(alive == "False" for alive, _ in reports.values()), reports
    # Ranks 1 and 2 finished ~1.5 s before rank 0 and waited for it in the exit barrier.
    assert reports[1][1] >= 1.0, reports
    assert reports[2][1] >= 1.0, reports
