"""Horovod's elastic mode under real ``horovodrun --min-np/--max-np``: a worker lost mid-run, workers added.

The worker (``tests/workers/elastic_check.py``) trains SPDKFACOptimizer in
float64 under ``hvd.elastic.run`` with :class:`spdkfac.train.elastic.ElasticState`
on two hosts that are both this machine ('localhost' and '127.0.0.1': Horovod
blacklists the host of a failed worker). 2 workers; the one on '127.0.0.1'
exits in the middle of step 5 (after its backward pass); the survivor restores
the commit of step 4 and goes on alone; at step 9 the discovery script's file
grows 'localhost' to 3 slots and the next commit adds two workers. Checked:
the job finishes; each restart's live state equals the commit it resumed from
bit for bit (only the plan record, ``kfac.grad_workers``, follows the new size),
and that commit is the one the survivor made; fusion and placement are planned
for each new size; every replica ends bitwise equal; the parameters equal
one process on the same global batches (1e-9, float64), so no step was lost or
applied twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from launch import ROOT, discovery_script, elastic_horovod_command, require_horovod, run_launcher, worker_env

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WORKER = str(ROOT / "tests" / "workers" / "elastic_check.py")
#: What ``state_dict()`` records of the plan in force (not state): it follows the size after a re-plan.
PLAN_RECORD = {".optimizer.kfac.grad_workers.grad_workers", ".optimizer.kfac.grad_workers.workers"}


def test_a_lost_worker_and_added_workers_leave_bitwise_replicas_and_the_one_process_result(tmp_path):
    require_horovod()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    env = worker_env()
    args = ["--out", str(tmp_path), "--hosts-file", str(hosts), "--steps", "16", "--commit-every", "2"]
    args += ["--die-at", "5", "--die-host", "127.0.0.1", "--grow-at", "9", "--grow-to", "localhost:3"]
    cmd = elastic_horovod_command(hosts, 1, 3, [WORKER, *args])
    try:
        proc = run_launcher(cmd, env, timeout=240)
    except subprocess.TimeoutExpired as exc:  # (with every worker's thread stacks at the hang)
        out = f"{exc.stdout or ''}{exc.stderr or ''}"
        pytest.fail(f"elastic horovodrun hung for 240 s: {' '.join(cmd)}\n{out[-12000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    events = [json.loads(line) for path in sorted(tmp_path.glob("events-*.jsonl")) for line in path.read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    ends = [e for e in events if e["event"] == "end"]

    # The worker died, the survivor went on alone from the commit before it, then two workers joined.
    assert [e["step"] for e in events if e["event"] == "dying"] == [5], events
    survivor = next(e["pid"] for e in starts if e["host"] == "localhost" and e["size"] == 2)
    sizes = [(e["size"], e["step"]) for e in starts if e["pid"] == survivor]
    assert sizes[:2] == [(2, 0), (1, 4)], starts
    assert sizes[-1][0] == 3, starts
    assert sizes[-1][1] >= 10, starts
    assert sorted(e["rank"] for e in ends) == [0, 1, 2], ends
    assert {e["size"] for e in ends} == {3}, ends

    for e in starts:
        # Restored (or synced) state = the commit, bit for bit; only the plan record follows the new size.
        assert set(e["differences"]) <= PLAN_RECORD, e
        assert e["planned_for"] == e["size"], e  # placement and gradient workers planned at this size
        if e["differences_from_commit_made_here"] is not None:  # restored from the commit this process made
            assert set(e["differences_from_commit_made_here"]) <= PLAN_RECORD, e
    joined = [e for e in starts if e["size"] == 3]
    assert len(joined) == 3, joined
    assert len({e["commit"] for e in joined}) == 1, joined  # the added workers start from rank 0's
    assert sum(e["differences_from_commit_made_here"] is not None for e in starts) >= 2, starts  # the survivor's restores

    assert len({e["digest"] for e in ends}) == 1, ends  # bitwise replicas: model and optimizer state

    ref = subprocess.run(
        [sys.executable, WORKER, "--out", str(tmp_path), "--steps", "16", "--reference"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr
    params, reference = torch.load(tmp_path / "params.pt"), torch.load(tmp_path / "reference.pt")
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_the_launch_script_runs_the_elastic_example_and_workers_that_join_end_bitwise_equal(tmp_path):
    """scripts/launch_horovod.sh's elastic mode (MIN_NP/MAX_NP/DISCOVERY/NIC) on examples/elastic_horovod.py.

    One worker starts; the test grows the discovery file to two slots once the first epoch is done, and the
    second worker joins at a commit of the second epoch: both end with bitwise-equal parameters.
    """
    require_horovod()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    env = worker_env(
        NP="1",
        MIN_NP="1",
        MAX_NP="2",
        DISCOVERY=str(discovery_script(hosts)),
        NIC="lo",
        PYTHON=sys.executable,
        HOROVODRUN=shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]),
    )
    args = ["--epochs", "3", "--batch-size", "16", "--commit-every", "4"]
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "launch_horovod.sh"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "epoch 0:" in line and hosts.read_text() == "localhost:1\n":
                hosts.write_text("localhost:2\n")  # a worker joins at the next commit
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == 0, output[-6000:]
    assert "reset: 2 workers" in output, output[-4000:]
    done = re.findall(r"rank (\d)/(\d): done, parameters sha256 (\w+)", output)
    assert sorted(r for r, _, _ in done) == ["0", "1"], output[-4000:]
    assert {s for _, s, _ in done} == {"2"}, output[-4000:]
    assert len({d for _, _, d in done}) == 1, done  # bitwise replicas
    accuracy = [float(a) for a in re.findall(r"test accuracy ([\d.]+)", output)]
    assert len(accuracy) >= 3, output[-4000:]  # a line per epoch
    assert accuracy[-1] > 0.5, output[-4000:]
