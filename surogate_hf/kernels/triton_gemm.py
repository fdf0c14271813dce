"""Weight-only dequantize-GEMM kernels (Triton) for the nvfp4, mxfp4 and nf4 frozen bases.

Forward y = x W^T and input gradient dx = dy W with W stored packed: each program decodes the
weight tile it needs into registers (never a dense weight in memory) and feeds the tensor cores in
x's dtype with fp32 accumulation. The decoded weight element is bit-identical to the reference
dequantization (surogate_hf.formats, rounded to x's dtype), so the products differ from the
reference op only by the order of the fp32 accumulation.

Few tokens (M <= 64, the memory-bound regime) split the reduction as well (`_wo_linear_splitk`): one
output tile per program leaves most SMs idle on a weight of a few thousand rows (a 4096x4096 nvfp4 weight
took 92 us, 0.25x bf16 cuBLAS, on the H100), so the reduction is cut into chunks, each program writes an
fp32 partial, and `_splitk_sum` adds them in a fixed order (deterministic).

Large token counts take another route (`dense_gemm`): the weight is decoded once into a transient
dense buffer in x's dtype (the exact reference decode, ~2.5 TB/s) and the GEMM runs in cuBLAS; the
buffer is freed when the call returns. Which route, and whether a kernel applies at all, is decided
by kernels.paths.plan_gemm (see `DENSE_MIN_TOKENS` there for where the switch is).

Any shape the format allows: K a multiple of the element block (16 nvfp4, 32 mxfp4, the NF4 block),
any N and M. Tiles past the edges are masked (packed bytes and scales load as zero codes, which decode
to 0; x / dy load as 0), so a tail never changes a product.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import paths
from . import triton_quant as TQ
from .triton_quant import _e2m1_decode, _e8m0_to_f32

NVFP4, MXFP4, NF4 = 0, 1, 2
FORMAT_IDS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "nf4": NF4}


@triton.jit
def _e2m1_bf16(code):
    """E2M1 code -> bf16 value, built as 16-bit patterns (no float arithmetic)."""
    c = code.to(tl.int32)
    m = c & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 7) | ((m & 1) << 6), tl.where(m == 1, 126 << 7, 0))
    bits = bits | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e8m0_bf16(b):
    """E8M0 byte -> bf16 power of two (bf16 shares fp32's exponent field); 0 -> 2^-127, 255 -> NaN."""
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 1 << 6, b << 7)
    bits = tl.where(b == 255, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nf4_value(c, code_ptr):
    """NF4 code -> fp32 level through a 4-level select tree (a gather from memory per element is
    far slower); the 16 levels are scalar loads that stay in L1."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    b3 = (c & 8) != 0
    l0 = tl.where(b0, tl.load(code_ptr + 1), tl.load(code_ptr + 0))
    l1 = tl.where(b0, tl.load(code_ptr + 3), tl.load(code_ptr + 2))
    l2 = tl.where(b0, tl.load(code_ptr + 5), tl.load(code_ptr + 4))
    l3 = tl.where(b0, tl.load(code_ptr + 7), tl.load(code_ptr + 6))
    l4 = tl.where(b0, tl.load(code_ptr + 9), tl.load(code_ptr + 8))
    l5 = tl.where(b0, tl.load(code_ptr + 11), tl.load(code_ptr + 10))
    l6 = tl.where(b0, tl.load(code_ptr + 13), tl.load(code_ptr + 12))
    l7 = tl.where(b0, tl.load(code_ptr + 15), tl.load(code_ptr + 14))
    m0 = tl.where(b1, l1, l0)
    m1 = tl.where(b1, l3, l2)
    m2 = tl.where(b1, l5, l4)
    m3 = tl.where(b1, l7, l6)
    n0 = tl.where(b2, m1, m0)
    n1 = tl.where(b2, m3, m2)
    return tl.where(b3, n1, n0)


@triton.jit
def _decode_tile(p_ptr, s_ptr, g_ptr, code_ptr, rows, c0, NW, KW, FMT: tl.constexpr, NF4_BS: tl.constexpr,
                 R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr, FAST: tl.constexpr):
    """Dense [R, C] tile (in OUT dtype) of the packed weight at rows x [c0, c0 + C); W is [NW, KW].

    Rows >= NW and columns >= KW read as zero bytes / zero scales and decode to 0 (KW is a multiple of
    the format's scale block, so a block is either wholly inside or wholly outside).
    Exact paths: the element equals the reference dequantization rounded to OUT. FAST (bf16 out,
    nvfp4 / mxfp4): e2m1 x block scale is exact in bf16 and built from bit patterns; for nvfp4 the
    global scale is then applied to the fp32 accumulator by the caller instead of per element.
    """
    r64 = rows[:, None].to(tl.int64)
    rmask = rows[:, None] < NW
    pcols = c0 // 2 + tl.arange(0, C // 2)
    p = tl.load(p_ptr + r64 * (KW // 2) + pcols[None, :], mask=rmask & (pcols[None, :] < KW // 2), other=0)
    if FMT == 2:
        # bitsandbytes: the even element sits in the HIGH nibble
        codes = tl.reshape(tl.join(p >> 4, p & 0xF), (R, C))
    else:
        codes = tl.reshape(tl.join(p & 0xF, p >> 4), (R, C))
    if FMT == 0:
        scols = c0 // 16 + tl.arange(0, C // 16)
        smask = rmask & (scols[None, :] < KW // 16)
        # no `other` for an fp8 load (the interpreter cannot cast one): masked scales are zeroed after the cast
        s8 = tl.load(s_ptr + r64 * (KW // 16) + scols[None, :], mask=smask)
        if FAST:
            sb16 = tl.where(smask, s8.to(tl.bfloat16), 0.0).to(tl.bfloat16)
            v = tl.reshape(_e2m1_bf16(codes), (R, C // 16, 16)) * sb16[:, :, None]
            w = tl.reshape(v, (R, C))
        else:
            g = tl.load(g_ptr)
            v = tl.reshape(_e2m1_decode(codes), (R, C // 16, 16)) * tl.where(smask, s8.to(tl.float32), 0.0)[:, :, None]
            w = tl.reshape(v, (R, C)) * g
    elif FMT == 1:
        scols = c0 // 32 + tl.arange(0, C // 32)
        sb = tl.load(s_ptr + r64 * (KW // 32) + scols[None, :], mask=rmask & (scols[None, :] < KW // 32), other=127)
        if FAST:
            w = tl.reshape(tl.reshape(_e2m1_bf16(codes), (R, C // 32, 32)) * _e8m0_bf16(sb)[:, :, None], (R, C))
        else:
            w = tl.reshape(tl.reshape(_e2m1_decode(codes), (R, C // 32, 32)) * _e8m0_to_f32(sb)[:, :, None], (R, C))
    else:
        # masked bytes decode to NF4 level 0 (-1.0): the masked absmax (0) zeroes them
        vals = _nf4_value(codes, code_ptr)
        if C >= NF4_BS:
            bcols = c0 // NF4_BS + tl.arange(0, C // NF4_BS)
            a = tl.load(s_ptr + r64 * (KW // NF4_BS) + bcols[None, :], mask=rmask & (bcols[None, :] < KW // NF4_BS),
                        other=0.0)
            w = tl.reshape(tl.reshape(vals, (R, C // NF4_BS, NF4_BS)) * a[:, :, None], (R, C))
        else:
            # C < NF4_BS: the tile lies inside one block (c0 < KW, KW % NF4_BS == 0)
            a = tl.load(s_ptr + r64 * (KW // NF4_BS) + c0 // NF4_BS, mask=rmask, other=0.0)  # [R, 1]
            w = vals * a
    return w.to(OUT)


# Tile configs, tuned per (M bucket, N, K, format): few tokens (the memory-bound regime, the fused kernel's
# job) want narrow tiles so that enough programs stream the weight (a 4096-row weight in 128-wide tiles is
# 32 programs on 132 SMs); more tokens want the large tensor-core tiles.
_SMALL_M = ((16, 32, 256, 4, 4), (16, 64, 128, 4, 4), (32, 32, 256, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 3),
            (64, 128, 128, 4, 3))
_LARGE_M = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
            (64, 128, 128, 4, 3))
SMALL_M_BUCKET = 64


def _configs(fwd: bool):
    from .triton_quant import AUTOTUNE

    if not AUTOTUNE:
        return [triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=3)]
    seen, out = set(), []
    for bm, bn, bk, warps, stages in _SMALL_M + _LARGE_M:
        if (bm, bn, bk, warps, stages) not in seen:
            seen.add((bm, bn, bk, warps, stages))
            out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=warps, num_stages=stages))
    return out


def _prune(configs, named_args, **kwargs):
    """Time only the configs meant for this token count's bucket."""
    small = named_args["M_BUCKET"] <= SMALL_M_BUCKET
    keep = [c for c in configs if (c.kwargs["BM"] <= 64) == small or c.kwargs["BM"] == 64]
    return keep or configs


def m_bucket(m: int) -> int:
    """The autotuning key of a token count: its power-of-two ceiling, so training batches of varying length
    reuse one tuned config per bucket instead of re-tuning on every new M."""
    return 1 << max(0, (m - 1).bit_length())


@triton.autotune(configs=_configs(True), key=["M_BUCKET", "N", "K", "FMT", "FAST"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["M_BUCKET"])  # a tuning key only: no compiled variant per bucket
def _wo_linear_fwd(x_ptr, p_ptr, s_ptr, g_ptr, code_ptr, y_ptr, M, N, K, M_BUCKET, FMT: tl.constexpr, NF4_BS: tl.constexpr,
                   IEEE: tl.constexpr, FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[M, N] = x[M, K] @ W[N, K]^T; tails of M, N and K masked."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    # column-major over M inside groups of N tiles: consecutive programs share the weight tile
    pid_n = pid // n_m
    pid_m = pid % n_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mmask[:, None] & (rk[None, :] < K),
                     other=0.0)
        wt = _decode_tile(p_ptr, s_ptr, g_ptr, code_ptr, rn, k0, N, K, FMT, NF4_BS, BN, BK, x_ptr.dtype.element_ty,
                          FAST)
        if IEEE:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    if FAST and FMT == 0:
        acc = acc * tl.load(g_ptr)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & (rn[None, :] < N))


@triton.autotune(configs=_configs(False), key=["M_BUCKET", "N", "K", "FMT", "FAST"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["M_BUCKET"])  # a tuning key only: no compiled variant per bucket
def _wo_linear_dgrad(dy_ptr, p_ptr, s_ptr, g_ptr, code_ptr, dx_ptr, M, N, K, M_BUCKET, FMT: tl.constexpr,
                     NF4_BS: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """dx[M, K] = dy[M, N] @ W[N, K]; BN tiles the output (K), BK the reduction (N); tails masked."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    pid_k = pid // n_m
    pid_m = pid % n_m
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BN + tl.arange(0, BN)
    mmask = rm < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for n0 in tl.range(0, N, BK):
        rn = n0 + tl.arange(0, BK)
        dyt = tl.load(dy_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=mmask[:, None] & (rn[None, :] < N),
                      other=0.0)
        wt = _decode_tile(p_ptr, s_ptr, g_ptr, code_ptr, rn, pid_k * BN, N, K, FMT, NF4_BS, BK, BN,
                          dy_ptr.dtype.element_ty, FAST)
        if IEEE:
            acc = tl.dot(dyt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(dyt, wt, acc)
    if FAST and FMT == 0:
        acc = acc * tl.load(g_ptr)
    tl.store(dx_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mmask[:, None] & (rk[None, :] < K))


# Split-reduction kernels for few tokens: grid (output tiles, SPLIT); program (t, s) reduces over
# [s * CHUNK, (s + 1) * CHUNK) and writes its fp32 partial to ws[s]. paths.splitk_plan picks SPLIT and CHUNK.
# (BN, BK, warps, stages); every BK divides paths.SPLITK_CHUNK_UNIT
_SPLITK = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 2), (128, 128, 4, 3), (32, 256, 4, 2), (64, 64, 4, 4))


def _splitk_configs():
    from .triton_quant import AUTOTUNE

    if not AUTOTUNE:
        return [triton.Config({"BN": 64, "BK": 128}, num_warps=4, num_stages=3)]
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in _SPLITK]


@triton.autotune(configs=_splitk_configs(), key=["M_BUCKET", "N", "K", "FMT", "FAST", "SPLIT", "FWD"])
@triton.jit(do_not_specialize=["M_BUCKET"])
def _wo_linear_splitk(a_ptr, p_ptr, s_ptr, g_ptr, code_ptr, ws_ptr, M, N, K, M_BUCKET, SPLIT, CHUNK,
                      FWD: tl.constexpr, FMT: tl.constexpr, NF4_BS: tl.constexpr, IEEE: tl.constexpr,
                      FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 partial s of a few-token GEMM (M <= BM), over chunk s of the reduction, into ws[s]:
    FWD: ws[s, M, N] = x[:, chunk] @ W[:, chunk]^T (x = a [M, K]); else ws[s, M, K] = dy[:, chunk] @ W[chunk, :]
    (dy = a [M, N]). BN tiles the output columns, BK the reduction; tails masked."""
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    RED = K if FWD else N
    OUT = N if FWD else K
    rm = tl.arange(0, BM)
    ro = pid_o * BN + tl.arange(0, BN)
    mmask = rm < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    r_lo = pid_s * CHUNK
    for r0 in tl.range(r_lo, tl.minimum(r_lo + CHUNK, RED), BK):
        rr = r0 + tl.arange(0, BK)
        at = tl.load(a_ptr + rm[:, None].to(tl.int64) * RED + rr[None, :], mask=mmask[:, None] & (rr[None, :] < RED),
                     other=0.0)
        if FWD:  # W rows = output columns, W columns = this reduction chunk
            wt = _decode_tile(p_ptr, s_ptr, g_ptr, code_ptr, ro, r0, N, K, FMT, NF4_BS, BN, BK,
                              a_ptr.dtype.element_ty, FAST)
            wt = tl.trans(wt)
        else:  # W rows = this reduction chunk, W columns = output columns
            wt = _decode_tile(p_ptr, s_ptr, g_ptr, code_ptr, rr, pid_o * BN, N, K, FMT, NF4_BS, BK, BN,
                              a_ptr.dtype.element_ty, FAST)
        if IEEE:
            acc = tl.dot(at, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(at, wt, acc)
    out = ws_ptr + pid_s.to(tl.int64) * M * OUT + rm[:, None].to(tl.int64) * OUT + ro[None, :]
    tl.store(out, acc, mask=mmask[:, None] & (ro[None, :] < OUT))


@triton.jit
def _splitk_sum(ws_ptr, g_ptr, out_ptr, NUMEL, SPLIT, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out = (sum over s of ws[s]) [* global scale], in a fixed order, cast once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    if SCALE:
        acc = acc * tl.load(g_ptr)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (tests): an H100's count, so the splits run there too
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _nf4_dequant_kernel(p_ptr, a_ptr, code_ptr, out_ptr, N, K, NF4_BS: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Dense [N, K] NF4 decode (the GEMM's own tile decode, exact: fp32 level x fp32 absmax, rounded
    once to the output dtype); edge tiles masked."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    c0 = tl.program_id(1) * C
    w = _decode_tile(p_ptr, a_ptr, p_ptr, code_ptr, rows, c0, N, K, 2, NF4_BS, R, C, out_ptr.dtype.element_ty, False)
    cols = c0 + tl.arange(0, C)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w,
             mask=(rows[:, None] < N) & (cols[None, :] < K))


def dequantize(fmt: int, packed, scale, gscale, code, n: int, k: int, nf4_bs: int, out_dtype) -> torch.Tensor:
    """The dense [n, k] weight in out_dtype, bit-identical to the reference dequantization."""
    if fmt == NVFP4:
        return TQ.dequantize_nvfp4(packed.reshape(n, k // 2), scale, gscale, out_dtype)
    if fmt == MXFP4:
        return TQ.dequantize_mxfp4(packed.reshape(n, k // 2), scale, out_dtype)
    out = torch.empty((n, k), dtype=out_dtype, device=packed.device)
    if n and k:
        _nf4_dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k, 256))](packed, scale, code, out, n, k, NF4_BS=nf4_bs,
                                                                       R=16, C=256, num_warps=4)
    return out


def dense_gemm(fwd: bool, fmt: int, a: torch.Tensor, packed, scale, gscale, code, n: int, k: int, nf4_bs: int):
    """x @ W^T (fwd) or dy @ W through a transient dense W in a's dtype and cuBLAS (fp32 accumulation;
    fp32 inputs stay IEEE fp32 unless the user enabled TF32 matmuls). Like bitsandbytes' 4-bit
    matmul for large inputs: W exists only for this call (allocator-cached, never on the module)."""
    w = dequantize(fmt, packed, scale, gscale, code, n, k, nf4_bs, a.dtype)
    return torch.nn.functional.linear(a, w) if fwd else torch.matmul(a, w)


def _launch(fwd: bool, fmt: int, a: torch.Tensor, packed, scale, gscale, code, n: int, k: int, nf4_bs: int):
    red = k if fwd else n
    out_cols = n if fwd else k
    a2 = a.reshape(-1, red).contiguous()
    m = a2.shape[0]
    out = torch.empty((m, out_cols), dtype=a.dtype, device=a.device)
    if m == 0:
        return out.reshape(*a.shape[:-1], out_cols)
    dummy = packed  # unused pointer slots for formats that do not need them
    g = gscale if gscale is not None else dummy
    c = code if code is not None else dummy
    split, chunk = paths.splitk_plan(m, red, out_cols, _sm_count(a.device))
    if split > 1:
        ws = torch.empty((split, m, out_cols), dtype=torch.float32, device=a.device)
        _wo_linear_splitk[lambda meta: (triton.cdiv(out_cols, meta["BN"]), split)](
            a2, packed.reshape(n, k // 2), scale, g, c, ws, m, n, k, m_bucket(m), split, chunk, FWD=fwd, FMT=fmt,
            NF4_BS=nf4_bs, IEEE=a.dtype == torch.float32, FAST=a.dtype == torch.bfloat16 and fmt != NF4,
            BM=max(16, m_bucket(m)))
        numel = m * out_cols
        _splitk_sum[(triton.cdiv(numel, 1024),)](ws, g, out, numel, split,
                                                 SCALE=a.dtype == torch.bfloat16 and fmt == NVFP4, BLOCK=1024,
                                                 num_warps=4)
        return out if a.dim() == 2 else out.reshape(*a.shape[:-1], out_cols)
    kern = _wo_linear_fwd if fwd else _wo_linear_dgrad

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(out_cols, meta["BN"]),)

    kern[grid](a2, packed.reshape(n, k // 2), scale, g, c, out, m, n, k, m_bucket(m), FMT=fmt, NF4_BS=nf4_bs,
               IEEE=a.dtype == torch.float32, FAST=a.dtype == torch.bfloat16 and fmt != NF4)
    # a 2-D input gets the output itself, not a view of it (callers may accumulate into it in place)
    return out if a.dim() == 2 else out.reshape(*a.shape[:-1], out_cols)


def linear(fmt: int, x, packed, scale, gscale=None, code=None, n: int = 0, k: int = 0, nf4_bs: int = 64):
    return _launch(True, fmt, x, packed, scale, gscale, code, n, k, nf4_bs)


def linear_dgrad(fmt: int, dy, packed, scale, gscale=None, code=None, n: int = 0, k: int = 0, nf4_bs: int = 64):
    return _launch(False, fmt, dy, packed, scale, gscale, code, n, k, nf4_bs)
