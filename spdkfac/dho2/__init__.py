"""DHO2 (Gu et al., "Accelerating Distributed Hybrid Order Optimization via Model Parallelism and ADMM").

FOSI's hybrid first/second-order step (a Newton step in the span of the
Hessian's extreme eigenvectors, a base first-order optimizer on the rest),
with the Lanczos basis split by rows across workers and an ADMM-like outer
iteration. The parts, each usable alone:

- :mod:`.hvp`: Hessian-vector products by double backward, averaged over workers;
- :mod:`.lanczos`: the distributed Lanczos iteration (Algorithms 1-2) and the extreme eigenpairs;
- :mod:`.update`: the hybrid step (Eqs. 3, 4, 13) and the ADMM state (Algorithm 3);
- :mod:`.optimizer`: :class:`DHO2Optimizer`, which schedules them.

``make_optimizer('dho2' | 'dho2-wa', model, lr=...)`` builds it with and
without the ADMM outer iteration (:data:`spdkfac.variants.OTHER_OPTIMIZERS`).
"""

from .config import ADMMRule, DHO2Config, default_lanczos_steps
from .hvp import HessianVectorProduct
from .lanczos import RowSplit, distributed_lanczos, extreme_eigenpairs
from .optimizer import DHO2Optimizer
from .update import ADMMState, EigenBasis, hybrid_delta

__all__ = [
    "ADMMRule",
    "ADMMState",
    "DHO2Config",
    "DHO2Optimizer",
    "EigenBasis",
    "HessianVectorProduct",
    "RowSplit",
    "default_lanczos_steps",
    "distributed_lanczos",
    "extreme_eigenpairs",
    "hybrid_delta",
]
