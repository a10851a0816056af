"""agree_on_thread_count(): nothing changes where the workers agree, or K-FAC computes off the CPU. Workers that
disagree (real processes): tests/multiprocess/test_thread_count_multiprocess.py."""

from __future__ import annotations

import torch

from spdkfac.comm import get_backend, run_ranks
from spdkfac.step.thread_count import agree_on_thread_count


def test_workers_that_agree_keep_their_count_and_hear_nothing():
    before = torch.get_num_threads()
    said = run_ranks(2, lambda backend: agree_on_thread_count(backend, on_cpu=True))
    assert said == [None, None]
    assert torch.get_num_threads() == before


def test_one_worker_or_off_the_cpu_sends_nothing():
    assert agree_on_thread_count(get_backend("single"), on_cpu=True) is None
    assert run_ranks(2, lambda backend: agree_on_thread_count(backend, on_cpu=False)) == [None, None]
