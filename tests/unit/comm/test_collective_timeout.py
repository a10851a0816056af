"""The collective timeout in one process: the option's validation, the message, the heartbeats that name a frozen rank."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from launch import repo_pythonpath

from spdkfac.comm import DEFAULT_COLLECTIVE_TIMEOUT_S, SingleProcessBackend, check_collective_timeout, get_backend
from spdkfac.comm.errors import lost_message, timeout_message
from spdkfac.comm.liveness import Liveness
from spdkfac.comm.watchdog import WaitWatchdog
from spdkfac.train.args import parse_args
from spdkfac.train.run import RUNTIME_ARGS

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("seconds", [0.5, 10, 300.0])
def test_a_positive_number_of_seconds_is_accepted(seconds):
    assert check_collective_timeout(seconds) == float(seconds)
    assert isinstance(get_backend("single", collective_timeout=seconds), SingleProcessBackend)


@pytest.mark.parametrize("seconds", [0, -1.0, math.inf, math.nan])
def test_a_timeout_that_is_not_positive_and_finite_is_refused_with_the_option_named(seconds):
    with pytest.raises(ValueError, match="collective_timeout must be a positive, finite number of seconds"):
        check_collective_timeout(seconds)
    with pytest.raises(ValueError, match="collective_timeout"):  # refused even by an engine that never waits
        get_backend("single", collective_timeout=seconds)


@pytest.mark.parametrize("value", ["10", True, None])
def test_a_timeout_that_is_not_a_number_is_refused(value):
    with pytest.raises(TypeError, match="collective_timeout must be a number of seconds"):
        check_collective_timeout(value)


def test_an_engine_instance_is_returned_as_is_after_the_timeout_is_checked():
    engine = SingleProcessBackend()
    assert get_backend(engine, collective_timeout=5) is engine
    with pytest.raises(ValueError, match="collective_timeout"):
        get_backend(engine, collective_timeout=-5)


def test_the_training_flag_defaults_to_the_engine_default_and_is_validated(capsys):
    assert parse_args([]).collective_timeout == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert parse_args(["--collective-timeout", "12.5"]).collective_timeout == 12.5
    for bad in ("0", "-3", "inf", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--collective-timeout", bad])
        assert "--collective-timeout must be a positive number of seconds" in capsys.readouterr().err
    # A resumed run may use another timeout: it does not change what is trained.
    assert "collective_timeout" in RUNTIME_ARGS


def test_the_message_names_the_silent_ranks_or_says_what_is_known():
    named = timeout_message("kfac.factor.A.fc1", rank=0, size=4, timeout_s=10, silent=[2])
    assert named.startswith("collective 'kfac.factor.A.fc1' timed out on rank 0 after 10 s (collective_timeout): ")
    assert "rank 2 stopped answering" in named
    assert "ranks 1, 3 stopped answering" in timeout_message("x", rank=0, size=4, timeout_s=10, silent=[1, 3])
    alive = timeout_message("x", rank=1, size=4, timeout_s=10, silent=[])
    assert "every other worker is alive but one of them did not reach this collective" in alive
    assert "rank 0 did not answer" in timeout_message("x", rank=1, size=2, timeout_s=None, silent=None)
    unknown = timeout_message("x", rank=1, size=3, timeout_s=None, silent=None)
    assert "after" not in unknown  # the timeout of a group the caller made is not known
    assert "a worker among ranks 0, 2 did not answer" in unknown


def test_a_lost_worker_message_names_it_and_keeps_the_engine_s_reason():
    msg = lost_message("spdkfac.grad.fc.bias", rank=0, silent=[1], why="Horovod shut down")
    assert (
        msg
        == "collective 'spdkfac.grad.fc.bias' failed on rank 0: rank 1 stopped answering (frozen, killed or unreachable); Horovod shut down"
    )
    assert "ranks 2, 3 stopped answering" in lost_message("x", rank=0, silent=[2, 3], why="")


def test_heartbeats_name_the_worker_that_stopped_and_only_it():
    store = dist.HashStore()
    beats = [Liveness(store, rank, 3, interval_s=0.05) for rank in range(3)]
    for b in beats:
        b.start()
    try:
        assert beats[0].silent_ranks() == []
        beats[2].stop()  # as if frozen: its counter no longer moves
        assert beats[0].silent_ranks() == [2]
        assert beats[1].silent_ranks() == [2]
    finally:
        for b in beats:
            b.stop()


def test_the_watchdog_sees_a_wait_only_while_it_lasts_longer_than_the_timeout():
    # The check thread sleeps an hour here: it must not end the test process; overdue() is what it would act on.
    watchdog = WaitWatchdog(0.05, describe=lambda name: name, interval_s=3600)
    assert watchdog.overdue() is None
    with watchdog.watching("spdkfac.grad.fc.weight"):
        assert watchdog.overdue() is None  # not yet overdue
        time.sleep(0.1)
        assert watchdog.overdue() == "spdkfac.grad.fc.weight"
    assert watchdog.overdue() is None  # the wait ended


_BEATING_AT_EXIT = """
import datetime, time
from torch._C._distributed_c10d import TCPStore
from spdkfac.comm.liveness import Liveness
server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))
for rank in range(4):
    Liveness(client, rank, 4, interval_s=0.0).start()   # beat without pause: always inside the store's C++ call
time.sleep(0.05)
print("done")
"""


@pytest.mark.slow  # (a subprocess's whole start-up and exit: the whole suite's, not the fast loop's)
def test_heartbeats_stop_before_the_interpreter_finalises():
    """A heartbeat thread left inside a store call at finalisation aborted the finished process (exit 134,
    "terminate called without an active exception"): the beats stop at exit, and the process exits 0."""
    proc = subprocess.run(
        [sys.executable, "-c", _BEATING_AT_EXIT],
        check=False,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=repo_pythonpath()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "done"
