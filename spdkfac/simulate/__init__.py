"""Predict iteration time and its breakdown at any worker count (D-KFAC, MPD-KFAC, SPD-KFAC, ...).

Two steps::

    python -m spdkfac.simulate profile --model resnet50 --resolution 32 --batch-size 4 --out profile.json
    python -m spdkfac.simulate predict --profile profile.json --perf-model perfmodels/x.json --workers 2 4 8 64

``profile`` measures one worker (launch it with the job's launcher so that all
workers profile at once and share the machine as in training): forward and backward time, when each
factor becomes ready and how long it took, gradient sizes, and the time of the
rest of ``step()``. ``predict`` replays the decisions the optimizer makes, with
the optimizer's own functions (:mod:`spdkfac.plan.work_plan`): factor groups from
:func:`~spdkfac.plan.work_plan.fusion_groups` (launched when their last member is
ready, or after backward without pipelining), gradient all-reduces launched as
each layer's backward finishes, one communication engine serving launches in
order with ``t(m) = alpha + beta*m`` (:func:`spdkfac.plan.factor_fusion.serve_in_order`),
then the inversion stage's makespan from :class:`~spdkfac.plan.work_plan.WorkPlan`
(planned with the fitted inversion model, as the optimizer plans; charged at
the ratio of the profile's measured inversions to that model), with each rank's
packing work (the profile's per-factor unpack and pack times). On steps that
keep the inverses, variants with ``overlap_preconditioning`` hide up to their
preconditioning time of the gradient wait, and on such steps that update the
factors what remains of it hides the factor wait too. Variants may carry changes
(``'spdkfac:overlap_preconditioning=false'``, see :func:`spdkfac.variants.variant_config`).

Under a launcher every rank profiles at once; the profile holds the mean
rank's times, each rank's totals and how far each iteration's slowest rank
lagged the mean, and every synchronized step waits for the slowest rank:
that measured excess, scaled to P workers by the expected maximum of P
normal draws (:func:`~.prediction.iteration_lag_share`), is charged as
GradComm (and as InverseComm for the stage's broadcasts). The
breakdown is the mean rank's, as the optimizer's timeline and the
``iteration_time`` benchmark record it.

Scaling to P workers: the fitted file holds costs at its own world size W.
All-reduce costs are scaled by the ring factor ``(P-1)/P`` relative to W's
(alpha by ``(P-1)/(W-1)``), broadcasts by ``ceil(log2 P)/ceil(log2 W)`` (a
tree). ``--contention`` models machines where communication needs the same
cores as computation (CPU workers with no spare core): every second the
engine works is a second of the worker's core, paid once. What the engine
serves while the passes run slows forward+backward (the hooks and the
factor work in them alike), what is left after them is waited for, and
receiving a broadcast costs the receiver as much as sending costs the sender;
each all-reduce costs what the profile's plain-SGD passes measured their real
all-reduces to cost over the fitted model
(:func:`~.prediction.communication_scale`).

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
