"""Triton launches for the FP8 recipe's casts into a model's flat delayed-scaling state.

Same kernels as surogate::quantize_fp8_tensorwise(_t) (triton_quant.fp8), launched with pointers into
the state: the scale is read from its row and the amax is folded into the row's running max by the
kernel's own atomic max (on the fp32 bits, which order like the values since amaxes are >= 0; NaN
sorts above inf and so propagates). One launch per cast and no state-update ops on the host path.
Imported lazily by surogate_hf.recipes on the first CUDA cast (never at package import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.fp8 import FP8_MAX
from .triton_quant import _EXACT, _INTERPRET, _TL_FP8, _amax_kernel, _fp8_tensorwise_kernel, _fp8_tensorwise_t_kernel


def amax_into(x2d: torch.Tensor, amax_row_bits: torch.Tensor) -> None:
    """amax_row = max(amax_row, amax(|x|)); amax_row_bits is the int32 view of one fp32 state entry."""
    n = x2d.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, 4096),)](x2d, amax_row_bits, n, BLOCK=4096, **_EXACT, num_warps=8)


def cast_fp8_into(x2d: torch.Tensor, scale_row: torch.Tensor, amax_row_bits: torch.Tensor, dtype: torch.dtype,
                  transpose: bool):
    """q = sat(x * scale_row) in `dtype` and, with `transpose`, its contiguous transpose from the same pass.

    x2d: contiguous [R, C]; scale_row: a one-element fp32 view (the state row); amax_row_bits: the int32 view of
    the row's running amax. Bit-exact to formats.quantize_fp8_tensorwise.
    """
    if _INTERPRET and dtype != torch.float8_e4m3fn:
        # the interpreter's software FP8 encoder (SW_FP8) writes E4M3 bits only
        raise NotImplementedError("the Triton interpreter path implements the e4m3 cast only")
    r, c = x2d.shape
    q = torch.empty((r, c), dtype=dtype, device=x2d.device)
    fmax, tl_fp8 = FP8_MAX[dtype], _TL_FP8[dtype]
    if not transpose:
        n = r * c
        if n:
            _fp8_tensorwise_kernel[(triton.cdiv(n, 4096),)](
                x2d, scale_row, q, amax_row_bits, n, FP8=tl_fp8, FMAX=fmax, SW_FP8=_INTERPRET, BLOCK=4096,
                **_EXACT, num_warps=8,
            )
        return q, None
    qt = torch.empty((c, r), dtype=dtype, device=x2d.device)
    if r and c:
        _fp8_tensorwise_t_kernel[(triton.cdiv(r, 32) * triton.cdiv(c, 128),)](
            x2d, scale_row, q, qt, amax_row_bits, r, c, FP8=tl_fp8, FMAX=fmax, SW_FP8=_INTERPRET, BR=32, BC=128,
            **_EXACT, num_warps=4,
        )
    return q, qt


@triton.jit
def _scale_bias_cast_kernel(acc_ptr, ga_ptr, gb_ptr, bias_ptr, out_ptr, n, N, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(ga_ptr).to(tl.float32) * tl.load(gb_ptr).to(tl.float32)
    v = tl.load(acc_ptr + offs, mask=m, other=0.0) * g
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m)


def scale_bias_cast(acc: torch.Tensor, a_global, b_global, bias, out_dtype) -> torch.Tensor:
    """cast(acc * (a_global * b_global) + bias.f32, out_dtype) of the fp32 GEMM result acc [M, N] in one pass (the
    reference's roundings: the product of the globals, the scaling, the bias add, the final cast; no FMA). Three
    torch ops read and wrote the fp32 result three times."""
    m, n = acc.shape
    out = acc if out_dtype == torch.float32 else torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if acc.numel():
        ga = a_global.float().reshape(1).contiguous()
        gb = b_global.float().reshape(1).contiguous()
        b = bias.contiguous() if bias is not None else ga
        _scale_bias_cast_kernel[(triton.cdiv(acc.numel(), 2048),)](
            acc, ga, gb, b, out, acc.numel(), n, HAS_BIAS=bias is not None, BLOCK=2048, **_EXACT, num_warps=4)
    return out
