"""DHO2's options: defaults from the papers, validated once, frozen."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..options import Option
from ..update.base_update import BaseOptimizer

__all__ = ["BASE_OPTIMIZERS", "DEFAULT_ADMM_RULE", "DEFAULT_SIGMA", "ADMMRule", "DHO2Config", "default_lanczos_steps"]

#: The base updates DHO2 offers (of :class:`~spdkfac.update.base_update.BaseOptimizer`'s).
BASE_OPTIMIZERS: tuple[BaseOptimizer, ...] = (BaseOptimizer.ADAMW, BaseOptimizer.SGD)


#: The ADMM-like outer iteration's forms (docs/dho2.md argues them): ``'code'`` runs the authors' code (also
#: Algorithm 3 as printed: inner gradient g + π, no σ(w_a − w)); ``'lagrangian'`` adds σ(w_a − w), so the inner
#: loop descends the w_a-subproblem of Eq. 11; ``'proximal'`` is ``'lagrangian'`` without moving the parameters
#: to w at the outer step (the inner loop warm-starts at w_a: the proximal point method Eq. 11 reduces to).
class ADMMRule(Option):
    """The form of DHO2's ADMM-like outer iteration (``admm_rule``)."""

    CODE = "code"
    LAGRANGIAN = "lagrangian"
    PROXIMAL = "proximal"


#: σ when not given, by rule: the authors' code's 5e-9 for ``'code'``; the measured best for the others.
DEFAULT_SIGMA: dict[ADMMRule, float] = {ADMMRule.CODE: 5e-9, ADMMRule.LAGRANGIAN: 0.1, ADMMRule.PROXIMAL: 0.01}
DEFAULT_ADMM_RULE = ADMMRule.PROXIMAL


def default_lanczos_steps(n: int, k: int, l: int) -> int:  # noqa: E741 the paper's name
    """FOSI's ``m = max(4(k+l), 2 ln n)`` Lanczos steps, at most ``n`` (a Krylov space of ``R^n`` has at most n dimensions)."""
    return min(n, max(4 * (k + l), math.ceil(2 * math.log(max(n, 1)))))


@dataclass(frozen=True)
class DHO2Config:
    """Every option of :class:`~spdkfac.dho2.DHO2Optimizer`; see its docstring for their meaning."""

    lr: float = 1e-3
    base: BaseOptimizer | str = BaseOptimizer.ADAMW
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.05
    momentum: float = 0.9
    k: int = 5
    l: int = 0  # noqa: E741 the paper's name
    refresh_every: int = 100
    lanczos_steps: int | None = None
    alpha: float = 0.1
    admm: bool = True
    admm_rule: ADMMRule | str | None = None
    sigma: float | None = None
    admm_period: int = 400
    eigenvalue_floor: float = 1e-6
    seed: int = 0
    accumulation_steps: int = 1
    skip_nonfinite: int = 0

    def __post_init__(self) -> None:
        def positive(name: str, value: float) -> None:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

        def count(name: str, value: int, least: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

        positive("lr", self.lr)
        base = BaseOptimizer.parse("base", self.base) if isinstance(self.base, str) else self.base
        if base not in BASE_OPTIMIZERS:
            raise ValueError(f"base must be one of {tuple(b.plain() for b in BASE_OPTIMIZERS)}, got {self.base!r}")
        object.__setattr__(self, "base", base)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        positive("eps", self.eps)
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        count("k", self.k, 0)
        count("l", self.l, 0)
        if self.k + self.l == 0:
            raise ValueError("k + l must be >= 1: the Newton subspace needs at least one eigenpair (k largest, l smallest)")
        count("refresh_every", self.refresh_every, 1)
        if self.lanczos_steps is not None:
            count("lanczos_steps", self.lanczos_steps, self.k + self.l)
        positive("alpha", self.alpha)
        if not self.admm and (self.admm_rule is not None or self.sigma is not None):
            raise ValueError("admm_rule and sigma apply to the ADMM outer iteration only: drop them, or pass admm=True ('dho2')")
        if self.admm:  # resolved once here, so the config (repr, checkpoints) names the rule and σ that run
            rule = DEFAULT_ADMM_RULE if self.admm_rule is None else ADMMRule.parse("admm_rule", self.admm_rule)
            object.__setattr__(self, "admm_rule", rule)
            if self.sigma is None:
                object.__setattr__(self, "sigma", DEFAULT_SIGMA[rule])
            positive("sigma", self.sigma)  # type: ignore[arg-type]
        count("admm_period", self.admm_period, 1)
        if not (math.isfinite(self.eigenvalue_floor) and self.eigenvalue_floor >= 0):
            raise ValueError(f"eigenvalue_floor must be >= 0, got {self.eigenvalue_floor!r}")
        count("seed", self.seed, 0)
        count("accumulation_steps", self.accumulation_steps, 1)
        count("skip_nonfinite", self.skip_nonfinite, 0)

    @property
    def shift(self) -> float:
        """σ where the step uses it (the Newton step's ``(A + σI)⁻¹``), 0 without ADMM."""
        return float(self.sigma) if self.admm and self.sigma is not None else 0.0

    def steps_for(self, n: int) -> int:
        """The Lanczos steps m for a model of ``n`` parameters (the option, or FOSI's default; at most n)."""
        if self.k + self.l > n:
            raise ValueError(f"k + l = {self.k + self.l} eigenpairs asked of a model with only {n} parameters")
        return min(n, self.lanczos_steps) if self.lanczos_steps is not None else default_lanczos_steps(n, self.k, self.l)

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (enum members as their strings), as checkpoints save them."""
        return {name: value.plain() if isinstance(value, Option) else value for name, value in asdict(self).items()}
