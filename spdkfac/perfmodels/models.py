"""Performance models of the cluster, fitted once and stored as JSON (paper Eq. 14, 26, 27).

* all-reduce of ``m`` elements:      ``t_ar(m)    = alpha_ar + beta_ar * m``
* broadcast of a ``d x d`` inverse:  ``t_bcast(d) = alpha_bc + beta_bc * d(d+1)/2``
* inversion of a ``d x d`` SPD matrix: ``t_inv(d) = alpha_inv * exp(beta_inv * d)``
  or, where that fits the measurements badly, a cubic ``c0 + c1 d + c2 d^2 + c3 d^3``;
* eigendecomposition of a ``d x d`` symmetric matrix (``compute_method='eigen'``,
  optional: files from before it lack it), the same form as the inversion;
* one batched decomposition of ``b`` blocks of ``d x d`` (a grouped
  convolution's factors), per method, optional: ``call + b (c0 + c1 d + c2 d^2 + c3 d^3)``
  (:class:`BatchedModel`; files without one use :meth:`BatchedModel.rule`
  on the single-matrix curve).

Every rank loads the same file, so every rank makes the same fusion and
placement decisions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .file_version import FormatVersionError, check_format_version

__all__ = [
    "UNCALIBRATED_WARNING",
    "AllReduceModel",
    "BatchedModel",
    "BroadcastModel",
    "InverseModel",
    "PerfModel",
    "PerfModelError",
    "load_perf_model",
]

FORMAT_VERSION = 1


class PerfModelError(ValueError):
    """A performance-model file or object is unusable; the message says why."""


def _positive_finite(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise PerfModelError(f"{name} must be a number, got {value!r}") from exc
    if not math.isfinite(v) or v <= 0:
        raise PerfModelError(f"{name} must be positive and finite, got {v!r}")
    return v


@dataclass(frozen=True)
class AllReduceModel:
    """``t(m) = alpha + beta * m`` with ``m`` in elements, times in seconds."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        _positive_finite("allreduce.alpha", self.alpha)
        _positive_finite("allreduce.beta", self.beta)

    def __call__(self, elements: float) -> float:
        return self.alpha + self.beta * elements


def _check_measured(name: str, measured: dict[int, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for d, t in (measured or {}).items():
        out[int(d)] = _positive_finite(f"{name}.measured[{d}]", t)
    return out


@dataclass(frozen=True)
class BroadcastModel:
    """``t(d) = alpha + beta * d(d+1)/2``: broadcasting the upper triangle of a ``d x d`` inverse.

    ``measured`` maps dimensions measured by the benchmark to their times;
    those are returned as they are, the fitted line serves every other ``d``.
    """

    alpha: float
    beta: float
    measured: dict[int, float] | None = None

    def __post_init__(self) -> None:
        _positive_finite("broadcast.alpha", self.alpha)
        _positive_finite("broadcast.beta", self.beta)
        object.__setattr__(self, "measured", _check_measured("broadcast", self.measured))

    def fitted(self, dim: float) -> float:
        return self.alpha + self.beta * dim * (dim + 1) / 2

    def __call__(self, dim: float) -> float:
        hit = self.measured.get(int(dim)) if self.measured and dim == int(dim) else None
        return hit if hit is not None else self.fitted(dim)

    def payload(self, elements: int) -> float:
        """Broadcast of a flat buffer of ``elements``: a measured time where it is a measured triangle's size."""
        for dim, seconds in (self.measured or {}).items():
            if dim * (dim + 1) // 2 == elements:
                return seconds
        return self.alpha + self.beta * elements


@dataclass(frozen=True)
class InverseModel:
    """Inversion time of a ``d x d`` SPD matrix.

    ``kind='exp'``: ``alpha * exp(beta * d)`` (Eq. 26); ``kind='cubic'``:
    ``sum(coeffs[k] * d^k)``, clamped below at the smallest measured time.
    ``measured`` maps measured dimensions to their times, returned as they
    are: CPU LAPACK timings jump between neighbouring sizes (blocking), which
    no smooth curve follows, so a model benchmarked at a network's own factor
    dimensions (``benchmark --model``) predicts that network exactly.
    """

    kind: str
    params: dict[str, Any]
    measured: dict[int, float] | None = None
    name: str = "inverse"  # the file's field (``'eigen'`` for the eigendecomposition model), for messages

    def __post_init__(self) -> None:
        n = self.name
        object.__setattr__(self, "measured", _check_measured(n, self.measured))
        if self.kind == "exp":
            _positive_finite(f"{n}.alpha", self.params.get("alpha"))
            _positive_finite(f"{n}.beta", self.params.get("beta"))
        elif self.kind == "cubic":
            coeffs = self.params.get("coeffs")
            if not isinstance(coeffs, (list, tuple)) or len(coeffs) != 4:
                raise PerfModelError(f"{n}.coeffs must be a list of 4 numbers (c0..c3)")
            if not all(math.isfinite(float(c)) for c in coeffs):
                raise PerfModelError(f"{n}.coeffs must be finite")
            _positive_finite(f"{n}.floor", self.params.get("floor"))
        else:
            raise PerfModelError(f"{n}.kind must be 'exp' or 'cubic', got {self.kind!r}")

    def __call__(self, dim: float) -> float:
        hit = self.measured.get(int(dim)) if self.measured and dim == int(dim) else None
        return hit if hit is not None else self.fitted(dim)

    def fitted(self, dim: float) -> float:
        """The smooth model alone (no measured table)."""
        if self.kind == "exp":
            return float(self.params["alpha"] * math.exp(self.params["beta"] * dim))
        c = self.params["coeffs"]
        value = c[0] + c[1] * dim + c[2] * dim**2 + c[3] * dim**3
        return float(max(value, self.params["floor"]))


@dataclass(frozen=True)
class BatchedModel:
    """One batched decomposition of ``blocks`` matrices of ``d x d`` (a grouped convolution's factor).

    ``call + blocks * (c0 + c1 d + c2 d^2 + c3 d^3)``: the call's fixed overhead, and each
    block's overhead and arithmetic, fitted to batched measurements
    (``benchmark`` measures them at depthwise and grouped shapes; the
    single-matrix curves, fitted at d >= 64 and floored, say little about
    ``d = 9``). ``measured`` maps ``(blocks, d)`` to measured seconds,
    returned as they are.
    """

    call: float
    c0: float
    c3: float
    measured: dict[tuple[int, int], float] = field(default_factory=dict)
    c1: float = 0.0  # files written before these terms have neither
    c2: float = 0.0

    def __post_init__(self) -> None:
        terms = (("call", self.call), ("c0", self.c0), ("c1", self.c1), ("c2", self.c2), ("c3", self.c3))
        for name, value in ((f"batched.{n}", v) for n, v in terms):
            if not math.isfinite(value) or value < 0:
                raise PerfModelError(f"{name} must be a non-negative finite number, got {value!r}")
        for key, seconds in self.measured.items():
            _positive_finite(f"batched.measured[{key}]", seconds)

    def fitted(self, blocks: int, dim: int) -> float:
        return self.call + blocks * (self.c0 + self.c1 * dim + self.c2 * dim**2 + self.c3 * dim**3)

    @staticmethod
    def rule(curve: Callable[[float], float], blocks: int, dim: int) -> float:
        """The estimate without batched measurements: ``t(d) + (blocks - 1) * max(t(d) - t(1), 0)``.

        One call's fixed overhead (about ``t(1)``) paid once, every block's
        work above it. Where the curve is floored at small ``d`` this counts
        the further blocks as free: measure instead.
        """
        one = curve(dim)
        return one + (blocks - 1) * max(one - curve(1), 0.0)

    def __call__(self, blocks: int, dim: int) -> float:
        hit = self.measured.get((blocks, dim))
        return hit if hit is not None else self.fitted(blocks, dim)

    def to_dict(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "c0": self.c0,
            "c1": self.c1,
            "c2": self.c2,
            "c3": self.c3,
            "unit": "seconds: call + blocks * (c0 + c1 d + c2 d^2 + c3 d^3)",
            "measured": {f"{b}x{d}": t for (b, d), t in sorted(self.measured.items())},
        }

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> BatchedModel:
        measured = {}
        for key, seconds in dict(entry.get("measured", {})).items():
            blocks, dim = (int(v) for v in str(key).split("x"))
            measured[(blocks, dim)] = float(seconds)
        lower = {k: float(entry.get(k, 0.0)) for k in ("c1", "c2")}
        return cls(float(entry["call"]), float(entry["c0"]), float(entry["c3"]), measured, **lower)


# Eigendecomposition (eigen_payload: torch.linalg.eigh and the [Q, d] buffer) over Cholesky inversion (invert_spd)
# time, float32, one thread, torch 2.13 CPU on the reference VM, median thread CPU time beside each other
# (scripts/add_eigen_curve.py, 2026-11-24): 2.1x at d=64, 2.7x at 256, 3.6x at 512, 5.3x at 1024, 6.2x at 2048,
# 9.5x at 2304 and 3072, 10.1x at 4608. The large factors dominate the stage, so a file without an eigen model
# is estimated at this multiple of its inversion model (with a warning); measure instead where it matters.
EIGEN_OVER_INVERSE = 8.0
# A warm-started eigenbasis refresh (methods/warm.py: one product F Q and a QR) over Cholesky inversion, same
# conditions (2026-11-25, torch 2.13 CPU, one thread): 2.3x at d=1024, 1.5x at 2304. A file without a measured
# warm curve is estimated at this multiple (with a warning).
WARM_OVER_INVERSE = 2.0


@dataclass
class PerfModel:
    """The fitted models plus where they were measured (``eigen`` is None in files from before it)."""

    allreduce: AllReduceModel
    broadcast: BroadcastModel
    inverse: InverseModel
    meta: dict[str, Any] = field(default_factory=dict)
    measurements: dict[str, Any] = field(default_factory=dict)
    fit_quality: dict[str, Any] = field(default_factory=dict)
    source: str = "object"
    eigen: InverseModel | None = None
    #: The warm-started eigenbasis refresh (``eigen_refresh='warm'``); None in files from before it.
    eigen_warm: InverseModel | None = None
    #: Batched-decomposition models by compute method (files from before them: none, ``scale = 1``).
    batched: dict[str, BatchedModel] = field(default_factory=dict)
    _eigen_estimate_warned: bool = field(default=False, init=False, repr=False, compare=False)
    _warm_estimate_warned: bool = field(default=False, init=False, repr=False, compare=False)

    def eigen_curve(self) -> Callable[[float], float]:
        """The eigendecomposition model; in a file without one (measured before it existed),
        :data:`EIGEN_OVER_INVERSE` times the inversion model, with a warning the first time, since
        placement decisions rest on it."""
        if self.eigen is not None:
            return self.eigen
        if not self._eigen_estimate_warned:
            self._eigen_estimate_warned = True
            warnings.warn(
                f"performance model {self.source} has no eigendecomposition model: estimating it as "
                f"{EIGEN_OVER_INVERSE:g}x the inversion model. Re-run `python -m spdkfac.perfmodels benchmark` "
                "to measure it.",
                stacklevel=4,
            )
        inverse = self.inverse
        return lambda dim: EIGEN_OVER_INVERSE * inverse(dim)

    def warm_eigen_curve(self, full_every: int) -> Callable[[float], float]:
        """Seconds per refresh of ``eigen_refresh='warm'``, amortised: ``full_every - 1`` warm refreshes and one
        full eigendecomposition in every ``full_every`` (a refresh the residual check turns into a full one costs
        more). In a file without a measured warm curve: :data:`WARM_OVER_INVERSE` times the inversion model,
        with a warning the first time."""
        eigen = self.eigen_curve()
        warm: Callable[[float], float]
        if self.eigen_warm is not None:
            warm = self.eigen_warm
        else:
            if not self._warm_estimate_warned:
                self._warm_estimate_warned = True
                warnings.warn(
                    f"performance model {self.source} has no warm eigenbasis-refresh model: estimating it as "
                    f"{WARM_OVER_INVERSE:g}x the inversion model. Re-run `python -m spdkfac.perfmodels benchmark` "
                    "to measure it.",
                    stacklevel=4,
                )
            inverse = self.inverse
            warm = lambda dim: WARM_OVER_INVERSE * inverse(dim)  # noqa: E731 (the estimated curve)
        return lambda dim: ((full_every - 1) * warm(dim) + eigen(dim)) / full_every

    @property
    def world_size(self) -> int | None:
        ws = self.meta.get("world_size")
        return int(ws) if ws is not None else None

    def check_world_size(self, world_size: int) -> None:
        """Warn when the file was measured on another number of workers."""
        measured = self.world_size
        if measured is not None and measured != world_size and world_size > 1:
            warnings.warn(
                f"performance model {self.source} was measured with {measured} workers but this run has "
                f"{world_size}; its all-reduce and broadcast costs are scaled to {world_size} workers (ring and "
                "tree, as the simulator scales them) for placement and fusion. Re-run `python -m spdkfac.perfmodels "
                "benchmark` under this launch configuration for measured ones.",
                stacklevel=3,
            )

    def for_world_size(self, workers: int) -> PerfModel:
        """This model as a run on ``workers`` workers plans with it: warned if measured on another count, then scaled."""
        self.check_world_size(workers)
        return self.scaled_to(workers)

    def scaled_to(self, workers: int) -> PerfModel:
        """The communication models extrapolated from the measured worker count W to ``workers`` (P).

        All-reduces as a ring: alpha by ``(P-1)/(W-1)``, beta by
        ``((P-1)/P) / ((W-1)/W)``; broadcasts as a tree, by
        ``ceil(log2 P) / ceil(log2 W)``. Computation models are unchanged.
        The simulator and the optimizer (when a run has another worker count
        than the file, e.g. an elastic restart) both plan with this.
        """
        measured = self.world_size or 2
        if workers < 2 or workers == measured:
            return self
        ring_alpha = (workers - 1) / max(measured - 1, 1)
        ring_beta = ((workers - 1) / workers) / ((measured - 1) / measured) if measured > 1 else 1.0
        tree = math.ceil(math.log2(workers)) / max(math.ceil(math.log2(measured)), 1)
        b = self.broadcast
        return dataclasses.replace(
            self,
            allreduce=AllReduceModel(self.allreduce.alpha * ring_alpha, self.allreduce.beta * ring_beta),
            broadcast=BroadcastModel(b.alpha * tree, b.beta * tree, {d: t * tree for d, t in (b.measured or {}).items()}),
            meta={**self.meta, "world_size": workers, "scaled_from_world_size": measured},
            source=f"{self.source} (scaled from {measured} to {workers} workers)",
        )

    # -- (de)serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "allreduce": {"alpha": self.allreduce.alpha, "beta": self.allreduce.beta, "unit": "seconds, elements"},
            "broadcast": {
                "alpha": self.broadcast.alpha,
                "beta": self.broadcast.beta,
                "unit": "seconds, d(d+1)/2 elements",
                "measured": {str(k): v for k, v in sorted((self.broadcast.measured or {}).items())},
            },
            "inverse": _curve_dict(self.inverse),
            **({"eigen": _curve_dict(self.eigen)} if self.eigen is not None else {}),
            **({"eigen_warm": _curve_dict(self.eigen_warm)} if self.eigen_warm is not None else {}),
            **({"batched": {name: b.to_dict() for name, b in self.batched.items()}} if self.batched else {}),
            "meta": self.meta,
            "fit_quality": self.fit_quality,
            "measurements": self.measurements,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "dict") -> PerfModel:
        if not isinstance(data, dict):
            raise PerfModelError(f"{source}: expected a JSON object at top level")
        _check_version(data, source)
        missing = [k for k in ("allreduce", "broadcast", "inverse") if k not in data]
        if missing:
            raise PerfModelError(f"{source}: missing field(s) {missing}")
        try:
            ar = AllReduceModel(data["allreduce"]["alpha"], data["allreduce"]["beta"])
            bc = BroadcastModel(data["broadcast"]["alpha"], data["broadcast"]["beta"], data["broadcast"].get("measured"))
            inv = _curve_from_dict(data["inverse"], "inverse")
            eig = _curve_from_dict(data["eigen"], "eigen") if "eigen" in data else None
            warm = _curve_from_dict(data["eigen_warm"], "eigen_warm") if "eigen_warm" in data else None
            batched = {str(name): BatchedModel.from_dict(entry) for name, entry in dict(data.get("batched", {})).items()}
        except PerfModelError as exc:
            raise PerfModelError(f"{source}: {exc}") from None
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise PerfModelError(f"{source}: missing or malformed field {exc}") from None
        return cls(
            allreduce=ar,
            broadcast=bc,
            inverse=inv,
            eigen=eig,
            eigen_warm=warm,
            batched=batched,
            meta=dict(data.get("meta", {})),
            measurements=dict(data.get("measurements", {})),
            fit_quality=dict(data.get("fit_quality", {})),
            source=source,
        )

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        p = Path(path)
        if not p.is_file():
            raise PerfModelError(f"performance model file {p} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise PerfModelError(f"{p}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(p))

    @classmethod
    def default(cls) -> PerfModel:
        """Uncalibrated defaults (roughly a 2-worker CPU/gloo machine); fit your own."""
        return cls(
            allreduce=AllReduceModel(2.0e-4, 2.0e-9),
            broadcast=BroadcastModel(2.0e-4, 2.0e-9),
            inverse=InverseModel("cubic", {"coeffs": [5.0e-5, 0.0, 0.0, 1.5e-11], "floor": 5.0e-5}),
            eigen=InverseModel("cubic", {"coeffs": [5.0e-5, 0.0, 0.0, EIGEN_OVER_INVERSE * 1.5e-11], "floor": 5.0e-5}, name="eigen"),
            eigen_warm=InverseModel(
                "cubic", {"coeffs": [5.0e-5, 0.0, 0.0, WARM_OVER_INVERSE * 1.5e-11], "floor": 5.0e-5}, name="eigen_warm"
            ),
            meta={"label": "built-in default (uncalibrated)"},
            source="built-in default (uncalibrated)",
        )


_REMEDY = "re-measure with `python -m spdkfac.perfmodels benchmark`"


def _check_version(data: dict[str, Any], source: str) -> None:
    """Refuse a file without ``format_version`` or with one newer than :data:`FORMAT_VERSION` (every file written has one)."""
    if "format_version" not in data:
        raise PerfModelError(f"performance model {source} has no format_version field (this spdkfac writes {FORMAT_VERSION}); {_REMEDY}")
    try:
        check_format_version(data["format_version"], FORMAT_VERSION, "performance model", source, _REMEDY)
    except FormatVersionError as exc:
        raise PerfModelError(str(exc)) from None


def _curve_dict(model: InverseModel) -> dict[str, Any]:
    return {
        "kind": model.kind,
        **model.params,
        "unit": "seconds, dimension d",
        "measured": {str(k): v for k, v in sorted((model.measured or {}).items())},
    }


def _curve_from_dict(entry: dict[str, Any], name: str) -> InverseModel:
    params = dict(entry)
    kind = params.pop("kind", "exp")
    params.pop("unit", None)
    measured = params.pop("measured", None)
    return InverseModel(kind, params, measured, name=name)


#: What the optimizer says when it plans for several workers with the built-in model (:func:`load_perf_model`).
UNCALIBRATED_WARNING = (
    "no perf_model given: using the built-in, uncalibrated default performance model for fusion "
    "and placement decisions. Fit one for your cluster with `python -m spdkfac.perfmodels "
    "benchmark --out perfmodels/<name>.json` and pass perf_model=<that file>."
)


def load_perf_model(perf_model: str | Path | PerfModel | None, warn: bool = True) -> PerfModel:
    """Resolve the optimizer's ``perf_model=`` argument (path, object, or None for the default, with a warning
    unless ``warn`` is False: the optimizer warns only where it plans for several workers)."""
    if perf_model is None:
        if warn:
            warnings.warn(UNCALIBRATED_WARNING, stacklevel=3)
        return PerfModel.default()
    if isinstance(perf_model, PerfModel):
        return perf_model
    if isinstance(perf_model, (str, Path)):
        return PerfModel.load(perf_model)
    raise TypeError(f"perf_model must be a path, a PerfModel or None, got {type(perf_model).__name__}")


# -- fitting ----------------------------------------------------------------------------
