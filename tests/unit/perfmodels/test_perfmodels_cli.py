"""``python -m spdkfac.perfmodels`` as real processes: one worker, horovodrun, torchrun and mpirun (mpi4py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from launch import ROOT, run_workers, worker_env

from spdkfac.perfmodels import PerfModel

TIMEOUT_S = 180
# Tiny points: the tests check the plumbing (launch, measure, fit, write), not the numbers.
TINY = ["--quick", "--repeats", "3", "--warmup", "1", "--threads", "1", "--sizes", "256", "4096", "16384", "--dims", "16", "32", "64"]


def _env() -> dict:
    return worker_env()


def _cli(*args: str, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``python -m spdkfac.perfmodels ARGS`` in one process."""
    return subprocess.run(
        [sys.executable, "-m", "spdkfac.perfmodels", *args],
        cwd=ROOT,
        env=_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _check_two_workers(path, engine: str) -> PerfModel:
    model = PerfModel.load(path)
    assert model.meta["world_size"] == 2, model.meta
    assert model.meta["engine"] == engine, model.meta
    for kind in (model.allreduce, model.broadcast):
        assert kind.alpha > 0
        assert kind.beta > 0
    ar, bc = model.measurements["allreduce"], model.measurements["broadcast"]
    assert ar["elements"] == [256, 4096, 16384]
    assert bc["dims"] == [16, 32, 64]
    assert all(t > 0 for t in ar["seconds"] + bc["seconds"] + model.measurements["inverse"]["seconds"])
    return model


@pytest.mark.slow
def test_single_process_benchmark_show_plot(tmp_path):
    out = tmp_path / "m.json"
    proc = _cli(
        "benchmark",
        "--engine",
        "single",
        "--quick",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--dims",
        "32",
        "64",
        "96",
        "128",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}" in proc.stdout
    model = PerfModel.load(out)
    assert model.measurements["inverse"]["dims"] == [32, 64, 96, 128]
    assert len(model.measurements["inverse"]["seconds"]) == 4
    assert model.meta["world_size"] == 1
    assert model.meta["engine"] == "single"
    assert "note" in model.fit_quality  # single worker: default communication models

    shown = _cli("show", str(out))
    assert shown.returncode == 0, shown.stderr
    assert model.measurements["eigen"]["dims"] == [32, 64, 96, 128]
    assert model.eigen is not None
    for needle in (
        "all-reduce  t(m) =",
        "broadcast   t(d) =",
        "inverse     t(d) =",
        "eigen       t(d) =",
        '"world_size": 1',
        f"{model.allreduce.alpha:.3e}",
    ):
        assert needle in shown.stdout, shown.stdout

    png = tmp_path / "m.png"
    plotted = _cli("plot", str(out), "--out", str(png))
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda d: d.pop("broadcast"), "missing field(s) ['broadcast']"),
        (lambda d: d["allreduce"].update(alpha=-1.0), "allreduce.alpha must be positive"),
        (None, "not valid JSON"),
    ],
)
@pytest.mark.slow
def test_show_rejects_malformed_file(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    if content is None:
        bad.write_text("{not json")
    else:
        data = PerfModel.default().to_dict()
        content(data)
        bad.write_text(json.dumps(data))
    proc = _cli("show", str(bad))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error:" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert str(bad) in proc.stderr, proc.stderr


@pytest.mark.parametrize(("flag", "values"), [("--dims", ["64"]), ("--dims", ["64", "64"]), ("--sizes", ["1024"]), ("--dims", ["0", "64"])])
@pytest.mark.slow
def test_benchmark_rejects_too_few_points_before_measuring(tmp_path, flag, values):
    out = tmp_path / "m.json"
    proc = _cli("benchmark", "--engine", "single", "--repeats", "1", "--warmup", "0", flag, *values, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert f"{flag} needs at least two distinct positive values" in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.multiprocess
def test_benchmark_under_horovodrun(tmp_path):
    out = tmp_path / "hvd.json"
    run_workers("horovod", 2, ["-m", "spdkfac.perfmodels", "benchmark", *TINY, "--bind-cores", "--out", str(out)], timeout=TIMEOUT_S)
    _check_two_workers(out, "horovod")
    bound = json.loads(out.read_text())["meta"]["bound_cores"]  # rank 0's block of the cores, as a bound run's
    available = sorted(os.sched_getaffinity(0))
    assert bound, bound
    assert set(bound) <= set(available), bound
    assert bound[0] == available[0], bound


@pytest.mark.multiprocess
def test_benchmark_under_torchrun(tmp_path):
    out = tmp_path / "torch.json"
    run_workers("torch", 2, ["-m", "spdkfac.perfmodels", "benchmark", "--engine", "torch", *TINY, "--out", str(out)], timeout=TIMEOUT_S)
    _check_two_workers(out, "torch")
    assert json.loads(out.read_text())["meta"]["bound_cores"] is None  # not asked to bind


def _mpirun() -> str:
    """The ``mpirun`` to use, or skip (CI installs neither MPI nor mpi4py: see scripts/setup.sh --with-mpi)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not on PATH (install Open MPI, e.g. bash scripts/setup.sh --with-mpi)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py not installed in this Python (bash scripts/setup.sh --with-mpi)")
    return mpirun


@pytest.mark.multiprocess
def test_benchmark_under_mpirun_mpi4py(tmp_path):
    mpirun = _mpirun()
    version = subprocess.run([mpirun, "--version"], check=False, capture_output=True, text=True).stdout
    # Open MPI refuses root without --allow-run-as-root, and counts slots strictly; -x exports the environment.
    extra = ["--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"] if "Open MPI" in version else []
    out, png = tmp_path / "mpi.json", tmp_path / "mpi.png"
    cmd = [
        mpirun,
        *extra,
        "-np",
        "2",
        sys.executable,
        "-m",
        "spdkfac.perfmodels",
        "benchmark",
        "--engine",
        "mpi4py",
        *TINY,
        "--out",
        str(out),
        "--plot",
        str(png),
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(), check=False, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpirun hung for {TIMEOUT_S}s: {' '.join(cmd)}")
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-6000:]}"
    _check_two_workers(out, "mpi4py")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("where", ["missing-dir", "is-a-dir"])
@pytest.mark.slow
def test_benchmark_refuses_an_unwritable_out_before_measuring(tmp_path, where):
    out = tmp_path / "nope" / "m.json" if where == "missing-dir" else tmp_path
    proc = _cli("benchmark", "--engine", "single", "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot write {out}" in proc.stderr, proc.stderr
    assert "benchmarking" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_add_batched_measures_only_the_batched_decompositions_of_an_old_file(tmp_path):
    old = PerfModel.load(ROOT / "perfmodels" / "reference-cpu-gloo-2.json")
    assert not old.batched  # fitted before batched measurements existed
    src = tmp_path / "old.json"
    old.save(src)
    out = tmp_path / "new.json"
    proc = _cli("add-batched", str(src), "--quick", "--repeats", "1", "--warmup", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    new = PerfModel.load(out)
    assert set(new.batched) == {"inverse", "eigen"}
    assert sorted(new.batched["eigen"].measured) == sorted([(32, 9), (384, 9), (144, 25), (32, 36), (32, 144)])
    assert new.inverse == old.inverse
    assert new.allreduce == old.allreduce
    assert "batched_measured" in new.meta
    assert "batched_eigen" in new.fit_quality
    assert PerfModel.load(src).batched == {}  # --out: the source untouched
