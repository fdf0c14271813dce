"""MXFP4 kernels (formats.mxfp4): quantize (E8M0 shared exponents per 32) and dequantize."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.mxfp4 import check_mxfp4_scales
from ._common import _EXACT, _INTERPRET, _abs_bits, _tile_configs
from .e2m1 import _e2m1_decode, _e2m1_encode, _nibbles, _pack_pairs


@triton.jit
def _mxfp4_quant_kernel(x_ptr, packed_ptr, scale_ptr, R, C, ROWS: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (NB * 32) + tl.arange(0, NB * 32)
    rmask = rows < R
    m2 = rmask[:, None] & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (ROWS, NB, 32))
    ab = tl.max(_abs_bits(xb), axis=2)  # [ROWS, NB] amax bits
    # floor(log2 amax) - 2 + 127 from the exponent field; subnormal amax lands below 0 and clamps
    biased = tl.minimum(tl.maximum(((ab >> 23) & 0xFF) - 2, 0), 254)
    biased = tl.where(ab == 0, 0, biased)
    biased = tl.where(ab >= 0x7F800000, 255, biased)
    e = 127 - biased  # multiply by 2^-shared, shared = biased - 127, e in [-128, 127]
    mult = tl.where(e >= -126, ((e + 127) << 23), 1 << tl.maximum(e + 149, 0)).to(tl.float32, bitcast=True)
    codes = _e2m1_encode(xb * mult[:, :, None])
    packed = _pack_pairs(tl.reshape(codes, (ROWS, NB * 32)), ROWS, NB * 32)
    pcols = tl.program_id(1) * (NB * 16) + tl.arange(0, NB * 16)
    tl.store(packed_ptr + rows[:, None].to(tl.int64) * (C // 2) + pcols[None, :], packed,
             mask=rmask[:, None] & (pcols[None, :] < C // 2))
    scols = tl.program_id(1) * NB + tl.arange(0, NB)
    tl.store(scale_ptr + rows[:, None].to(tl.int64) * (C // 32) + scols[None, :], biased.to(tl.uint8),
             mask=rmask[:, None] & (scols[None, :] < C // 32))


_mxfp4_tuned = triton.autotune(_tile_configs((8, 16, 32), (2, 4, 8)), key=["C"])(_mxfp4_quant_kernel)


def quantize_mxfp4(x: torch.Tensor):
    from ...formats.mxfp4 import check_mxfp4_shape

    check_mxfp4_shape(x.shape)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r = x2.shape[0]
    packed = torch.empty((r, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((r, k // 32), dtype=torch.uint8, device=x.device)
    if r and k:
        if _INTERPRET:
            _mxfp4_quant_kernel[(triton.cdiv(r, 16), triton.cdiv(k // 32, 8))](x2, packed, scales, r, k, ROWS=16, NB=8)
        else:
            _mxfp4_tuned[lambda meta: (triton.cdiv(r, meta["ROWS"]), triton.cdiv(k // 32, meta["NB"]))](
                x2, packed, scales, r, k, **_EXACT)
    return packed.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // 32)


@triton.jit
def _e8m0_to_f32(b):
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 1 << 22, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_dequant_kernel(p_ptr, s_ptr, out_ptr, R, C, ROWS: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    rmask = rows < R
    r64 = rows[:, None].to(tl.int64)
    code = _nibbles(p_ptr, rows, c0, C, ROWS, BC, rmask)
    scols = c0 // 32 + tl.arange(0, BC // 32)
    s = _e8m0_to_f32(tl.load(s_ptr + r64 * (C // 32) + scols[None, :],
                             mask=rmask[:, None] & (scols[None, :] < C // 32), other=127))
    v = tl.reshape(tl.reshape(_e2m1_decode(code), (ROWS, BC // 32, 32)) * s[:, :, None], (ROWS, BC))
    tl.store(out_ptr + r64 * C + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols[None, :] < C))


def dequantize_mxfp4(packed, scales, out_dtype):
    check_mxfp4_scales(packed, scales)
    k = packed.shape[-1] * 2
    p2 = packed.reshape(-1, k // 2).contiguous()
    r = p2.shape[0]
    out = torch.empty((r, k), dtype=out_dtype, device=packed.device)
    if r and k:
        _mxfp4_dequant_kernel[(triton.cdiv(r, 16), triton.cdiv(k, 256))](
            p2, scales.reshape(r, k // 32).contiguous(), out, r, k, ROWS=16, BC=256, **_EXACT, num_warps=4)
    return out.reshape(*packed.shape[:-1], k)
