"""The profile file: what ``simulate profile`` measured, typed and versioned.

A profile is a :class:`Profile`; files carry ``format_version``
(:data:`FORMAT_VERSION`). Files written before versioning are read by
:func:`upgrade_unversioned`, the one place that knows their older shapes;
a version newer than this code is refused rather than half-read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..kfac.factor_shape import FactorShape
from ..perfmodels.file_version import check_format_version
from .profile_check import check_profile

__all__ = [
    "FORMAT_VERSION",
    "PROFILE_FIELDS",
    "FactorProfile",
    "LayerPreconditionProfile",
    "Profile",
    "average_profiles",
    "load_profiles",
    "profile_from_dict",
    "upgrade_unversioned",
]

#: The version ``measure_profile`` writes; 1 is the first versioned format, 2 adds the per-rank totals
#: (``rank_passes``, ``rank_inversions``, ``rank_sgd``; a version-1 file reads with none), 3 the parts of a pass and
#: of ``step()`` charged apart (``hooks``, ``precondition_step``, ``update``, ``sgd_update``) and the plain-SGD passes without
#: communication (``sgd_forward_backward_local``), 4 the ranks' spread iteration by iteration (``iteration_lag_passes``,
#: ``iteration_lag_sgd``); older files read with none.
FORMAT_VERSION = 4

#: What predict needs of every profile file, whatever its version (``measure_profile`` writes them).
PROFILE_FIELDS = ("forward", "backward", "step_other", "factors")


@dataclass(frozen=True)
class FactorProfile:
    """One Kronecker factor as profiled (seconds; ``ready`` from the start of its pass).

    ``unpack``/``pack`` are the packed running average's conversions (zero
    in profiles from before they were timed, see :attr:`Profile.untimed_unpack`);
    ``invert`` is None where the profile did not time the inversion, which is
    then charged at the fitted model.
    """

    kind: str  # 'A' (ready during forward) or 'G' (ready during backward)
    layer: str
    dim: int
    ready: float
    compute: float
    grad_numel: int  # elements of the layer's gradients (G factors; 0 for A)
    unpack: float = 0.0
    pack: float = 0.0
    invert: float | None = None
    blocks: int = 1  # a grouped convolution's factors: one dim x dim block per group
    diagonal: bool = False  # an embedding's A factor: a vector

    @property
    def key(self) -> tuple[str, str]:
        """The placement key of this factor, as the optimizer names it."""
        return (self.kind, self.layer)

    @property
    def shape(self) -> FactorShape:
        """The factor's shape (dense, block-diagonal or diagonal), as the optimizer's layer has it."""
        return FactorShape(self.dim, self.blocks, self.diagonal)


@dataclass(frozen=True)
class LayerPreconditionProfile:
    """Seconds one ``precondition()`` of a layer took, with its shape (for distributed preconditioning)."""

    layer: str
    seconds: float
    a_dim: int
    g_dim: int
    blocks: int = 1  # a grouped convolution's gradient is blocks x g_dim x a_dim


@dataclass(frozen=True)
class Profile:
    """A per-layer compute profile of one worker (see :func:`spdkfac.simulate.measure_profile`).

    Times are seconds per iteration. ``sgd_*`` are the plain-SGD passes
    (``sgd_grad_wait`` is 0 where older profiles held that wait inside
    ``sgd_step``); ``comm_workers`` is how many workers those passes
    all-reduced across. ``untimed_unpack`` is unpacking that older profiles
    measured only in total: every rank pays it on an inverse step (0 when
    the factors carry their own conversion times).

    Under a launcher every rank profiles at once; the times are the mean
    over the ranks, and ``rank_passes`` / ``rank_inversions`` / ``rank_sgd``
    hold each rank's own total (in rank order) of the K-FAC pass work
    (forward + backward + ``step_other``), of inverting every factor, and of
    the plain-SGD pass work (forward + backward + update): how far the
    slowest rank lags the mean, which every synchronized step waits for
    (empty in single-process profiles and in version-1 files).

    Parts timed inside those (None in files before version 3): ``hooks``,
    the factor hooks' own work in a factor pass beyond computing the factors
    (inside ``forward`` + ``backward``); ``precondition_step`` and ``update``,
    the preconditioning and the base update inside ``step_other``;
    ``sgd_update``, the update inside ``sgd_step``; ``sgd_forward_backward_local``,
    the plain-SGD passes without communication (every rank at once), the base
    of the slowdown communication causes (= ``sgd_forward_backward`` in a
    single-process profile).

    ``iteration_lag_passes`` / ``iteration_lag_sgd`` (version 4; None before,
    and in single-process profiles): how far the slowest rank's work lags the
    ranks' mean *in the same iteration*, averaged over the iterations, as a
    share of the mean work (K-FAC passes with ``step()``; plain-SGD passes with
    the update). The per-rank totals above average the iterations first, so
    they keep only a persistent difference between the ranks; a step that
    synchronizes every iteration waits for each iteration's slowest rank.
    """

    forward: float
    backward: float
    step_other: float
    other_grad_numel: int  # gradient elements outside the preconditioned layers (all-reduced last)
    factors: tuple[FactorProfile, ...]
    precondition: tuple[LayerPreconditionProfile, ...] = ()
    sgd_step: float | None = None
    sgd_grad_wait: float = 0.0
    sgd_forward_backward: float | None = None
    comm_workers: int = 1
    engine_warmed: bool = False
    unpack: float = 0.0  # the factors' unpack times in total (as measured)
    untimed_unpack: float = 0.0
    model: str | None = None
    resolution: int | None = None
    batch_size: int | None = None
    threads: int | None = None
    concurrent_workers: int | None = None
    retained_freed_memory: bool | None = None
    bound_cores: tuple[int, ...] | None = None
    averaged_from: int | None = None
    rank_passes: tuple[float, ...] = ()
    rank_inversions: tuple[float, ...] = ()
    rank_sgd: tuple[float, ...] = ()
    hooks: float | None = None
    precondition_step: float | None = None
    update: float | None = None
    sgd_update: float | None = None
    sgd_forward_backward_local: float | None = None
    iteration_lag_passes: float | None = None
    iteration_lag_sgd: float | None = None
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object (current version)."""
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)


def _check_times(raw: Mapping[str, Any], source: str) -> None:
    """The checks every version passes: the fields predict needs, as non-negative times and a factor list."""
    missing = [key for key in PROFILE_FIELDS if key not in raw]
    if missing:
        raise ValueError(f"profile {source} lacks the field(s) {missing}; write it with `python -m spdkfac.simulate profile`")
    bad = [key for key in ("forward", "backward", "step_other") if not isinstance(raw[key], (int, float)) or raw[key] < 0]
    if bad or not isinstance(raw["factors"], list) or not raw["factors"]:
        raise ValueError(f"profile {source}: field(s) {bad or ['factors']} must be non-negative times / a non-empty list")
    required = [f.name for f in dataclasses.fields(FactorProfile) if f.default is dataclasses.MISSING]
    for i, factor in enumerate(raw["factors"]):
        if not isinstance(factor, Mapping):
            raise ValueError(f"profile {source}: field factors[{i}] must be an object ({', '.join(required)}), got {factor!r}")
        missing = [name for name in required if name not in factor]
        if missing:
            raise ValueError(f"profile {source}: field factors[{i}] lacks {missing}; write it with `python -m spdkfac.simulate profile`")


def _precondition(entries: Sequence[Mapping[str, Any]]) -> tuple[LayerPreconditionProfile, ...]:
    return tuple(LayerPreconditionProfile(p["layer"], p["seconds"], p["a_dim"], p["g_dim"], p.get("blocks", 1)) for p in entries)


def _optional_tuple(values: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


#: Fields each versioned format added (a file of an older version must not hold them).
ADDED_IN = {
    "rank_passes": 2,
    "rank_inversions": 2,
    "rank_sgd": 2,
    "hooks": 3,
    "precondition_step": 3,
    "update": 3,
    "sgd_update": 3,
    "sgd_forward_backward_local": 3,
    "iteration_lag_passes": 4,
    "iteration_lag_sgd": 4,
}
_RANK_TOTALS = ("rank_passes", "rank_inversions", "rank_sgd")


def _parse_versioned(raw: Mapping[str, Any], source: str, version: int) -> Profile:
    """A versioned file (1 to 4): every field by name, nothing guessed; version 1 has no per-rank totals, versions
    before 3 no times of the hooks, preconditioning and update, before 4 no per-iteration spread of the ranks."""
    _check_times(raw, source)
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(k for k in set(raw) if k not in known or ADDED_IN.get(k, 1) > version)
    if unknown:
        raise ValueError(f"profile {source} (format_version {version}) has unknown field(s) {unknown}")
    try:
        fields = dict(raw)
        fields["factors"] = tuple(FactorProfile(**f) for f in raw["factors"])
        fields["precondition"] = _precondition(raw.get("precondition", ()))
        fields["bound_cores"] = _optional_tuple(raw.get("bound_cores"))
        for key in _RANK_TOTALS:
            fields[key] = tuple(raw.get(key) or ())
        fields["format_version"] = FORMAT_VERSION  # read into the current shape
        return Profile(**fields)
    except (TypeError, KeyError) as exc:
        raise ValueError(f"profile {source} (format_version {version}) is malformed: {exc}") from None


def upgrade_unversioned(raw: Mapping[str, Any], source: str = "<profile>") -> Profile:
    """THE UPGRADE of a profile written before ``format_version`` existed (any of its older shapes).

    Fills what older files lack as predict always treated them:

    * no per-factor ``unpack``/``pack`` (or only some factors have them): the
      factors' conversions are 0 and the file's total ``unpack`` (0 if
      absent) is charged to every rank (``untimed_unpack``);
    * no per-factor ``invert`` (or only some): no inversion is marked as
      timed, so all are charged at the fitted model;
    * no ``precondition``: no per-layer times (none hidden by overlapping;
      distributed preconditioning cannot be predicted);
    * no ``sgd_grad_wait``: 0 (the wait is inside ``sgd_step``);
      no ``comm_workers``: 1; no ``engine_warmed``: False.

    ``pack_unpack`` (an early total of both conversions) was never charged and is dropped.
    """
    _check_times(raw, source)
    facs = raw["factors"]
    timed_conversions = all("unpack" in f and "pack" in f for f in facs)
    timed_inversions = all("invert" in f for f in facs)
    try:
        factors = tuple(
            FactorProfile(
                kind=f["kind"],
                layer=f["layer"],
                dim=f["dim"],
                ready=f["ready"],
                compute=f["compute"],
                grad_numel=f["grad_numel"],
                unpack=f["unpack"] if timed_conversions else 0.0,
                pack=f["pack"] if timed_conversions else 0.0,
                invert=f["invert"] if timed_inversions else None,
            )
            for f in facs
        )
        return Profile(
            forward=raw["forward"],
            backward=raw["backward"],
            step_other=raw["step_other"],
            other_grad_numel=raw["other_grad_numel"],
            factors=factors,
            precondition=_precondition(raw.get("precondition") or ()),
            sgd_step=raw.get("sgd_step"),
            sgd_grad_wait=raw.get("sgd_grad_wait", 0.0),
            sgd_forward_backward=raw.get("sgd_forward_backward"),
            comm_workers=raw.get("comm_workers", 1),
            engine_warmed=raw.get("engine_warmed", False),
            unpack=raw.get("unpack", 0.0),
            untimed_unpack=0.0 if timed_conversions else raw.get("unpack", 0.0),
            model=raw.get("model"),
            resolution=raw.get("resolution"),
            batch_size=raw.get("batch_size"),
            threads=raw.get("threads"),
            concurrent_workers=raw.get("concurrent_workers"),
            retained_freed_memory=raw.get("retained_freed_memory"),
            bound_cores=_optional_tuple(raw.get("bound_cores")),
            averaged_from=raw.get("averaged_from"),
        )
    except KeyError as exc:
        raise ValueError(f"profile {source} lacks the field {exc}; write it with `python -m spdkfac.simulate profile`") from None
    except TypeError as exc:  # a factor or precondition entry that is not an object
        raise ValueError(f"profile {source} is malformed: {exc}") from None


def profile_from_dict(raw: Any, source: str = "<profile>") -> Profile:
    """A profile from a file's JSON object, whatever version this code can read, every value checked (:func:`check_profile`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"profile {source} lacks the field(s) {list(PROFILE_FIELDS)}; write it with `python -m spdkfac.simulate profile`")
    if "format_version" not in raw:
        profile = upgrade_unversioned(raw, source)
    else:
        version = check_format_version(
            raw["format_version"], FORMAT_VERSION, "profile", source, "re-profile with `python -m spdkfac.simulate profile`"
        )
        profile = _parse_versioned(raw, source, version)
    check_profile(profile, source)  # finite times, positive dimensions: a bad value fails here, not in predict
    return profile


def load_profiles(paths: Sequence[str]) -> Profile:
    """Read one or more profile JSON files; several are averaged (:func:`average_profiles`)."""
    profiles: list[Profile] = []
    for path in paths:
        try:
            with open(path) as fh:
                raw = json.load(fh)
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not valid JSON ({exc})") from None
        profiles.append(profile_from_dict(raw, path))
    return profiles[0] if len(profiles) == 1 else average_profiles(profiles)


_WORKLOAD = ("model", "resolution", "batch_size", "threads", "comm_workers")


def _mean(values: Sequence[float | None], first: float | None) -> float | None:
    """The mean, or ``first`` as it was when some profile lacks the value."""
    if any(v is None for v in values):
        return first
    return sum(v for v in values if v is not None) / len(values)


def average_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile whose times are the means of several profiles of the same workload.

    Profiles taken before and after a measurement bracket it: on a machine
    whose speed drifts, their mean describes the measured window better than
    either alone.
    """
    if not profiles:
        raise ValueError("no profile to average")
    first = profiles[0]
    for other in profiles[1:]:
        differ = [k for k in _WORKLOAD if getattr(other, k) != getattr(first, k)]
        if differ:
            raise ValueError(f"profiles of different workloads cannot be averaged (they differ in {', '.join(differ)})")
        if [f.key for f in other.factors] != [f.key for f in first.factors]:
            raise ValueError("profiles with different factors (another model graph) cannot be averaged")
    n = len(profiles)

    def mean(key: str) -> Any:
        return _mean([getattr(p, key) for p in profiles], getattr(first, key))

    factors = []
    for i, fac in enumerate(first.factors):
        column = [p.factors[i] for p in profiles]
        factors.append(
            dataclasses.replace(
                fac,
                ready=sum(f.ready for f in column) / n,
                compute=sum(f.compute for f in column) / n,
                unpack=sum(f.unpack for f in column) / n,
                pack=sum(f.pack for f in column) / n,
                invert=_mean([f.invert for f in column], None),
            )
        )
    precondition: tuple[LayerPreconditionProfile, ...] = ()
    if all(p.precondition for p in profiles):
        precondition = tuple(
            dataclasses.replace(entry, seconds=sum(p.precondition[i].seconds for p in profiles) / n)
            for i, entry in enumerate(first.precondition)
        )
    return dataclasses.replace(
        first,
        forward=mean("forward"),
        backward=mean("backward"),
        step_other=mean("step_other"),
        sgd_step=mean("sgd_step"),
        sgd_grad_wait=mean("sgd_grad_wait"),
        sgd_forward_backward=mean("sgd_forward_backward"),
        hooks=mean("hooks"),
        precondition_step=mean("precondition_step"),
        update=mean("update"),
        sgd_update=mean("sgd_update"),
        sgd_forward_backward_local=mean("sgd_forward_backward_local"),
        iteration_lag_passes=mean("iteration_lag_passes"),
        iteration_lag_sgd=mean("iteration_lag_sgd"),
        unpack=mean("unpack"),
        untimed_unpack=mean("untimed_unpack"),
        factors=tuple(factors),
        precondition=precondition,
        averaged_from=n,
        format_version=FORMAT_VERSION,
        rank_passes=_mean_totals([p.rank_passes for p in profiles]),
        rank_inversions=_mean_totals([p.rank_inversions for p in profiles]),
        rank_sgd=_mean_totals([p.rank_sgd for p in profiles]),
    )


def _mean_totals(columns: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    """Per-rank totals averaged rank by rank (none unless every profile has them for the same ranks)."""
    if not columns or any(len(c) != len(columns[0]) or not c for c in columns):
        return ()
    return tuple(sum(values) / len(columns) for values in zip(*columns))
