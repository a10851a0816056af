"""Factor products on a GPU's tensor cores where that is exact: inputs that were half precision.

Under autocast a layer's input and output gradient are bf16 or fp16. The
factor hooks widen them to float32 before the Gram products, and a float32
product runs on the GPU's plain float32 units unless TF32 is allowed: on an
H200 those products were 70 of the 114 ms of a ResNet-50 factor step
(224x224, batch 64). TF32 rounds each input to 10 mantissa bits, which loses
nothing for values that came from bf16 (7 bits) or fp16 (10 bits), possibly
scaled by a power of two (a GradScaler's scale); the products of two such
values fit a float32 exactly and are summed in float32. So, for those inputs
only, TF32 changes the summation order and nothing else. Float32 inputs (a
model trained without autocast, the first layer's images) keep full float32
products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["exact_on_tensor_cores", "half_precision_products"]

#: Input dtypes whose values TF32 holds exactly (at most 10 explicit mantissa bits).
_EXACT_IN_TF32 = (torch.bfloat16, torch.float16)


def exact_on_tensor_cores(source: torch.Tensor) -> bool:
    """Whether the factor products of ``source`` (before widening) may run on TF32 tensor cores without a change:
    a CUDA tensor in bf16 or fp16."""
    return source.device.type == "cuda" and source.dtype in _EXACT_IN_TF32


@contextlib.contextmanager
def half_precision_products(source: torch.Tensor) -> Iterator[None]:
    """Allow TF32 for the float32 matrix products inside, where :func:`exact_on_tensor_cores` holds for ``source``.

    The setting is process-wide: the block must only multiply values taken
    from ``source`` by exact operations. Leaving restores it exactly as it
    was (torch's old and new TF32 settings alike; torch refuses a matmul
    whose two settings disagree). Where the user already allows TF32 (or
    lower) for float32 products, nothing changes.
    """
    matmul = torch.backends.cuda.matmul
    new_setting = getattr(matmul, "fp32_precision", None)  # torch >= 2.9 ("none": the global one's)
    if new_setting is None:
        reduced = torch.get_float32_matmul_precision() != "highest"
    else:
        reduced = (torch.backends.fp32_precision if new_setting == "none" else new_setting) not in ("none", "ieee")
    if reduced or not exact_on_tensor_cores(source):
        yield
        return
    matmul.allow_tf32 = True  # (sets both: the old precision "high", the new "tf32")
    try:
        yield
    finally:
        matmul.allow_tf32 = False  # (the old "highest", the new "ieee")
        if new_setting is not None:
            matmul.fp32_precision = new_setting  # (as it was: "none" inherits, "ieee")
