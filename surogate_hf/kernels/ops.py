"""Ops the kernels add to the `surogate` namespace (reference default implementations here too)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import formats as F

NS = "surogate"


@torch.library.custom_op(f"{NS}::quantize_fp8_tensorwise_t", mutates_args=())
def quantize_fp8_tensorwise_t(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tensor FP8 cast of a 2D view [rows, cols] of x (last dim kept), its transpose, and amax(|x|).

    Returns (q [..., cols] like x, qt [cols, rows] contiguous, amax fp32 scalar). The transposed copy
    feeds the backward GEMMs (cuBLASLt FP8 wants K-major operands) without a second pass over x.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_tensorwise_t needs a tensor with >= 2 dims, got shape {tuple(x.shape)}")
    q, _ = F.quantize_fp8_tensorwise(x, fp8_dtype, scale=scale)
    return q, q.reshape(-1, x.shape[-1]).t().contiguous(), x.detach().abs().amax().float()


@quantize_fp8_tensorwise_t.register_fake
def _(x, scale, fp8_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((x.shape[-1], rows), dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
    )
