"""Launch real multi-process runs (horovodrun / torchrun with gloo on CPU) from tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def repo_pythonpath() -> str:
    """``PYTHONPATH`` for a process the tests start: the repository first, then a ``PYTHONPATH`` already set
    (scripts/check_oldest.sh's shim), which it keeps."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of the workers and jobs the tests start: this one, the repository importable, one thread
    each, unbuffered output, and ``extra``."""
    return dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def horovod_available() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:
        return False
    return shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is not None


def require_horovod() -> None:
    """Skip without Horovod, unless SPDKFAC_REQUIRE_HOROVOD=1 (set by scripts/test.sh), then fail."""
    if horovod_available():
        return
    if os.environ.get("SPDKFAC_REQUIRE_HOROVOD") == "1":
        pytest.fail("Horovod is required (SPDKFAC_REQUIRE_HOROVOD=1) but horovod.torch/horovodrun is not available")
    pytest.skip("Horovod not installed (run scripts/setup.sh)")


def launcher_command(engine: str, nproc: int, script: Sequence[str]) -> list[str]:
    """The command line that starts ``script`` on ``nproc`` local workers."""
    if engine == "torch":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *script,
        ]
    if engine == "horovod":
        hvdrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        return [hvdrun, "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", sys.executable, *script]
    raise ValueError(engine)


def discovery_script(hosts: Path) -> Path:
    """A Horovod host discovery script beside ``hosts`` that prints it (``host:slots`` lines; edit the file to resize)."""
    discovery = hosts.with_name(hosts.name + ".discover.sh")
    discovery.write_text(f"#!/bin/sh\ncat '{hosts}'\n")
    discovery.chmod(0o755)
    return discovery


def elastic_horovod_command(hosts: Path, min_np: int, max_np: int, script: Sequence[str]) -> list[str]:
    """``horovodrun`` in elastic mode on this machine: the host discovery script prints ``hosts`` (edit it to add hosts).

    Every host name in the file must resolve to a local address ('localhost', '127.0.0.1'): Horovod starts workers
    on those without ssh, and blacklists a host whose worker failed, so a test that loses a worker names two hosts.
    """
    discovery = discovery_script(hosts)
    np = sum(int(line.rpartition(":")[2]) for line in hosts.read_text().split())
    hvdrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [
        str(hvdrun),
        "-np",
        str(np),
        "--min-np",
        str(min_np),
        "--max-np",
        str(max_np),
        "--host-discovery-script",
        str(discovery),
        "--network-interface",
        "lo",  # the driver and the workers on loopback: one machine
        "--gloo",
        sys.executable,
        *script,
    ]


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # (a process that ended meanwhile)
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def run_launcher(cmd: Sequence[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` of a launcher (output captured), except for a hang: then every Python worker first prints
    each of its threads' stacks (SIGABRT, with ``PYTHONFAULTHANDLER`` set) into the output of the
    ``TimeoutExpired`` raised, so that an intermittent hang in CI says where it was, and nothing the launcher started
    outlives it."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=ROOT,
        env=dict(env, PYTHONFAULTHANDLER="1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = _descendants(proc.pid)
        for pid in below:  # (the workers before the launcher, which would stop them without a word)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=20)  # (the launcher sees its workers end, reports and exits)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *below]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()  # (what was read before the timeouts is kept)
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


TRANSIENT = ("Address already in use", "EADDRINUSE", "address already in use", "Connection refused", "rendezvous")


def run_workers(engine: str, nproc: int, script: Sequence[str], timeout: int = TIMEOUT_S) -> str:
    """Run and return the combined output; a crash or hang becomes a clear test failure.

    A launch that fails at start-up for a transient reason (a port taken by
    another job between choosing and binding it, a rendezvous that did not
    form) is retried once with a new port; any other failure is reported
    at once with the workers' output.
    """
    if engine == "horovod":
        require_horovod()
    env = worker_env()
    for attempt in (1, 2):
        cmd = launcher_command(engine, nproc, script)
        try:
            proc = run_launcher(cmd, env, timeout)
        except subprocess.TimeoutExpired as exc:
            out = f"{exc.stdout or ''}{exc.stderr or ''}"  # (the workers' stacks at the hang are in stderr)
            pytest.fail(f"{engine} run with {nproc} workers hung for {timeout}s: {' '.join(cmd)}\n{out[-12000:]}")
        output = proc.stdout + proc.stderr
        if proc.returncode == 0:
            return output
        if attempt == 1 and any(t in output for t in TRANSIENT) and "Traceback" not in proc.stdout:
            print(f"transient launch failure, retrying once:\n{output[-2000:]}")
            continue
        pytest.fail(f"{engine} run with {nproc} workers failed (exit {proc.returncode}): {' '.join(cmd)}\n{output[-6000:]}")
    raise AssertionError("unreachable")


def run_rank_workers(engine: str, worker: Path, out: Path, *args: str, nproc: int = 2) -> list[Any]:
    """Run a rank-result worker (``tests/rank_results.py``'s ``save_rank_results``) on ``nproc`` workers and return
    each rank's results, in rank order."""
    run_workers(engine, nproc, [str(worker), "--backend", engine, "--out", str(out), *args])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def run_single(script: str, args: Sequence[str]) -> None:
    """Run a worker script as one process (``--backend single``): the reference the workers are compared with."""
    proc = subprocess.run([sys.executable, script, "--backend", "single", *args], cwd=ROOT, check=False, capture_output=True, text=True)
    assert proc.returncode == 0, f"single-process reference failed:\n{(proc.stdout + proc.stderr)[-6000:]}"


def assert_params_match(ref: dict, dist: dict, names: Sequence[str], rtol: float = 1e-9, atol: float = 1e-11) -> None:
    """Per config name, the workers' parameters equal the one-process reference's (float64 tolerance)."""
    import torch

    for name in names:
        for key, value in ref[name]["params"].items():
            torch.testing.assert_close(dist[name]["params"][key], value, rtol=rtol, atol=atol, msg=lambda m, k=key, n=name: f"{n}/{k}: {m}")


def worker_module(script: Path) -> ModuleType:
    """A worker script of tests/workers/ imported as a module, to run its ``run()`` in this process (the reference)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
