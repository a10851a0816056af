"""The fast loop (`pytest -m "not multiprocess"`) runs on pytest-xdist workers, one share of the cores each; a run
that includes the multi-process tests (the whole suite, CI) and `-n 0` stay in one process (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from launch import ROOT

PROBE_ENV = "SPDKFAC_FAST_LOOP_PROBE"


@pytest.mark.skipif(not os.environ.get(PROBE_ENV), reason=f"run by the test below ({PROBE_ENV} names where to write)")
def test_probe_writes_where_it_ran() -> None:
    with open(os.environ[PROBE_ENV], "w") as f:
        json.dump({"worker": os.environ.get("PYTEST_XDIST_WORKER"), "threads": torch.get_num_threads()}, f)


def _probe(tmp_path, *args: str) -> dict:
    out = tmp_path / f"probe{len(list(tmp_path.iterdir()))}.json"
    env = dict(os.environ, **{PROBE_ENV: str(out)})
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        *args,
        "tests/test_fast_loop.py::test_probe_writes_where_it_ran",
    ]
    result = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed (scripts/setup.sh installs it)")
def test_the_fast_loop_runs_on_workers_and_a_run_with_the_multiprocess_tests_in_one_process(tmp_path):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fast = _probe(tmp_path, "-m", "not multiprocess")
    assert str(fast["worker"]).startswith("gw"), fast
    assert fast["threads"] >= 1
    if cores >= 2:
        assert fast["threads"] < cores, fast  # each worker a share of the cores, not all of them
    assert _probe(tmp_path)["worker"] is None  # the whole suite
    assert _probe(tmp_path, "-m", "multiprocess or not multiprocess")["worker"] is None
    assert _probe(tmp_path, "-m", "not multiprocess", "-n", "0")["worker"] is None
