import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message="no perf_model given")

# The fast loop (`pytest -m "not multiprocess"`) spreads its tests over the machine's
# cores with pytest-xdist when it is installed (scripts/setup.sh installs it); `-n 0`
# runs it in one process. A run that starts worker processes (the whole suite, CI)
# stays in one process: those tests start and time their own workers. Each xdist
# worker gets its share of the cores for torch's own threads: the tests' tensors are
# small, and on two cores two workers of two threads each took 112 s against one
# process's 121 s, of one thread each 64 s.
XDIST_WORKERS_ENV = "PYTEST_XDIST_WORKER_COUNT"
if os.environ.get(XDIST_WORKERS_ENV):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, _cores // int(os.environ[XDIST_WORKERS_ENV])))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run `-m "not multiprocess"` on every core (as `-n auto`) unless `-n` was given."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    markexpr = config.getoption("markexpr", "") or ""
    leaves_them_out = "not multiprocess" in markexpr and "multiprocess" not in markexpr.replace("not multiprocess", "")
    if not leaves_them_out or config.getoption("numprocesses", None) is not None:
        return
    if config.getoption("collectonly", False) or config.getoption("usepdb", False):
        return
    config.option.numprocesses = "auto"


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# The fast loop is `pytest -m "not multiprocess"`: tests marked `slow` (one process,
# but seconds each: large models, subprocess CLIs, the type checker) run only when
# asked for, as scripts/test.sh (CI) does. A skipped slow test shows as `s`, never
# silently.
RUN_SLOW_ENV = "SPDKFAC_RUN_SLOW"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help=f"also run tests marked slow (scripts/test.sh sets {RUN_SLOW_ENV}=1, which does the same)",
    )


def _run_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--run-slow")) or os.environ.get(RUN_SLOW_ENV) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _run_slow(config):
        return
    skip_slow = pytest.mark.skip(reason=f"slow: run with --run-slow or {RUN_SLOW_ENV}=1 (scripts/test.sh does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture
def process_group(tmp_path) -> Iterator[None]:
    """A one-process gloo group for DDP, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
