"""The distributed K-FAC step: its stages in the order :class:`~spdkfac.step.kfac_step.KFACStep` runs them.

``factor_hooks`` (factors computed in the passes) → ``factor_allreduce``
(fused, pipelined all-reduces; ``factor_profiler`` times them for the fusion
plan) → ``decomposition_stage`` (each rank's decompositions, broadcast) →
``preconditioning`` (KL-clipped updates); beside them ``grad_sync`` (the
gradient all-reduces), ``nonfinite`` (skipping a bad step on every rank) and
``timeline`` (the per-iteration record).
"""
