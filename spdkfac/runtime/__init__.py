"""What the project's command lines do to their process: core binding, freed memory kept, output paths checked up front.

Shared by ``python -m spdkfac.train``, ``python -m spdkfac.perfmodels``,
``python -m spdkfac.simulate`` and the benchmarks; nothing here knows K-FAC.
"""
