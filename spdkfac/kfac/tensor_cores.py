"""Factor products of half-precision inputs on a GPU's tensor cores, exactly: bf16/fp16 rows into a float32 Gram.

Under autocast a layer's input and output gradient are bf16 or fp16. Widening
them to float32 before the Gram products (the general path) costs a copy of
every row block and runs the products on the GPU's plain float32 units: on an
H200 those were 70 of the 114 ms of a ResNet-50 factor step (224x224, batch
64). Kept in their half precision and multiplied with float32 accumulation
and a float32 result (``torch.mm(..., out_dtype=torch.float32)``), the rows
take 0.21 ms where float32 took 2.5-3.2 ms and TF32 0.56-1.0 ms at
ResNet-50's 3x3 shapes. Nothing is rounded that the float32 path keeps: the
product of two bf16 (8-bit) or fp16 (11-bit significand) values fits a
float32 exactly, and the sums are float32 sums, so only their order changes.

Only Gram matrices of the values as they came qualify (a helper says so with
``half_rows``); a loss scale is divided out of the float32 Gram afterwards.
Float32 inputs (no autocast, the first layer's images), the CPU, and torch
versions without ``out_dtype`` keep the float32 path.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["HALF_DTYPES", "gram_of_half_rows", "keeps_half_rows"]

#: Input dtypes whose pairwise products a float32 holds exactly.
HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _multiplies_half_into_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch multiplies ``dtype`` matrices on ``device`` into a float32 result (``mm``'s ``out_dtype``)."""
    one = torch.ones(1, 1, device=device, dtype=dtype)
    try:
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def keeps_half_rows(source: torch.Tensor, factor_dtype: torch.dtype) -> bool:
    """Whether the Gram rows of ``source`` may stay in its own half precision: a CUDA bf16/fp16 tensor, float32
    factors, and a torch that multiplies such matrices into float32."""
    return (
        source.device.type == "cuda"
        and source.dtype in HALF_DTYPES
        and factor_dtype == torch.float32
        and _multiplies_half_into_float32(source.device, source.dtype)
    )


def gram_of_half_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows`` of bf16/fp16 rows as float32: exact products, float32 sums, on the tensor cores."""
    return torch.mm(rows.transpose(0, 1), rows, out_dtype=torch.float32)
