"""For scripts/check_oldest.sh only: the tests use Python 3.10's ``zip(strict=)``; on 3.9 this adds it.

The package itself keeps to 3.9 (tests/test_oldest_versions.py); the test
suite's own floor is the Python that CI's torch needs.
"""

import builtins
import sys

if sys.version_info < (3, 10):
    _zip = builtins.zip

    def _zip_strict(*iterables, strict=False):
        if not strict:
            return _zip(*iterables)
        lists = [list(it) for it in iterables]
        if len({len(it) for it in lists}) > 1:
            raise ValueError("zip() arguments have different lengths")
        return _zip(*lists)

    builtins.zip = _zip_strict
