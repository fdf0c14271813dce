"""The fine-grained FP8 recipe's weight gradient on the FP8 tensor cores (Triton): surogate::fp8_tiles_wgrad.

dW [N, K] = dy^T [N, T] @ x [T, K], both operands E4M3 in 1 x 128 tiles along the tokens (the reduction), each
tile with its own fp32 scale (DeepSeek-V3's wgrad). A K-step of the kernel is one tile: the tensor cores multiply
the E4M3 codes of one 128-token chunk (exact products, fp32 accumulation), and the chunk's partial sum is
promoted into the fp32 accumulator times the two tiles' scales, which is also what keeps Hopper's reduced-precision
FP8 accumulation to 128 terms (DeepGEMM's promotion). The reference (ops.recipe.fp8_tiles_wgrad) dequantizes
every element first and runs one fp32 GEMM: the two differ by fp32 summation order and by where the scales are
applied (per chunk sum here, per element there), nothing else.

Any shape: T need not be a multiple of 128 (the last tile is partial; the quantize kernel scales it by its own
amax, and masked loads read zero codes past T), nor N or K a multiple of the output tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_quant as TQ


@triton.jit
def _fp8_tiles_wgrad_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, N, K, T, NC,
                            BM: tl.constexpr, BN: tl.constexpr, TILE: tl.constexpr):
    """out[n, k] = sum over chunks c of sa[n, c] * sb[k, c] * sum_{t in c} a[n, t] * b[k, t].
    a [N, T], b [K, T]: E4M3, T contiguous; sa [N, NC], sb [K, NC]: fp32 dequant scales, NC contiguous."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < N
    mn = rn < K
    rt = tl.arange(0, TILE)
    a_row = a_ptr + rm[:, None].to(tl.int64) * T
    b_row = b_ptr + rn[:, None].to(tl.int64) * T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for c in range(0, NC):
        t = c * TILE + rt
        mt = t < T
        a = tl.load(a_row + t[None, :], mask=mm[:, None] & mt[None, :], other=0.0)
        b = tl.load(b_row + t[None, :], mask=mn[:, None] & mt[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b))
        sa = tl.load(sa_ptr + rm.to(tl.int64) * NC + c, mask=mm, other=0.0)
        sb = tl.load(sb_ptr + rn.to(tl.int64) * NC + c, mask=mn, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * K + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


TILES = (32, 64, 128)  # tile lengths the kernel takes (an FP8 tensor-core K step is 32)


def fp8_tiles_wgrad(dy: torch.Tensor, x: torch.Tensor, tile: int, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] for dy [T, N] and x [T, K] (high precision): both quantized to E4M3 in 1 x `tile` tiles along T
    (the tile kernel of surogate::quantize_fp8_tiles, on the transposes), then the kernel above."""
    if tile not in TILES:
        raise ValueError(f"fp8_tiles_wgrad: the Triton kernel takes tiles of {TILES} tokens, got {tile}")
    t, n = dy.shape
    k = x.shape[1]
    out = torch.empty((n, k), dtype=out_dtype, device=dy.device)
    if not (t and n and k):
        return out.zero_()
    aq, sa = TQ.quantize_fp8_tiles(dy.t(), tile)  # [N, T] e4m3, [N, NC]
    bq, sb = TQ.quantize_fp8_tiles(x.t(), tile)  # [K, T] e4m3, [K, NC]
    nc = sa.shape[1]
    bm = bn = 128
    _fp8_tiles_wgrad_kernel[(triton.cdiv(n, bm), triton.cdiv(k, bn))](
        aq, bq, sa.contiguous(), sb.contiguous(), out, n, k, t, nc, BM=bm, BN=bn, TILE=tile, num_warps=8, num_stages=3,
    )
    return out
