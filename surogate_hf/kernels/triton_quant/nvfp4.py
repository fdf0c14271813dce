"""NVFP4 kernels (formats.nvfp4): quantize (1D / 2D blocks, 4/6 choice, stochastic rounding) and dequantize."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.nvfp4 import GLOBAL_RANGE, check_nvfp4_scales
from ._common import _EXACT, _FLT_MAX, _GOLDEN, _INTERPRET, _abs_bits, _clamp_nan, _tile_configs, _to_fp8, amax
from .e2m1 import _e2m1_decode, _e2m1_encode, _e2m1_encode_sr, _hash_uniform, _nibbles, _pack_pairs


@triton.jit
def _tree16(e):
    """formats.nvfp4._tree_sum over the last axis (16) of [A, B, 16]: halves added pairwise."""
    A: tl.constexpr = e.shape[0]
    B: tl.constexpr = e.shape[1]
    e = tl.sum(tl.reshape(e, (A, B, 2, 8)), axis=2)
    e = tl.sum(tl.reshape(e, (A, B, 2, 4)), axis=2)
    e = tl.sum(tl.reshape(e, (A, B, 2, 2)), axis=2)
    e = tl.sum(tl.reshape(e, (A, B, 2, 1)), axis=2)
    return tl.reshape(e, (A, B))


@triton.jit
def _block_err(d, RULE: tl.constexpr, BLOCK_2D: tl.constexpr):
    """Per-block error of d [ROWS, NB, 16]; 2D blocks are the 16 rows x 16 cols of one NB slot,
    summed row-halves first (the reference's row-major tile order). Returns [ROWS or 1, NB]."""
    if RULE == 2:
        a = tl.abs(d)
        if BLOCK_2D:
            return tl.max(tl.max(a, axis=2), axis=0)[None, :]
        else:
            return tl.max(a, axis=2)
    if RULE == 0:
        v = d * d
    else:
        v = tl.abs(d)
    if BLOCK_2D:
        NB: tl.constexpr = v.shape[1]
        v = tl.sum(tl.reshape(v, (2, 8, NB, 16)), axis=0)
        v = tl.sum(tl.reshape(v, (2, 4, NB, 16)), axis=0)
        v = tl.sum(tl.reshape(v, (2, 2, NB, 16)), axis=0)
        v = tl.sum(tl.reshape(v, (2, 1, NB, 16)), axis=0)
    return _tree16(v)


@triton.jit
def _nvfp4_candidate(xb, blk_amax, g_enc, g_dec, M: tl.constexpr, SW_FP8: tl.constexpr):
    """formats.nvfp4 candidate(m): block scale (e4m3), encode scale, codes, dequantized values."""
    if M == 6:
        t = tl.math.div_rn(blk_amax, tl.full(blk_amax.shape, 6.0, tl.float32))
    else:
        t = blk_amax * 0.25
    s = _to_fp8(_clamp_nan(t * g_enc, -3.4e38, 448.0), tl.float8e4nv, SW_FP8).to(tl.float32)
    enc = _clamp_nan(tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s * g_dec), -_FLT_MAX, _FLT_MAX)
    codes = _e2m1_encode(xb * enc[:, :, None])
    deq = (_e2m1_decode(codes) * s[:, :, None]) * g_dec
    return s, enc, codes, deq


@triton.jit
def _nvfp4_quant_kernel(x_ptr, amax_ptr, packed_ptr, scale_ptr, gdec_ptr, R, C, seed_mix,
                        BLOCK_2D: tl.constexpr, FOUR_SIX: tl.constexpr, RULE: tl.constexpr,
                        STOCHASTIC: tl.constexpr, S_GLOBAL: tl.constexpr, SW_FP8: tl.constexpr,
                        ROWS: tl.constexpr, NB: tl.constexpr, SEED_PTR: tl.constexpr = False):
    """ROWS rows x NB blocks of 16 columns per program (ROWS = 16 for 2D blocks). SEED_PTR: seed_mix points at the
    seed (one int64 on the device) and is mixed here."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (NB * 16) + tl.arange(0, NB * 16)
    rmask = rows < R
    cmask = cols < C
    m2 = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (ROWS, NB, 16))

    amax_t = tl.load(amax_ptr)
    zero = amax_t == 0
    # scalar / tensor in the reference is reciprocal * scalar; tensor / scalar a true division
    g_enc = tl.where(zero, 1.0, tl.math.div_rn(1.0, tl.where(zero, 1.0, amax_t)) * S_GLOBAL)
    g_dec = tl.where(zero, 1.0, tl.math.div_rn(amax_t, S_GLOBAL))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(gdec_ptr, g_dec)

    ab = _abs_bits(xb)
    if BLOCK_2D:
        blk = tl.max(tl.max(ab, axis=2), axis=0)[None, :]  # [1, NB]
    else:
        blk = tl.max(ab, axis=2)  # [ROWS, NB]
    blk_amax = blk.to(tl.float32, bitcast=True)

    s, enc, codes, deq = _nvfp4_candidate(xb, blk_amax, g_enc, g_dec, 6, SW_FP8)
    if FOUR_SIX:
        s4, enc4, codes4, deq4 = _nvfp4_candidate(xb, blk_amax, g_enc, g_dec, 4, SW_FP8)
        use4 = _block_err(deq4 - xb, RULE, BLOCK_2D) < _block_err(deq - xb, RULE, BLOCK_2D)
        s = tl.where(use4, s4, s)
        enc = tl.where(use4, enc4, enc)
        codes = tl.where(use4[:, :, None], codes4, codes)
    if STOCHASTIC:
        if SEED_PTR:
            mix = (tl.load(seed_mix).to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF
        else:
            mix = seed_mix
        u = _hash_uniform(offs, mix)
        codes = _e2m1_encode_sr(xb * enc[:, :, None], tl.reshape(u, (ROWS, NB, 16)))

    packed = _pack_pairs(tl.reshape(codes, (ROWS, NB * 16)), ROWS, NB * 16)
    pcols = tl.program_id(1) * (NB * 8) + tl.arange(0, NB * 8)
    tl.store(packed_ptr + rows[:, None].to(tl.int64) * (C // 2) + pcols[None, :], packed,
             mask=rmask[:, None] & (pcols[None, :] < C // 2))
    scols = tl.program_id(1) * NB + tl.arange(0, NB)
    s_full = _to_fp8(tl.broadcast_to(s, (ROWS, NB)), tl.float8e4nv, SW_FP8)
    tl.store(scale_ptr + rows[:, None].to(tl.int64) * (C // 16) + scols[None, :], s_full,
             mask=rmask[:, None] & (scols[None, :] < C // 16))


_RULES = {"mse": 0, "mae": 1, "abs_max": 2}


# Tile shapes only change speed, never the numbers: tuned per (width, options) on first use.
_NVFP4_KEYS = ["C", "BLOCK_2D", "FOUR_SIX", "RULE", "STOCHASTIC"]
_nvfp4_1d = triton.autotune(_tile_configs((8, 16, 32), (4, 8)), key=_NVFP4_KEYS)(_nvfp4_quant_kernel)
_nvfp4_2d = triton.autotune(_tile_configs((16,), (4, 8, 16)), key=_NVFP4_KEYS)(_nvfp4_quant_kernel)


def quantize_nvfp4(x: torch.Tensor, block_2d: bool, four_over_six: bool, rule: str, stochastic: bool, seed,
                   amax_t: torch.Tensor | None):
    """seed: an int, or one int64 on x's device (read by the kernel: no host read)."""
    from ...formats.nvfp4 import check_nvfp4_shape

    if rule not in _RULES:
        raise ValueError(f"four_over_six rule must be one of {tuple(_RULES)}, got {rule!r}")
    check_nvfp4_shape(x.shape, block_2d)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r = x2.shape[0]
    if amax_t is None:
        amax_t = amax(x2)
    packed = torch.empty((r, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((r, k // 16), dtype=torch.float8_e4m3fn, device=x.device)
    seed_ptr = isinstance(seed, torch.Tensor)
    seed_mix = seed.reshape(1) if seed_ptr else (int(seed) * _GOLDEN) & 0xFFFFFFFF
    g_dec = torch.ones((), dtype=torch.float32, device=x.device)
    if r and k:
        args = (x2, amax_t.float().reshape(()).contiguous(), packed, scales, g_dec, r, k, seed_mix)
        opts = dict(BLOCK_2D=block_2d, FOUR_SIX=four_over_six, RULE=_RULES[rule], STOCHASTIC=stochastic,
                    S_GLOBAL=GLOBAL_RANGE, SW_FP8=_INTERPRET, SEED_PTR=seed_ptr)
        if _INTERPRET:
            _nvfp4_quant_kernel[(triton.cdiv(r, 16), triton.cdiv(k // 16, 8))](*args, **opts, ROWS=16, NB=8)
        else:
            kern = _nvfp4_2d if block_2d else _nvfp4_1d
            kern[lambda meta: (triton.cdiv(r, meta["ROWS"]), triton.cdiv(k // 16, meta["NB"]))](*args, **opts, **_EXACT)
    return packed.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // 16), g_dec


@triton.jit
def _nvfp4_dequant_kernel(p_ptr, s_ptr, g_ptr, out_ptr, R, C, ROWS: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    rmask = rows < R
    r64 = rows[:, None].to(tl.int64)
    code = _nibbles(p_ptr, rows, c0, C, ROWS, BC, rmask)
    scols = c0 // 16 + tl.arange(0, BC // 16)
    s = tl.load(s_ptr + r64 * (C // 16) + scols[None, :], mask=rmask[:, None] & (scols[None, :] < C // 16),
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    v = tl.reshape(tl.reshape(_e2m1_decode(code), (ROWS, BC // 16, 16)) * s[:, :, None], (ROWS, BC)) * g
    tl.store(out_ptr + r64 * C + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols[None, :] < C))


def dequantize_nvfp4(packed, block_scale, global_scale, out_dtype):
    check_nvfp4_scales(packed, block_scale)
    k = packed.shape[-1] * 2
    p2 = packed.reshape(-1, k // 2).contiguous()
    r = p2.shape[0]
    out = torch.empty((r, k), dtype=out_dtype, device=packed.device)
    if r and k:
        _nvfp4_dequant_kernel[(triton.cdiv(r, 16), triton.cdiv(k, 256))](
            p2, block_scale.reshape(r, k // 16).contiguous(), global_scale.float().reshape(()).contiguous(), out, r, k,
            ROWS=16, BC=256, **_EXACT, num_warps=4,
        )
    return out.reshape(*packed.shape[:-1], k)
