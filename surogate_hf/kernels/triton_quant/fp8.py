"""FP8 kernels (formats.fp8): per-tensor casts (also cast + transpose; launched by kernels.triton_recipe, which
kernels.fp8_cast falls back to), the delayed-scaling state update,
block / tile scaling and block dequantization, and the byte transpose the FP8 GEMMs use for weights."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats.fp8 import FP8_MAX, fp8_dtype
from ._common import _EXACT, _INTERPRET, _abs_bits, _clamp_nan, _to_fp8


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
