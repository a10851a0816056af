"""Cluster performance models: fitting, storing, loading (and benchmarking via ``python -m``)."""

from .fitting import fit_cubic, fit_exponential, fit_inverse_model, fit_linear, r_squared
from .models import AllReduceModel, BroadcastModel, InverseModel, PerfModel, PerfModelError, load_perf_model

__all__ = [
    "AllReduceModel",
    "BroadcastModel",
    "InverseModel",
    "PerfModel",
    "PerfModelError",
    "fit_cubic",
    "fit_exponential",
    "fit_inverse_model",
    "fit_linear",
    "load_perf_model",
    "r_squared",
]
