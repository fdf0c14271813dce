"""FP8 GEMMs with per-tensor delayed scaling (fp8-hybrid recipe; bf16 recipe with matmul_dtype e4m3).

forward  y  = x  W^T : E4M3(x)  x E4M3(W)   -> activation dtype
dgrad    dx = dy W   : E5M2(dy) x E4M3(W)   -> activation dtype
wgrad    dW = dy^T x : E5M2(dy) x E4M3(x)   -> the master weight's dtype (fp32 accumulation, one rounding)
All three through surogate::fp8_scaled_mm (fp32 accumulation, "TN": both operands K-major). A
per-tensor cast commutes with transposition, so each operand is cast ONCE by
surogate::quantize_fp8_tensorwise_t, which writes q and the K-major transpose the backward GEMM
needs in the same pass (x^T for wgrad, W^T for dgrad, dy^T for wgrad); the forward saves only the
transposes the backward will use (1 byte per element). Transposes that no gradient needs are not
written. With a float gradient_dtype (bf16 recipe, matmul_dtype e4m3, gradient_dtype bf16/fp32) the
backward is the float one of bf16.py instead.
"""

from __future__ import annotations

import warnings

import torch

from ..ops import recipe as recipe_ops
from .bf16 import FloatBackward

ROLE_X, ROLE_W, ROLE_DY = 0, 1, 2
ROLE_FORMATS = ("e4m3", "e4m3", "e5m2")

_warned = set()  # (op, device type) already checked: one check and at most one warning each


def warn_emulation_once(op_name: str, device: torch.device, what: str) -> None:
    """One warning per (op, device type) when the reference runs instead of a native kernel."""
    key = (op_name, device.type)
    if key in _warned:
        return
    _warned.add(key)
    if recipe_ops.has_native_kernel(op_name, device):
        return
    where = "CPU" if device.type == "cpu" else f"{device} (no native surogate::{op_name} kernel registered)"
    warnings.warn(
        f"surogate_hf: {what} runs as exact emulation on {where}: operands are quantized exactly as the "
        "recipe specifies, then dequantized and multiplied in fp32. Numerics match the recipe; speed does not.",
        RuntimeWarning,
        stacklevel=3,
    )


_mm = torch.ops.surogate.fp8_scaled_mm
_WGRAD_OUT = (torch.float32, torch.bfloat16)  # dtypes fp8_scaled_mm writes dW in directly


class FP8Engine:
    name = "fp8"

    def __init__(self, gradient_dtype: str):
        self.fp8_backward = gradient_dtype == "e5m2"
        self.float_bwd = None if self.fp8_backward else FloatBackward(gradient_dtype)

    def forward(self, owner, x, w, bias, need_dx=True, need_dw=True):
        """need_dx / need_dw: the gradients the backward will compute (decides which transposes to write)."""
        warn_emulation_once("fp8_scaled_mm", x.device, "the FP8 recipe GEMM")
        mode = owner.pass_mode
        fp8_bwd = self.fp8_backward and mode != "eval"
        ((xq, *xt), (wq, *wt)), sinv = owner.fp8_meta.cast_group(
            ROLE_X, (x, w), mode, (fp8_bwd and need_dw, fp8_bwd and need_dx)
        )
        xs, ws = sinv[0], sinv[1]
        y = _mm(xq, wq, xs, ws, bias, x.dtype)
        if not self.fp8_backward:
            return y, (x, w)
        # x^T [K, M] and W^T [K, N], K-major for the backward GEMMs; None where no gradient needs it
        return y, (xt[0] if xt else None, xs, wt[0] if wt else None, ws)

    def backward(self, owner, dy, saved, need_dx, need_dw):
        if not self.fp8_backward:
            x, w = saved
            return self.float_bwd.backward(dy, x, w, need_dx, need_dw)
        xqt, xs, wqt, ws = saved
        # dgrad reads dy [M, N], wgrad dy^T [N, M]; with only the wgrad the q half goes unused.
        # The cast (and its history push) happens even when neither gradient is needed.
        out = owner.fp8_meta.cast(ROLE_DY, dy, "train", transpose=need_dw)
        dyq, dys = out[0], out[-1]
        dx = _mm(dyq, wqt, dys, ws, None, dy.dtype) if need_dx else None
        dw = None
        if need_dw:
            w_dtype = owner.weight.dtype
            dw = _mm(out[1], xqt, dys, xs, None, w_dtype if w_dtype in _WGRAD_OUT else torch.float32)
        return dx, dw
