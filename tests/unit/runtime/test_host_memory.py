"""retain_freed_memory: freed CPU tensors are reused instead of being faulted in again (in a fresh process each)."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc-only allocator setting")

# Activation-like churn: several large tensors of mixed sizes allocated, used and freed, round after round.
CHURN = """
import json, torch
from spdkfac.runtime.host_memory import minor_page_faults, retain_freed_memory
applied = retain_freed_memory()
faults = []
for _ in range(10):
    f0 = minor_page_faults()
    blocks = [torch.ones(n * 2**18) for n in (40, 64, 24, 100, 8)]
    del blocks
    faults.append(minor_page_faults() - f0)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES_PER_ROUND = (40 + 64 + 24 + 100 + 8) * 2**20 // 4096


def _churn(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHURN], env={**os.environ, **env}, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_retained_memory_is_reused_without_page_faults():
    result = _churn(SPDKFAC_RETAIN_MEMORY="1")
    assert result["applied"] is True
    # The first round grows the heap. Later rounds reuse it; fragmentation now and then places one block
    # (8-24 MB) past the heap's top, so a round may fault that much, but on average they fault almost nothing.
    later = result["faults"][1:]
    assert sum(later) / len(later) < PAGES_PER_ROUND * 0.05


@pytest.mark.slow
def test_default_allocator_faults_every_round_and_the_switch_turns_it_off():
    result = _churn(SPDKFAC_RETAIN_MEMORY="0")
    assert result["applied"] is False
    # Blocks above glibc's mmap threshold are mapped afresh each round: most pages fault again.
    assert min(result["faults"][-2:]) > PAGES_PER_ROUND // 2


RELEASE = """
import json, torch
from spdkfac.runtime.host_memory import release_freed_memory, retain_freed_memory
def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20
retain_freed_memory()
base = rss_mb()
blocks = [torch.ones(n * 2**18) for n in (40, 64, 24, 100, 8)]
del blocks
kept = rss_mb()
released = release_freed_memory()
print(json.dumps({"base": base, "kept": kept, "after": rss_mb(), "released": released}))
"""


@pytest.mark.slow
def test_release_gives_retained_memory_back():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["released"] is True
    assert r["kept"] - r["base"] > 200  # 236 MB freed but kept by the process
    assert r["after"] - r["base"] < 50  # ... and returned by release_freed_memory
