"""E2M1 (FP4) element codes on the device, shared by the NVFP4 and MXFP4 kernels: encode (RNE and
stochastic, mirroring formats.e2m1 and formats.rng), decode, and nibble packing / unpacking."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import _clamp_nan


@triton.jit
def _e2m1_encode(x):
    """formats.e2m1.e2m1_encode: RNE to E2M1 with the reference's tie thresholds, saturating."""
    a = tl.abs(x)
    code = (
        (a > 0.25).to(tl.uint8)
        + (a >= 0.75).to(tl.uint8)
        + (a > 1.25).to(tl.uint8)
        + (a >= 1.75).to(tl.uint8)
        + (a > 2.5).to(tl.uint8)
        + (a >= 3.5).to(tl.uint8)
        + (a > 5.0).to(tl.uint8)
    )
    sign = ((x.to(tl.uint32, bitcast=True) >> 31) & 1).to(tl.uint8)
    return code | (sign << 3)


@triton.jit
def _e2m1_decode(code):
    """E2M1 code (low 4 bits, any int type) -> fp32 value, by building the fp32 bits."""
    c = code.to(tl.int32)
    m = c & 7
    exp_bits = ((m >> 1) + 126) << 23  # m >= 2: 2^((m>>1)-1) * (1 + (m&1)/2)
    bits = tl.where(m >= 2, exp_bits | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _hash_uniform(offs, seed_mix):
    """formats.rng.uniform_from_counter: murmur3 finalizer of (offset + seed*golden) mod 2^32."""
    h = (offs + seed_mix).to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _e2m1_encode_sr(x, u):
    """formats.e2m1.e2m1_encode_stochastic."""
    a = _clamp_nan(tl.abs(x), 0.0, 6.0)
    lo = (
        (a >= 0.5).to(tl.int32)
        + (a >= 1.0).to(tl.int32)
        + (a >= 1.5).to(tl.int32)
        + (a >= 2.0).to(tl.int32)
        + (a >= 3.0).to(tl.int32)
        + (a >= 4.0).to(tl.int32)
        + (a >= 6.0).to(tl.int32)
    )
    level = tl.where(lo == 7, 6.0, _e2m1_decode(lo))
    inv_gap = tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, tl.where(lo == 6, 0.5, 0.0)))
    p_up = (a - level) * inv_gap
    code = (lo + (u < p_up).to(tl.int32)).to(tl.uint8)
    sign = ((x.to(tl.uint32, bitcast=True) >> 31) & 1).to(tl.uint8)
    return code | (sign << 3)


@triton.jit
def _pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """[R, C] uint8 codes -> [R, C/2] bytes, the even column in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return lo | (hi << 4)


@triton.jit
def _nibbles(p_ptr, rows, c0, C, ROWS: tl.constexpr, BC: tl.constexpr, mask_r):
    """Codes [ROWS, BC] of packed bytes (even column in the low nibble), each byte loaded once."""
    pcols = c0 // 2 + tl.arange(0, BC // 2)
    p = tl.load(p_ptr + rows[:, None].to(tl.int64) * (C // 2) + pcols[None, :],
                mask=mask_r[:, None] & (pcols[None, :] < C // 2), other=0)
    return tl.reshape(tl.join(p & 0xF, p >> 4), (ROWS, BC))
