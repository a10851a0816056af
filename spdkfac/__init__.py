"""spdkfac: distributed K-FAC with pipelined factor communication and load-balanced inversion.

Quick start::

    from spdkfac import SPDKFACOptimizer
    optimizer = SPDKFACOptimizer(model, lr=0.1, momentum=0.9)   # instead of torch.optim.SGD

or, for any torch optimizer (KAISA's usage)::

    from spdkfac import KFACPreconditioner
    preconditioner = KFACPreconditioner(model, lr=0.1)   # loss.backward(); preconditioner.step(); optimizer.step()
"""

from .runtime.versions import MIN_TORCH, require_supported_torch, torch_is_supported

require_supported_torch()  # before the rest, which needs it: a clear ImportError on an older torch

from .kfac.layer_types import register_layer_type  # noqa: E402
from .optimizer import NonFiniteError, NonFiniteFactorError, SPDKFACOptimizer  # noqa: E402
from .preconditioner import KFACPreconditioner  # noqa: E402
from .runtime.host_memory import retain_freed_memory  # noqa: E402
from .schedules import KFACParamScheduler, LambdaParamScheduler  # noqa: E402
from .step.adaptive_damping import AdaptiveDamping  # noqa: E402
from .update.trainer_callback import hugging_face_callback  # noqa: E402
from .variants import VARIANTS, make_optimizer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "MIN_TORCH",
    "VARIANTS",
    "AdaptiveDamping",
    "KFACParamScheduler",
    "KFACPreconditioner",
    "LambdaParamScheduler",
    "NonFiniteError",
    "NonFiniteFactorError",
    "SPDKFACOptimizer",
    "__version__",
    "hugging_face_callback",
    "make_optimizer",
    "register_layer_type",
    "retain_freed_memory",
    "torch_is_supported",
]
