"""Triton RMSNorm, forward and backward, with the FP8 cast of its output fused in (recipes.norm.FusedRMSNorm).

Transformer Engine's LayerNormLinear idea: the kernel that produces a linear's input also writes that input's
FP8 cast (and the K-major transpose the weight gradient reads), with the consumers' delayed scale, raising
their running amax with an atomic max. The FP8 linears fed by the norm then skip their own cast pass.

Numerics follow the two transformers formulas recipes.norm implements in torch (the reference):
  llama  y = w * to_x_dtype(x * rstd)              (Llama, Qwen2/3, Mistral, ... RMSNorm)
  gemma  y = to_out((x * rstd) * (1 + w))          (Gemma 1/2/3 RMSNorm, all in fp32)
with rstd = rsqrt(mean(x^2) + eps) over fp32 x. They differ from torch only by the order of the row sum
and rsqrt's rounding; the FP8 outputs are the exact cast of the y written (formats.quantize_fp8_tensorwise).
Imported lazily on the first CUDA call (never at package import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.fp8 import FP8_MAX
from .triton_quant import _EXACT, _INTERPRET, _TL_FP8, _abs_bits, _clamp_nan, _to_fp8


@triton.jit
def _row_rstd(x_ptr, rows, rmask, C, eps, BR: tl.constexpr, BC: tl.constexpr):
    acc = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    return tl.math.rsqrt(acc * (1.0 / C) + eps)  # torch: rsqrt(sum * (1/C) + eps), CUDA's rsqrtf


@triton.jit
def _norm_out(x, rstd, w, GEMMA: tl.constexpr, X_DT: tl.constexpr):
    """y in fp32 before its rounding to the output dtype (x, w fp32; rstd broadcast along the same axis as x)."""
    h = x * rstd
    if GEMMA:
        return h * (1.0 + w)
    else:
        return w * h.to(X_DT).to(tl.float32)


@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, R, C, eps,
                        GEMMA: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr, FP8: tl.constexpr,
                        FMAX: tl.constexpr, SW_FP8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """One band of BR rows: the row sums of squares over all of C, then y (and q, q^T) chunk by chunk. q^T is
    written from a second, transposed read of the chunk (an L1/L2 hit), as triton_quant's cast-transpose does."""
    X_DT = x_ptr.dtype.element_ty
    Y_DT = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    rstd = _row_rstd(x_ptr, rows, rmask, C, eps, BR, BC)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    if WRITE_Q:
        s = tl.load(scale_ptr)
        amax = tl.zeros([BR, BC], dtype=tl.int32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        cmask = cols < C
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = _norm_out(x, rstd[:, None], w[None, :], GEMMA, X_DT).to(Y_DT)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y, mask=m)
        if WRITE_Q:
            yf = tl.where(m, y.to(tl.float32), 0.0)
            amax = tl.maximum(amax, _abs_bits(yf))
            tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                     _to_fp8(_clamp_nan(yf * s, -FMAX, FMAX), FP8, SW_FP8), mask=m)
            if WRITE_QT:
                mt = cmask[:, None] & rmask[None, :]
                xt = tl.load(x_ptr + rows[None, :].to(tl.int64) * C + cols[:, None], mask=mt, other=0.0).to(tl.float32)
                yt = _norm_out(xt, rstd[None, :], w[:, None], GEMMA, X_DT).to(Y_DT).to(tl.float32)
                tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :],
                         _to_fp8(_clamp_nan(yt * s, -FMAX, FMAX), FP8, SW_FP8), mask=mt)
    if WRITE_Q:
        tl.atomic_max(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _bwd_chunk(dy_ptr, x_ptr, w_ptr, rows, rmask, c0, C, GEMMA: tl.constexpr, BC: tl.constexpr):
    """One [BR, BC] chunk of the backward: its columns, masks, offsets, x, dy and g = dL/d(x * rstd) (llama: rounded
    to x's dtype, as autograd does through `.to(input_dtype)`)."""
    cols = c0 + tl.arange(0, BC)
    cmask = cols < C
    m = rmask[:, None] & cmask[None, :]
    off = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if GEMMA:
        g = dy * (1.0 + w[None, :])
    else:
        g = (dy * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
    return cols, cmask, m, off, x, dy, g


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, R, C,
                        GEMMA: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """dx = rstd * g - x * rstd^3 * mean(g * x); the band's partial dw goes to dw_part[band]."""
    X_DT = x_ptr.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    dot = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, C, BC):
        _, _, _, _, x, _, g = _bwd_chunk(dy_ptr, x_ptr, w_ptr, rows, rmask, c0, C, GEMMA, BC)
        dot += tl.sum(g * x, axis=1)
    coef = dot * rstd * rstd * rstd / C
    for c0 in range(0, C, BC):
        cols, cmask, m, off, x, dy, g = _bwd_chunk(dy_ptr, x_ptr, w_ptr, rows, rmask, c0, C, GEMMA, BC)
        h = x * rstd[:, None]
        if GEMMA:
            dwp = tl.sum(dy * h, axis=0)
        else:
            dwp = tl.sum(dy * h.to(X_DT).to(tl.float32), axis=0)
        dx = g * rstd[:, None] - x * coef[:, None]
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dw_part_ptr + tl.program_id(0).to(tl.int64) * C + cols, dwp, mask=cmask)


def _blocks(r: int, c: int, transposed: bool):
    bc = min(triton.next_power_of_2(c), 128 if transposed else 1024)
    br = 32 if transposed else max(1, min(16, 4096 // bc))
    return br, bc


def rmsnorm_fwd(x2d: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool, out_dtype: torch.dtype, fp8=None):
    """(y [R, C] out_dtype, rstd [R] fp32, q or None, q^T or None) for contiguous x2d.

    fp8: None, or (scale_row, amax_row_bits, fp8 dtype, transpose): also write q = sat(y * scale) and, with
    transpose, q^T [C, R]; amax(|y|) is folded into the int32 bits of the state's running amax row.
    """
    r, c = x2d.shape
    y = torch.empty((r, c), dtype=out_dtype, device=x2d.device)
    rstd = torch.empty(r, dtype=torch.float32, device=x2d.device)
    q = qt = None
    if fp8 is not None:
        scale_row, amax_bits, dtype, transpose = fp8
        q = torch.empty((r, c), dtype=dtype, device=x2d.device)
        qt = torch.empty((c, r), dtype=dtype, device=x2d.device) if transpose else None
    if r == 0 or c == 0:
        return y, rstd, q, qt
    br, bc = _blocks(r, c, qt is not None)
    dummy = rstd
    _rmsnorm_fwd_kernel[(triton.cdiv(r, br),)](
        x2d, w, y, rstd, q if q is not None else dummy, qt if qt is not None else dummy,
        fp8[0] if fp8 is not None else dummy, fp8[1] if fp8 is not None else dummy, r, c, eps,
        GEMMA=gemma, WRITE_Q=q is not None, WRITE_QT=qt is not None,
        FP8=_TL_FP8[q.dtype] if q is not None else tl.float8e4nv, FMAX=FP8_MAX[q.dtype] if q is not None else 448.0,
        SW_FP8=_INTERPRET, BR=br, BC=bc, **_EXACT, num_warps=4 if qt is not None else 8,
    )
    return y, rstd, q, qt


def rmsnorm_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, gemma: bool,
                need_dw: bool = True):
    """(dx [R, C] in x's dtype, dw [C] fp32 or None)."""
    r, c = x2d.shape
    dx = torch.empty_like(x2d)
    if r == 0 or c == 0:
        return dx, (torch.zeros(c, dtype=torch.float32, device=x2d.device) if need_dw else None)
    br, bc = 16, min(triton.next_power_of_2(c), 512)
    nb = triton.cdiv(r, br)
    part = torch.empty((nb, c), dtype=torch.float32, device=x2d.device)
    _rmsnorm_bwd_kernel[(nb,)](dy2d.contiguous(), x2d, w, rstd, dx, part, r, c, GEMMA=gemma, BR=br, BC=bc,
                               **_EXACT, num_warps=8)
    return dx, (part.sum(0) if need_dw else None)
