"""The training application: ``python -m spdkfac.train`` swaps SGD for SPD-KFAC in a data-parallel run.

``job`` (the loop and :func:`main`), ``args`` (the command line), ``run``
(run directories, resuming, the CSV log), ``startup`` (checks one rank makes
and every rank acts on), ``checkpoint``, ``run_dir``, ``data`` and
``imagefolder``. The optimizer never imports this package.
"""

from .job import main

__all__ = ["main"]
