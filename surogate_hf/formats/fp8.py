"""FP8 E4M3 / E5M2: saturating casts and the three scalings surogate_hf uses.

- per tensor:  q = sat(x * scale), scale = fp8_max / amax * 2^-margin, stored inverse 1/scale;
- 1 x 128 tiles along the last dim (activations of fine-grained FP8 GEMMs);
- 128 x 128 blocks (fine-grained FP8 weights, HF quant_method "fp8", DeepSeek-V3 layout):
  weight_scale_inv[i, j] = amax(block) / 448, q = sat(w * 448 / amax). Edge blocks that do not
  fill 128 rows or columns get their own scale, so no dimension has to be a multiple of 128
  (the stored scale has ceil(N/128) x ceil(K/128) entries, as in DeepSeek-V3 checkpoints).

The formulas follow transformers' own fine-grained FP8 quantizer (multiply by 448/amax, store the
reciprocal), so what we write reads back identically in stock transformers.

The fp8 base linear (a frozen 128x128-block weight of a quantized model): y = x deq(W)^T with x quantized to E4M3
1x128 tiles (W8A8, DeepSeek-V3's and transformers' fine-grained FP8 GEMM), except for weights of fewer than
FP8_WEIGHT_ONLY_MAX_PARAMS elements, where x stays in its own dtype (weight-only: `fp8_linear_weight_only`). The fp8
training recipes ask for FP8 compute and always quantize x.
"""

from __future__ import annotations

import math
import os

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FP8_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}

# Below this many weight elements the FP8 linear keeps its activations in their own dtype (weight-only: the weight
# decoded to bf16, then cuBLAS; no activation quantization error). Per GEMM (H200, CUDA-graph replay,
# benchmarks/results/shapes_fp8_dense.md) the W8A8 route (the activation's tile quantization, padding, cuBLASLt's
# block-scaled GEMM) loses to it below ~4M elements (SmolLM2-135M's linears at 0.24-0.52x of bf16) and pays from there
# (2048 x 2048: 1.07-1.13x). Whole QLoRA steps, since the weight-only route runs as one C++ op with its backward
# (surogate::ext_decoded_linear), set the line higher (H200, bench_e2e.py, ratio to PEFT's bf16 LoRA step, all
# weight-only against this split at 2M): SmolLM2-360M 0.96x vs 0.74x, Qwen2.5-0.5B 1.00x vs 0.94x, Qwen3-1.7B
# 1.29x vs 1.31x (even), Llama-3.1-8B 1.15x vs 1.40x. So: weight-only below 16M elements (Llama-3.1-8B's 4096 x 4096
# and up keep W8A8). A rule of the weight's size only, the same for every token count and device.
FP8_WEIGHT_ONLY_MAX_PARAMS = int(os.environ.get("SUROGATE_HF_FP8_WEIGHT_ONLY_MAX_PARAMS", "16000000"))


def fp8_linear_weight_only(n: int, k: int) -> bool:
    """Whether the fp8 base linear over an [n, k] 128x128-block weight keeps x in its own dtype (else x goes to E4M3
    1x128 tiles)."""
    return n * k < FP8_WEIGHT_ONLY_MAX_PARAMS


def fp8_dtype(name_or_dtype) -> torch.dtype:
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype not in FP8_MAX:
            raise ValueError(f"not an FP8 dtype: {name_or_dtype}; expected float8_e4m3fn or float8_e5m2")
        return name_or_dtype
    try:
        return FP8_DTYPES[str(name_or_dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name_or_dtype!r}; expected 'e4m3' or 'e5m2'") from None


def cast_to_fp8(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """Round-to-nearest-even cast that saturates at +-max (never inf); NaN stays NaN."""
    dtype = fp8_dtype(dtype)
    m = FP8_MAX[dtype]
    return x.float().clamp(-m, m).to(dtype)


def fp8_scale_from_amax(amax: torch.Tensor, dtype=E4M3, margin: int = 0, previous: torch.Tensor | None = None):
    """fp32 scale mapping `amax` onto the format's max, times 2^-margin.

    Zero or non-finite amax keeps `previous` (1.0 when there is none): a cast must never divide by
    zero or inherit a NaN from one bad step.
    """
    dtype = fp8_dtype(dtype)
    # reciprocal-then-multiply is how torch evaluates `max / amax` (two roundings); spelled out so the GPU
    # kernels can match it. amax 0 -> inf, inf -> 0, NaN -> NaN: all fail the range test and keep `previous`.
    scale = amax.float().reciprocal().mul_(FP8_MAX[dtype]).div_(2.0**margin)
    fallback = torch.ones_like(scale) if previous is None else previous.float().expand_as(scale)
    return torch.where((scale > 0) & (scale < float("inf")), scale, fallback)


def quantize_fp8_tensorwise(x: torch.Tensor, dtype=E4M3, scale: torch.Tensor | None = None, margin: int = 0):
    """Per-tensor cast. Returns (q, scale_inv) with x ~= q.float() * scale_inv.

    With `scale` given (delayed scaling) it is used as is; otherwise it is computed from this
    tensor's amax (current scaling).
    """
    dtype = fp8_dtype(dtype)
    if scale is None:
        scale = fp8_scale_from_amax(x.detach().abs().amax(), dtype, margin)
    scale = scale.float()
    q = cast_to_fp8(x.float() * scale, dtype)
    return q, (1.0 / scale)


def _blocked_amax(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """amax over (block_rows x block_cols) blocks of the last two dims, edge blocks partial."""
    *lead, n, k = x.shape
    nb, kb = math.ceil(n / block_rows), math.ceil(k / block_cols)
    pad = (0, kb * block_cols - k, 0, nb * block_rows - n)
    xp = torch.nn.functional.pad(x.float().abs(), pad) if any(pad) else x.float().abs()
    xp = xp.reshape(*lead, nb, block_rows, kb, block_cols)
    return xp.amax(dim=(-3, -1))


def _expand_blocks(s: torch.Tensor, block_rows: int, block_cols: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(block_rows, dim=-2)[..., :n, :].repeat_interleave(block_cols, dim=-1)[..., :k]


def _block_scales(amax: torch.Tensor, dtype, ue8m0: bool):
    """(scale, scale_inv) per block, transformers' convention: scale = max/amax, 1 for zero blocks."""
    m = FP8_MAX[dtype]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, m / safe, torch.ones_like(amax))
    scale_inv = 1.0 / scale
    if ue8m0:
        # Power-of-two inverse scale, rounded up so the block still fits; forward scale its exact reciprocal.
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(scale_inv.clamp(min=torch.finfo(torch.float32).tiny))))
        scale = 1.0 / scale_inv
    return scale, scale_inv


def quantize_fp8_blocks(w: torch.Tensor, block_size=(128, 128), dtype=E4M3, ue8m0: bool = False):
    """Block-scaled cast of the last two dims. Returns (q [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)])."""
    dtype = fp8_dtype(dtype)
    bn, bk = _check_block(block_size)
    n, k = w.shape[-2:]
    scale, scale_inv = _block_scales(_blocked_amax(w, bn, bk), dtype, ue8m0)
    q = cast_to_fp8(w.float() * _expand_blocks(scale, bn, bk, n, k), dtype)
    return q, scale_inv.float()


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block_size=(128, 128), out_dtype=torch.bfloat16):
    bn, bk = _check_block(block_size)
    n, k = q.shape[-2:]
    expect = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape[-2:]) != expect:
        raise ValueError(
            f"fp8 block scale has shape {tuple(scale_inv.shape)}, expected [..., {expect[0]}, {expect[1]}] "
            f"for a weight of shape {tuple(q.shape)} with block size {bn}x{bk}"
        )
    return (q.float() * _expand_blocks(scale_inv.float(), bn, bk, n, k)).to(out_dtype)


def quantize_fp8_tiles(x: torch.Tensor, tile: int = 128, dtype=E4M3):
    """1 x `tile` scaling along the last dim. Returns (q [..., K], scale_inv fp32 [..., ceil(K/tile)])."""
    dtype = fp8_dtype(dtype)
    k = x.shape[-1]
    x2 = x.reshape(-1, 1, k)
    scale, scale_inv = _block_scales(_blocked_amax(x2, 1, tile), dtype, ue8m0=False)
    q = cast_to_fp8(x2.float() * _expand_blocks(scale, 1, tile, 1, k), dtype)
    return q.reshape(x.shape), scale_inv.reshape(*x.shape[:-1], -1).float()


def dequantize_fp8_tiles(q: torch.Tensor, scale_inv: torch.Tensor, tile: int = 128, out_dtype=torch.bfloat16):
    k = q.shape[-1]
    s = scale_inv.float().repeat_interleave(tile, dim=-1)[..., :k]
    return (q.float() * s).to(out_dtype)


def _check_block(block_size) -> tuple[int, int]:
    try:
        bn, bk = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be two positive ints, got {block_size!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block_size must be two positive ints, got {block_size!r}")
    return bn, bk
