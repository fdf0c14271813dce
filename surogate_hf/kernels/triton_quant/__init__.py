"""Triton quantize / dequantize kernels, bit-exact to surogate_hf.formats.

Imported lazily (first CUDA call of a surogate:: op), never when surogate_hf is imported. Every
kernel repeats the reference's order of fp32 operations; where the reference divides, the kernel
uses the correctly rounded `div_rn` (Triton's plain `/` may lower to an approximate divide).
Under TRITON_INTERPRET=1 (CPU) casts to FP8 are done in integer arithmetic (SW_FP8), because the
interpreter truncates instead of rounding; on the GPU the hardware's saturating RNE cast is used.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ...formats.fp8 import FP8_MAX, fp8_dtype
from ...formats.mxfp4 import check_mxfp4_scales
from ...formats.nvfp4 import check_nvfp4_scales

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_GOLDEN = 0x9E3779B9
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# No multiply-add contraction: the references round every product before the add (4/6 errors,
# dequantize-and-subtract), and an FMA would change the last bit and flip choices.
_EXACT = {} if _INTERPRET else {"enable_fp_fusion": False}
_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


# ------------------------------------------------------------------ shared device helpers
@triton.jit
def _clamp_nan(x, lo, hi):
    """torch.clamp semantics: NaN stays NaN."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: order-preserving for non-negative floats, NaN above inf (so max propagates NaN)."""
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)


@triton.jit
def _e4m3_bits_sw(x):
    """RNE fp32 -> e4m3fn byte in integer arithmetic, for |x| <= 448 or NaN (the interpreter path)."""
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 31) & 1
    a = b & 0x7FFFFFFF
    # normal range (|x| >= 2^-6): round the mantissa to 3 bits, ties to even
    r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = r - (120 << 3)
    # subnormal range: multiples of 2^-9, rounded half-even with the 2^23 magic number
    t = tl.abs(x) * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _to_fp8(x, FP8: tl.constexpr, SW_FP8: tl.constexpr):
    """Cast an already clamped fp32 tensor to the FP8 type FP8 (stored as its own dtype)."""
    if SW_FP8:
        return _e4m3_bits_sw(x).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(FP8)


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


# ------------------------------------------------------------------ amax
@triton.jit
def _amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(out_ptr, tl.max(_abs_bits(x), axis=0))


def amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 amax(|x|) of a contiguous tensor (NaN propagates), as a 0-dim tensor."""
    x = x.contiguous()
    out = torch.zeros((), dtype=torch.int32, device=x.device)
    n = x.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, 4096),)](x, out, n, BLOCK=4096, **_EXACT, num_warps=8)
    return out.view(torch.float32)


# ------------------------------------------------------------------ FP8 per tensor
@triton.jit
def _fp8_tensorwise_kernel(x_ptr, scale_ptr, q_ptr, amax_ptr, n, FP8: tl.constexpr, FMAX: tl.constexpr,
                           SW_FP8: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    q = _to_fp8(_clamp_nan(x * s, -FMAX, FMAX), FP8, SW_FP8)
    tl.store(q_ptr + offs, q, mask=m)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(x), axis=0))


@triton.jit
def _fp8_tensorwise_t_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, R, C, FP8: tl.constexpr, FMAX: tl.constexpr,
                             SW_FP8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Cast [R, C] and write both q [R, C] and q^T [C, R]. The tile is read twice, the second time
    through transposed pointers (an L1/L2 hit), which avoids an in-register transpose. Column tiles of one
    row band run next to each other (benchmarks/tune_fp8_t.py: 32x128 tiles in this order ~5% faster than
    64x64 row-tile order on the H100)."""
    ncb = tl.cdiv(C, BC)
    pid = tl.program_id(0)
    rows = (pid // ncb) * BR + tl.arange(0, BR)
    cols = (pid % ncb) * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
             _to_fp8(_clamp_nan(x * s, -FMAX, FMAX), FP8, SW_FP8), mask=m)
    mt = (cols[:, None] < C) & (rows[None, :] < R)
    xt = tl.load(x_ptr + rows[None, :].to(tl.int64) * C + cols[:, None], mask=mt, other=0.0).to(tl.float32)
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :],
             _to_fp8(_clamp_nan(xt * s, -FMAX, FMAX), FP8, SW_FP8), mask=mt)
    tl.atomic_max(amax_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))


def _check_fp8_target(dtype):
    dtype = fp8_dtype(dtype)
    if _INTERPRET and dtype != torch.float8_e4m3fn:
        raise NotImplementedError("the Triton interpreter path implements the e4m3 cast only")
    return dtype


def quantize_fp8_tensorwise(x: torch.Tensor, scale: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _check_fp8_target(dtype)
    xc = x.contiguous()
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    am = torch.zeros((), dtype=torch.int32, device=x.device)
    n = xc.numel()
    if n:
        _fp8_tensorwise_kernel[(triton.cdiv(n, 4096),)](
            xc, scale.float().reshape(()).contiguous(), q, am, n, FP8=_TL_FP8[dtype], FMAX=FP8_MAX[dtype],
            SW_FP8=_INTERPRET, BLOCK=4096, **_EXACT, num_warps=8,
        )
    return q, am.view(torch.float32)


def quantize_fp8_tensorwise_t(x: torch.Tensor, scale: torch.Tensor, dtype):
    dtype = _check_fp8_target(dtype)
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_tensorwise_t needs a tensor with >= 2 dims, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r, c = x2.shape
    q = torch.empty((r, c), dtype=dtype, device=x.device)
    qt = torch.empty((c, r), dtype=dtype, device=x.device)
    am = torch.zeros((), dtype=torch.int32, device=x.device)
    if r and c:
        _fp8_tensorwise_t_kernel[(triton.cdiv(r, 32) * triton.cdiv(c, 128),)](
            x2, scale.float().reshape(()).contiguous(), q, qt, am, r, c, FP8=_TL_FP8[dtype], FMAX=FP8_MAX[dtype],
            SW_FP8=_INTERPRET, BR=32, BC=128, **_EXACT, num_warps=4,
        )
    return q.reshape(x.shape), qt, am.view(torch.float32)


# ------------------------------------------------------------------ delayed scaling state update
@triton.jit
def _delayed_update_kernel(hist_ptr, scale_ptr, amax_ptr, L, FMAX: tl.constexpr, DIV: tl.constexpr,
                           USE_MAX: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    """One program per role row: sanitize the amax, shift the history right by one (blocks back to front, so a
    block's entries are read before the block below it is written), write the amax in front, rescale."""
    r = tl.program_id(0)
    a = tl.load(amax_ptr + r)
    a = tl.where((a == a) & (tl.abs(a) < float("inf")), a, 0.0)
    row = hist_ptr + r.to(tl.int64) * L
    wmax = a
    for i in tl.static_range(NB):  # NB = cdiv(L, BLOCK) blocks (1 for the default history of 1024)
        offs = (NB - 1 - i) * BLOCK + tl.arange(0, BLOCK)
        m = (offs < L) & (offs >= 1)
        v = tl.load(row + offs - 1, mask=m, other=0.0)  # entries are sanitized amaxes: >= 0, never NaN
        wmax = tl.maximum(wmax, tl.max(v, axis=0))
        # every thread has read its old entry before any thread overwrites one: thread t reads t-1, which thread
        # t-1 writes (seen on the H100 without it: 1 of 6000 entries wrong for L=1500, most_recent)
        tl.debug_barrier()
        tl.store(row + offs, v, mask=m)
    tl.store(row, a)
    w = wmax if USE_MAX else a
    new = tl.math.div_rn(tl.math.div_rn(1.0, w) * FMAX, DIV)  # torch: reciprocal, then * fmax, then / 2^margin
    prev = tl.load(scale_ptr + r)
    tl.store(scale_ptr + r, tl.where((new > 0) & (new < float("inf")), new, prev))


def delayed_scaling_update(history, scale, amax, dtype, margin: int, use_max: bool) -> None:
    fmax = FP8_MAX[fp8_dtype(dtype)]
    n, length = history.shape
    if not (history.is_contiguous() and scale.is_contiguous() and amax.dtype == torch.float32):
        raise ValueError("delayed_scaling_update (Triton): contiguous history / scale and fp32 amax expected")
    if n and length:
        block = min(1024, triton.next_power_of_2(length))
        _delayed_update_kernel[(n,)](history, scale, amax.contiguous(), length, FMAX=float(fmax),
                                     DIV=float(2.0**margin), USE_MAX=bool(use_max), BLOCK=block,
                                     NB=triton.cdiv(length, block), **_EXACT, num_warps=4)


# ------------------------------------------------------------------ FP8 block / tile scaling
@triton.jit
def _block_scale(amax_blk, FMAX: tl.constexpr, UE8M0: tl.constexpr):
    """formats.fp8._block_scales for one block: (scale, scale_inv). The reference's `max / amax`
    (python scalar over tensor) is evaluated by torch as reciprocal(amax) * max: two roundings."""
    pos = amax_blk > 0
    one = tl.full(amax_blk.shape, 1.0, tl.float32)
    scale = tl.where(pos, tl.math.div_rn(one, tl.where(pos, amax_blk, 1.0)) * FMAX, 1.0)
    inv = tl.math.div_rn(tl.full(amax_blk.shape, 1.0, tl.float32), scale)
    if UE8M0:
        # 2^ceil(log2(inv)), inv >= FLT_MIN: exponent field, +1 when any mantissa bit is set
        ib = tl.maximum(inv, 1.1754943508222875e-38).to(tl.int32, bitcast=True)
        e = ((ib >> 23) & 0xFF) + ((ib & 0x7FFFFF) != 0).to(tl.int32)
        inv = (e << 23).to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(tl.full(amax_blk.shape, 1.0, tl.float32), inv)
    return scale, inv


@triton.jit
def _fp8_blocks_kernel(w_ptr, q_ptr, s_ptr, R, C, nkb, FMAX: tl.constexpr, UE8M0: tl.constexpr,
                       SW_FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One (BN x BK) block per program; batch folded into rows by the wrapper (R = batch * N)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BN + tl.arange(0, BN)
    cols = pid_c * BK + tl.arange(0, BK)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(w_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
    ab = tl.max(tl.max(_abs_bits(x), axis=1, keep_dims=True), axis=0, keep_dims=True)  # [1, 1]
    scale, inv = _block_scale(ab.to(tl.float32, bitcast=True), FMAX, UE8M0)
    q = _to_fp8(_clamp_nan(x * scale, -FMAX, FMAX), tl.float8e4nv, SW_FP8)
    tl.store(q_ptr + ptrs, q, mask=m)
    tl.store(s_ptr + pid_r * nkb + pid_c + tl.zeros((1, 1), tl.int32), inv)


def quantize_fp8_blocks(w: torch.Tensor, block_n: int, block_k: int, ue8m0: bool):
    *lead, n, k = w.shape
    if block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"the Triton fp8 block kernel needs power-of-two block sizes, got {block_n}x{block_k}")
    batch = math.prod(lead)
    nb, kb = -(-n // block_n), -(-k // block_k)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((*lead, nb, kb), dtype=torch.float32, device=w.device)
    if n % block_n and batch > 1:
        # blocks must not straddle two matrices of the batch: one launch per matrix
        for i in range(batch):
            qi, si = quantize_fp8_blocks(w.reshape(batch, n, k)[i], block_n, block_k, ue8m0)
            q.view(batch, n, k)[i].copy_(qi)
            s.view(batch, nb, kb)[i].copy_(si)
        return q, s
    wc = w.contiguous()
    if w.numel():
        _fp8_blocks_kernel[(batch * nb, kb)](
            wc, q, s, batch * n, k, kb, FMAX=448.0, UE8M0=ue8m0, SW_FP8=_INTERPRET, BN=block_n, BK=block_k,
            **_EXACT, num_warps=8,
        )
    return q, s


@triton.jit
def _fp8_tiles_kernel(x_ptr, q_ptr, s_ptr, R, C, nkb, s_sr, s_st, FMAX: tl.constexpr, SW_FP8: tl.constexpr,
                      ROWS: tl.constexpr, TILE: tl.constexpr, TPP: tl.constexpr):
    """ROWS rows x TPP tiles of TILE columns per program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tiles = tl.program_id(1) * TPP + tl.arange(0, TPP)
    cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [TPP, TILE]
    m = (rows[:, None, None] < R) & (cols[None, :, :] < C)
    ptrs = rows[:, None, None].to(tl.int64) * C + cols[None, :, :]
    x = tl.load(x_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
    amax_t = tl.max(_abs_bits(x), axis=2).to(tl.float32, bitcast=True)  # [ROWS, TPP]
    scale, inv = _block_scale(amax_t, FMAX, False)
    q = _to_fp8(_clamp_nan(x * scale[:, :, None], -FMAX, FMAX), tl.float8e4nv, SW_FP8)
    tl.store(q_ptr + ptrs, q, mask=m)
    tl.store(s_ptr + rows[:, None].to(tl.int64) * s_sr + tiles[None, :].to(tl.int64) * s_st, inv,
             mask=(rows[:, None] < R) & (tiles[None, :] < nkb))


def quantize_fp8_tiles(x: torch.Tensor, tile: int, scale_colmajor: bool = False):
    """1 x tile scaling along the last dim. With scale_colmajor the [M, K/tile] scale is returned
    as an M-contiguous view (the layout torch's block-scaled scaled_mm wants), same values."""
    if tile & (tile - 1):
        raise ValueError(f"the Triton fp8 tile kernel needs a power-of-two tile, got {tile}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r = x2.shape[0]
    kb = -(-k // tile)
    q = torch.empty((r, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_colmajor:  # written straight into the M-contiguous layout, no extra copy
        s = torch.empty((kb, r), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((r, kb), dtype=torch.float32, device=x.device)
    tpp = max(1, min(4, 512 // tile))
    rows = max(1, 2048 // (tile * tpp))
    if r and k:
        _fp8_tiles_kernel[(triton.cdiv(r, rows), triton.cdiv(kb, tpp))](
            x2, q, s, r, k, kb, s.stride(0), s.stride(1), FMAX=448.0, SW_FP8=_INTERPRET, ROWS=rows, TILE=tile,
            TPP=tpp, **_EXACT, num_warps=4,
        )
    if scale_colmajor:
        return q.reshape(x.shape), s
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], kb)


# ------------------------------------------------------------------ FP8 dequantize
@triton.jit
def _fp8_blocks_dequant_kernel(q_ptr, s_ptr, out_ptr, R, C, nkb, BN: tl.constexpr, BK: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BN + tl.arange(0, BN)
    cols = pid_c * BK + tl.arange(0, BK)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = rows[:, None].to(tl.int64) * C + cols[None, :]
    q = tl.load(q_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + pid_r * nkb + pid_c + tl.zeros((1, 1), tl.int32))
    tl.store(out_ptr + ptrs, (q * s).to(out_ptr.dtype.element_ty), mask=m)


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int, out_dtype):
    *lead, n, k = q.shape
    batch = math.prod(lead)
    nb, kb = -(-n // block_n), -(-k // block_k)
    if tuple(scale_inv.shape[-2:]) != (nb, kb):
        raise ValueError(
            f"fp8 block scale has shape {tuple(scale_inv.shape)}, expected [..., {nb}, {kb}] "
            f"for a weight of shape {tuple(q.shape)} with block size {block_n}x{block_k}"
        )
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if n % block_n and batch > 1:
        for i in range(batch):
            out.view(batch, n, k)[i].copy_(dequantize_fp8_blocks(
                q.reshape(batch, n, k)[i], scale_inv.reshape(batch, nb, kb)[i], block_n, block_k, out_dtype))
        return out
    if q.numel():
        _fp8_blocks_dequant_kernel[(batch * nb, kb)](
            q.contiguous(), scale_inv.float().contiguous(), out, batch * n, k, kb, BN=block_n, BK=block_k, **_EXACT, num_warps=8,
        )
    return out


# ------------------------------------------------------------------ NVFP4
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
                        ROWS: tl.constexpr, NB: tl.constexpr):
    """ROWS rows x NB blocks of 16 columns per program (ROWS = 16 for 2D blocks)."""
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
        u = _hash_uniform(offs, seed_mix)
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


AUTOTUNE = os.environ.get("SUROGATE_HF_AUTOTUNE", "1") != "0"  # 0: fixed tiles (fast compile, e.g. in tests)


def _tile_configs(rows_options, nb_options):
    if not AUTOTUNE:
        return [triton.Config({"ROWS": 16, "NB": 8}, num_warps=4)]
    return [triton.Config({"ROWS": r, "NB": nb}, num_warps=w) for r in rows_options for nb in nb_options for w in (4, 8)]


# Tile shapes only change speed, never the numbers: tuned per (width, options) on first use.
_NVFP4_KEYS = ["C", "BLOCK_2D", "FOUR_SIX", "RULE", "STOCHASTIC"]
_nvfp4_1d = triton.autotune(_tile_configs((8, 16, 32), (4, 8)), key=_NVFP4_KEYS)(_nvfp4_quant_kernel)
_nvfp4_2d = triton.autotune(_tile_configs((16,), (4, 8, 16)), key=_NVFP4_KEYS)(_nvfp4_quant_kernel)


def quantize_nvfp4(x: torch.Tensor, block_2d: bool, four_over_six: bool, rule: str, stochastic: bool, seed: int,
                   amax_t: torch.Tensor | None):
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
    seed_mix = (int(seed) * _GOLDEN) & 0xFFFFFFFF
    g_dec = torch.ones((), dtype=torch.float32, device=x.device)
    if r and k:
        args = (x2, amax_t.float().reshape(()).contiguous(), packed, scales, g_dec, r, k, seed_mix)
        opts = dict(BLOCK_2D=block_2d, FOUR_SIX=four_over_six, RULE=_RULES[rule], STOCHASTIC=stochastic,
                    S_GLOBAL=(256.0 if four_over_six else 448.0) * 6.0, SW_FP8=_INTERPRET)
        if _INTERPRET:
            _nvfp4_quant_kernel[(triton.cdiv(r, 16), triton.cdiv(k // 16, 8))](*args, **opts, ROWS=16, NB=8)
        else:
            kern = _nvfp4_2d if block_2d else _nvfp4_1d
            kern[lambda meta: (triton.cdiv(r, meta["ROWS"]), triton.cdiv(k // 16, meta["NB"]))](*args, **opts, **_EXACT)
    return packed.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // 16), g_dec


@triton.jit
def _nibbles(p_ptr, rows, c0, C, ROWS: tl.constexpr, BC: tl.constexpr, mask_r):
    """Codes [ROWS, BC] of packed bytes (even column in the low nibble), each byte loaded once."""
    pcols = c0 // 2 + tl.arange(0, BC // 2)
    p = tl.load(p_ptr + rows[:, None].to(tl.int64) * (C // 2) + pcols[None, :],
                mask=mask_r[:, None] & (pcols[None, :] < C // 2), other=0)
    return tl.reshape(tl.join(p & 0xF, p >> 4), (ROWS, BC))


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


# ------------------------------------------------------------------ MXFP4
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


# ------------------------------------------------------------------ Hadamard
@triton.jit
def _rht_kernel(x_ptr, sg_ptr, out_ptr, R, C, ROWS: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (NB * 16) + tl.arange(0, NB * 16)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sg = tl.load(sg_ptr + (tl.arange(0, NB * 16) & 15)).to(tl.float32)
    x = x * sg[None, :]
    N: tl.constexpr = ROWS * NB
    # butterfly stages of stride 8, 4, 2, 1: (a, b) -> (a + b, a - b)
    y = tl.reshape(x, (N, 1, 2, 8))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 2, 2, 4))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 4, 2, 2))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 8, 2, 1))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (ROWS, NB * 16)) * 0.25
    tl.store(out_ptr + offs, y, mask=m)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 16:
        raise ValueError(f"the Hadamard transform works on chunks of 16 along the last dim; got shape {tuple(x.shape)}")
    if signs.numel() != 16:
        raise ValueError(f"rht signs must have 16 entries, got shape {tuple(signs.shape)}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r = x2.shape[0]
    out = torch.empty((r, k), dtype=torch.float32, device=x.device)
    if r and k:
        _rht_kernel[(triton.cdiv(r, 16), triton.cdiv(k // 16, 8))](
            x2, signs.float().contiguous(), out, r, k, ROWS=16, NB=8, **_EXACT, num_warps=4)
    return out.reshape(x.shape)


# ------------------------------------------------------------------ byte transpose
@triton.jit
def _transpose_bytes_kernel(x_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """out [C, R] = x [R, C]^T for 1-byte elements; each program writes one [BC, BR] output tile."""
    orows = tl.program_id(0) * BC + tl.arange(0, BC)  # = input columns
    ocols = tl.program_id(1) * BR + tl.arange(0, BR)  # = input rows
    m = (orows[:, None] < C) & (ocols[None, :] < R)
    v = tl.load(x_ptr + ocols[None, :].to(tl.int64) * C + orows[:, None], mask=m, other=0)
    tl.store(out_ptr + orows[:, None].to(tl.int64) * R + ocols[None, :], v, mask=m)


def transpose_2d(x: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of a 2-D tensor of 1-byte elements (fp8 / uint8): torch's strided copy
    of 1-byte dtypes runs at a fraction of the memory bandwidth."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"transpose_2d takes a 2-D tensor of 1-byte elements, got {tuple(x.shape)} {x.dtype}")
    r, c = x.shape
    xc = x.contiguous().view(torch.uint8)
    out = torch.empty((c, r), dtype=torch.uint8, device=x.device)
    if r and c:
        _transpose_bytes_kernel[(triton.cdiv(c, 64), triton.cdiv(r, 64))](xc, out, r, c, BR=64, BC=64, num_warps=4)
    return out.view(x.dtype)
