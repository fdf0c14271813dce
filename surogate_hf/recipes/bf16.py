"""Float GEMMs of the bf16 recipe: forward in matmul_dtype, both backward GEMMs in gradient_dtype.

Operands are cast to the GEMM dtype; accumulation is fp32 (cuBLAS' default for bf16 and what the
CPU kernels do); the output is rounded once to the activation dtype. When the GEMM dtype equals
the output dtype this is plain `F.linear`; otherwise (e.g. bf16 operands, fp32 activations) the
operands are upcast and multiplied in fp32, which is exact for bf16 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

from .config import TORCH_DTYPES


def float_mm(a: torch.Tensor, b: torch.Tensor, gemm_dtype: torch.dtype, out_dtype: torch.dtype, bias=None):
    """out = a @ b^T (+ bias) with operands in gemm_dtype, fp32 accumulation, one rounding to out_dtype."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        if gemm_dtype == out_dtype:
            return Fn.linear(a.to(gemm_dtype), b.to(gemm_dtype), None if bias is None else bias.to(gemm_dtype))
        out = a.to(gemm_dtype).float() @ b.to(gemm_dtype).float().t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


class FloatBackward:
    """dgrad and wgrad in gradient_dtype (a knob name or a torch dtype) from the saved (x, w) of a forward."""

    def __init__(self, gradient_dtype):
        self.dtype = gradient_dtype if isinstance(gradient_dtype, torch.dtype) else TORCH_DTYPES[gradient_dtype]

    def backward(self, dy, x, w, need_dx: bool, need_dw: bool):
        dx = float_mm(dy, w.t(), self.dtype, dy.dtype) if need_dx else None
        dw = float_mm(dy.t(), x.t(), self.dtype, torch.float32) if need_dw else None
        return dx, dw


class FloatEngine:
    """The bf16 recipe's GEMM dtypes: forward in matmul_dtype, backward in gradient_dtype (fp32 or bf16); the
    linear itself is recipes.linear._FloatLinearFn."""

    name = "float"

    def __init__(self, matmul_dtype: str, gradient_dtype: str):
        self.dtype = TORCH_DTYPES[matmul_dtype]
        self.bwd = FloatBackward(gradient_dtype)
