"""Shared pieces of the Triton quantize kernels: constants, fp32 / FP8 device helpers, amax, autotune tiles.

Every kernel of this package repeats the reference's (surogate_hf.formats) order of fp32 operations;
where the reference divides, the kernel uses the correctly rounded `div_rn` (Triton's plain `/` may
lower to an approximate divide). Under TRITON_INTERPRET=1 (CPU) casts to FP8 are done in integer
arithmetic (SW_FP8), because the interpreter truncates instead of rounding; on the GPU the hardware's
saturating RNE cast is used.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


# ------------------------------------------------------------------ autotune tiles
AUTOTUNE = os.environ.get("SUROGATE_HF_AUTOTUNE", "1") != "0"  # 0: fixed tiles (fast compile, e.g. in tests)


def _tile_configs(rows_options, nb_options):
    if not AUTOTUNE:
        return [triton.Config({"ROWS": 16, "NB": 8}, num_warps=4)]
    return [triton.Config({"ROWS": r, "NB": nb}, num_warps=w) for r in rows_options for nb in nb_options for w in (4, 8)]
