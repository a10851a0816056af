"""Predict iteration time and its breakdown at any worker count (D-KFAC, MPD-KFAC, SPD-KFAC, ...).

How to run it and what it models: :mod:`spdkfac.simulate.cli` (its docstring is the
command's help).

Layout: ``profile_file`` (the typed, versioned :class:`Profile`; the one
upgrade of unversioned files), ``profiling`` (measuring one), ``scaling``
(:class:`ScaledModels`), ``prediction`` (:func:`predict`: costs on top of
:mod:`spdkfac.plan.work_plan`'s decisions) and ``cli`` (this command line).
Apart from them, for update fusion on one device: ``kernel_trace`` (a step's
kernels, FLOPs and bytes, counted on meta tensors) and ``update_fusion_cost``
(iteration time with the update unfused, forward- or backward-fused).
"""

from .cli import DEFAULT_VARIANTS, main
from .prediction import PART_OF_PHASE, PARTS, PHASES, parts_of_phases, predict, predict_phases, simulated_work_plan
from .profile_file import (
    FORMAT_VERSION,
    PROFILE_FIELDS,
    FactorProfile,
    LayerPreconditionProfile,
    Profile,
    average_profiles,
    load_profiles,
    profile_from_dict,
    upgrade_unversioned,
)
from .profiling import measure_profile
from .scaling import ScaledModels

__all__ = [
    "DEFAULT_VARIANTS",
    "FORMAT_VERSION",
    "PARTS",
    "PART_OF_PHASE",
    "PHASES",
    "PROFILE_FIELDS",
    "FactorProfile",
    "LayerPreconditionProfile",
    "Profile",
    "ScaledModels",
    "average_profiles",
    "load_profiles",
    "main",
    "measure_profile",
    "parts_of_phases",
    "predict",
    "predict_phases",
    "profile_from_dict",
    "simulated_work_plan",
    "upgrade_unversioned",
]
