"""spdkfac: distributed K-FAC with pipelined factor communication and load-balanced inversion.

Quick start::

    from spdkfac import SPDKFACOptimizer
    optimizer = SPDKFACOptimizer(model, lr=0.1, momentum=0.9)   # instead of torch.optim.SGD

or, for any torch optimizer (KAISA's usage)::

    from spdkfac import KFACPreconditioner
    preconditioner = KFACPreconditioner(model, lr=0.1)   # loss.backward(); preconditioner.step(); optimizer.step()
"""

from .kfac.layer_types import register_layer_type
from .optimizer import NonFiniteError, NonFiniteFactorError, SPDKFACOptimizer
from .preconditioner import KFACPreconditioner
from .runtime.host_memory import retain_freed_memory
from .schedules import KFACParamScheduler
from .step.adaptive_damping import AdaptiveDamping
from .variants import VARIANTS, make_optimizer

__version__ = "0.1.0"

__all__ = [
    "VARIANTS",
    "AdaptiveDamping",
    "KFACParamScheduler",
    "KFACPreconditioner",
    "NonFiniteError",
    "NonFiniteFactorError",
    "SPDKFACOptimizer",
    "__version__",
    "make_optimizer",
    "register_layer_type",
    "retain_freed_memory",
]
