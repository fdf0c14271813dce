"""FP8 GEMMs with per-tensor delayed scaling (fp8-hybrid recipe; bf16 recipe with matmul_dtype e4m3).

forward  y  = x  W^T : E4M3(x)  x E4M3(W)   -> activation dtype
dgrad    dx = dy W   : E5M2(dy) x E4M3(W)   -> activation dtype
wgrad    dW = dy^T x : E5M2(dy) x E4M3(x)   -> fp32, then the master weight's dtype
All three through surogate::fp8_scaled_mm (fp32 accumulation). The E4M3 x and W of the forward
are saved for the backward (1 byte per element); a per-tensor cast commutes with transposition,
so their transposes are the same quantized values. With a float gradient_dtype (bf16 recipe,
matmul_dtype e4m3, gradient_dtype bf16/fp32) the backward is the float one of bf16.py instead.
"""

from __future__ import annotations

import warnings

import torch

from ..ops import recipe as recipe_ops
from .bf16 import FloatBackward

ROLE_X, ROLE_W, ROLE_DY = 0, 1, 2
ROLE_FORMATS = ("e4m3", "e4m3", "e5m2")

_warned = set()


def warn_emulation_once(op_name: str, device: torch.device, what: str) -> None:
    """One warning per (op, device type) when the reference runs instead of a native kernel."""
    key = (op_name, device.type)
    if key in _warned or recipe_ops.has_native_kernel(op_name, device):
        return
    _warned.add(key)
    where = "CPU" if device.type == "cpu" else f"{device} (no native surogate::{op_name} kernel registered)"
    warnings.warn(
        f"surogate_hf: {what} runs as exact emulation on {where}: operands are quantized exactly as the "
        "recipe specifies, then dequantized and multiplied in fp32. Numerics match the recipe; speed does not.",
        RuntimeWarning,
        stacklevel=3,
    )


class FP8Engine:
    name = "fp8"

    def __init__(self, gradient_dtype: str):
        self.fp8_backward = gradient_dtype == "e5m2"
        self.float_bwd = None if self.fp8_backward else FloatBackward(gradient_dtype)

    def forward(self, owner, x, w, bias):
        warn_emulation_once("fp8_scaled_mm", x.device, "the FP8 recipe GEMM")
        meta = owner.fp8_meta
        xq, xs = meta.cast(ROLE_X, x, owner.pass_mode)
        wq, ws = meta.cast(ROLE_W, w, owner.pass_mode)
        y = torch.ops.surogate.fp8_scaled_mm(xq, wq, xs, ws, bias, x.dtype)
        saved = (xq, xs, wq, ws) if self.fp8_backward else (x, w)
        return y, saved

    def backward(self, owner, dy, saved, need_dx, need_dw):
        if not self.fp8_backward:
            x, w = saved
            return self.float_bwd.backward(dy, x, w, need_dx, need_dw)
        xq, xs, wq, ws = saved
        dyq, dys = owner.fp8_meta.cast(ROLE_DY, dy)
        dx = torch.ops.surogate.fp8_scaled_mm(dyq, wq.t().contiguous(), dys, ws, None, dy.dtype) if need_dx else None
        dw = (
            torch.ops.surogate.fp8_scaled_mm(dyq.t().contiguous(), xq.t().contiguous(), dys, xs, None, torch.float32)
            if need_dw
            else None
        )
        return dx, dw
