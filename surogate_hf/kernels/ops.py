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
    # clone, not contiguous(): for one row or column the transpose is already contiguous and would alias q
    return q, q.reshape(-1, x.shape[-1]).t().clone(memory_format=torch.contiguous_format), x.detach().abs().amax().float()


@quantize_fp8_tensorwise_t.register_fake
def _(x, scale, fp8_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((x.shape[-1], rows), dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
    )


@torch.library.custom_op(f"{NS}::delayed_scaling_update", mutates_args=("history", "scale"))
def delayed_scaling_update(history: Tensor, scale: Tensor, amax: Tensor, fp8_dtype: torch.dtype, margin: int,
                           use_max: bool) -> None:
    """One delayed-scaling step for n roles, in place (recipes.scaling.Fp8ScalingState semantics).

    history [n, L] newest first, scale [n], amax [n]: amax is sanitized (NaN/inf -> 0), pushed in front of the
    history (the oldest entry drops out), and scale becomes formats.fp8_scale_from_amax of the max over the new
    window (use_max) or of the new amax, keeping the previous scale where that gives no positive finite value.
    """
    a = torch.nan_to_num(amax.float(), nan=0.0, posinf=0.0, neginf=0.0)
    # newest first: [amax, history[:, :-1]] in one op (no roll + copy + index write)
    pushed = torch.cat((a.unsqueeze(1), history[:, :-1]), dim=1)
    history.copy_(pushed)
    window = pushed.amax(dim=1) if use_max else a
    scale.copy_(F.fp8_scale_from_amax(window, fp8_dtype, margin, previous=scale))


@delayed_scaling_update.register_fake
def _(history, scale, amax, fp8_dtype, margin, use_max):
    return None
