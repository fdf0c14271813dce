"""Layouts the block-scaled FP8 GEMM takes, free of Triton so the module hot path can use them anywhere."""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

from ..ops.ext import RECIPE_1X128, RECIPE_128X128  # noqa: F401  (torch's ScalingType codes; defined with the op)


def mm_scales(ws: torch.Tensor) -> torch.Tensor:
    """Weight block scales [N/128, K/128] -> the buffer cuBLASLt reads (as its transpose view): rows
    padded to L4 = K/128 rounded up to 4 (padding entries never multiply data)."""
    kb = ws.shape[1]
    l4 = -(-kb // 4) * 4
    if l4 == kb:
        return ws.float().contiguous()
    padded = torch.zeros((ws.shape[0], l4), dtype=torch.float32, device=ws.device)
    padded[:, :kb] = ws
    return padded


def pad_weight(w: torch.Tensor, pad_n: int, pad_k: int) -> torch.Tensor:
    """e4m3 weight [N, K] -> [N + pad_n, K + pad_k] with zero codes in the new rows / columns: cuBLASLt's
    128x128 block scaling needs both dims multiples of 128. HF's ceil-div `weight_scale_inv` already has
    the padded blocks' scales and a zero code contributes exactly 0, so the GEMM's result is unchanged."""
    if not (pad_n or pad_k):
        return w
    return Fn.pad(w.view(torch.uint8), (0, pad_k, 0, pad_n)).view(w.dtype)


def pad_columns(a: torch.Tensor, pad: int) -> torch.Tensor:
    """a [M, C] -> [M, C + pad] with zeros: a zero column neither changes a 1x128 tile's amax (so its scale)
    nor adds to a product."""
    return Fn.pad(a, (0, pad)) if pad else a
