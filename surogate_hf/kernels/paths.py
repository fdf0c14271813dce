"""Which GEMM path a frozen quantized linear takes on CUDA: one decision, callable on CPU.

`plan_gemm(format, m, k, n, dtype, capability)` returns the path the kernels will run for an activation of
m rows times a weight [n, k] (n = out_features, k = in_features), and the reason when it is not a fast one.
The CUDA implementations in registry.py / fp8_gemm.py call exactly this function to choose what they run
(and warn once with its reason when the answer is the reference path); the nn modules reach the kernels
through them, and `Format.gemm_path` / `QuantizedLinear.gemm_path` ask the same question for a layer.
Free of Triton and of any CUDA call, so tests walk the shapes of real models on a CPU machine.

Paths:
  fp8_block_cublaslt   fp8 128x128-block base: 1x128 activation tiles x 128x128 weight blocks through
                       cuBLASLt's block-scaled GEMM; K / N that are not multiples of 128 are zero-padded to
                       them inside the call (HF's ceil-div `weight_scale_inv` already covers the padded
                       blocks, zero codes add nothing, so the result equals the unpadded reference math)
  fused_dequant_gemm   nvfp4 / mxfp4 / nf4 with few tokens: Triton GEMM decoding the packed weight tile by
                       tile into registers (memory-bound regime: reads ~0.5 B/param), masked tails; a forward
                       with at most 64 bf16 tokens on SM90+ runs the extension's few-token kernel instead
                       (csrc/fp4/few_token_gemm.cu, see few_token_kernel)
  dense_decode_cublas  nvfp4 / mxfp4 / nf4 with many tokens: the weight decoded once into a transient dense
                       buffer (exact reference decode, masked tails) and cuBLAS; also the fp8 base linear
                       of a 128x128-block weight of fewer than formats.FP8_WEIGHT_ONLY_MAX_PARAMS elements, at any
                       token count (weight-only by the format's rule: formats.fp8_linear_weight_only)
  reference            the fp32 / dequantize reference math: only where no kernel exists (no CUDA device,
                       a GPU or dtype the kernels do not support)
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from ..formats.fp8 import fp8_linear_weight_only

FP8_BLOCK = "fp8_block_cublaslt"
FUSED = "fused_dequant_gemm"
DENSE = "dense_decode_cublas"
REFERENCE = "reference"
FAST_PATHS = (FP8_BLOCK, FUSED, DENSE)

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
WEIGHT_ONLY = ("nvfp4", "mxfp4", "nf4")

# Token count (rows of x / dy) from which the weight-only GEMMs decode the weight to a transient dense
# buffer and run cuBLAS instead of the fused kernel. Measured on the H100 at 4096x14336 (M = 8192): fused
# 3.4-3.8 ms (~280 TFLOP/s: decoding in the main loop caps it), cuBLAS bf16 1.25 ms (~770 TFLOP/s), the
# decode ~0.06 ms (~1 ps/param, 4.5 B/param of traffic). Per weight element the dense route costs
# ~1 ps + 2M / 770 TFLOP/s and the fused one 2M / 280 TFLOP/s: they cross near M ~ 400, so 512.
# Below it the GEMM is memory-bound and the fused kernel reads 0.5 B/param instead of 4.5.
DENSE_MIN_TOKENS = int(os.environ.get("SUROGATE_HF_DENSE_MIN_TOKENS", "512"))

# Few-token weight-only GEMMs (M <= SPLITK_MAX_TOKENS) split their reduction into chunks of whole
# SPLITK_CHUNK_UNIT columns (a multiple of every Triton K tile), see splitk_plan.
SPLITK_MAX_TOKENS = 64
SPLITK_CHUNK_UNIT = 256


def splitk_plan(m: int, red: int, out_cols: int, sms: int) -> tuple[int, int]:
    """(split, chunk) of the fused weight-only GEMM for m tokens reducing over `red` into [m, out_cols] on a
    GPU of `sms` SMs: split programs per output tile, each over `chunk` (a multiple of SPLITK_CHUNK_UNIT)
    of the reduction, with (split - 1) * chunk < red <= split * chunk. Aims at ~8 programs per SM: one
    4-warp program per SM per 64 output columns streams a weight at a fraction of HBM speed (a 4096x4096
    nvfp4 forward at 16 tokens took 92 us, 0.25x bf16 cuBLAS). Bounded so that the fp32 partials
    (split * m * out_cols * 4 bytes, written and read back, mostly from L2) stay within a quarter of the
    weight's 4-bit codes (red * out_cols / 2 bytes).
    split == 1: the one-pass kernel."""
    if m > SPLITK_MAX_TOKENS or m < 1 or red <= SPLITK_CHUNK_UNIT:
        return 1, red
    units = -(-red // SPLITK_CHUNK_UNIT)
    want = -(-8 * sms // -(-out_cols // 64))
    cap = red // (32 * m)  # split * m * out_cols * 4 <= (red * out_cols / 2) / 4
    split = max(1, min(want, cap, units))
    if split == 1:
        return 1, red
    chunk_units = -(-units // split)
    return -(-units // chunk_units), chunk_units * SPLITK_CHUNK_UNIT


# Token counts up to which the forward of a weight-only format runs the extension's few-token kernel (its m16 token
# tiles take up to 64). Kernel time against the Triton split kernel on Llama-3.1-8B's linears (H200, torch.profiler,
# benchmarks/results/shapes_few_token_64.md): about half at 1-16 tokens, 0.6x at 17-32, 0.6-0.9x at 48-64. (An earlier
# probe reported the 17-64-token tiles 12-14x slower: it timed the op before the extension was loaded, i.e. the op's
# reference path.)
FEW_TOKEN_MAX_TOKENS = 64


def few_token_kernel(fmt: str, m: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None,
                     ext_built: bool, nf4_block: int = 64) -> bool:
    """Whether the forward y = x W^T of a weight-only format takes the extension's few-token kernel
    (surogate::ext_few_token_gemm) rather than the Triton split kernel: m <= FEW_TOKEN_MAX_TOKENS bf16 rows, an SM90+
    GPU (it sums its K splits across a thread-block cluster), K a multiple of 32 (each lane loads 32 codes of a
    row) and NF4 blocks of a power of two >= 32 (bitsandbytes' sizes), with the extension built. The input gradient
    keeps the Triton kernel."""
    return (fmt in WEIGHT_ONLY and 1 <= m <= FEW_TOKEN_MAX_TOKENS and dtype == torch.bfloat16 and ext_built
            and capability is not None and tuple(capability) >= (9, 0) and k % 32 == 0
            and (fmt != "nf4" or (nf4_block >= 32 and nf4_block & (nf4_block - 1) == 0)))


# Within the few-token op (surogate::ext_few_token_gemm), from FEW_TOKEN_WGMMA_MIN_TOKENS a weight of at least
# FEW_TOKEN_WGMMA_MIN_ELEMENTS elements and FEW_TOKEN_WGMMA_MIN_ROWS rows, and from FEW_TOKEN_WGMMA_WIDE_MIN_TOKENS one
# of at least FEW_TOKEN_WGMMA_WIDE_MIN_ELEMENTS, runs the register-operand WGMMA kernel's K-split variant
# (csrc/weight_only/mixed_input_gemm.h: kFewTokenWgmmaMinTokens and the rest, the same rule).
FEW_TOKEN_WGMMA_MIN_TOKENS = 33
FEW_TOKEN_WGMMA_MIN_ELEMENTS = 8 << 20
FEW_TOKEN_WGMMA_MIN_ROWS = 3072
FEW_TOKEN_WGMMA_WIDE_MIN_TOKENS = 17
FEW_TOKEN_WGMMA_WIDE_MIN_ELEMENTS = 48 << 20


def few_token_wgmma(fmt: str, m: int, n: int, k: int, capability: tuple[int, int] | None, sm90a_built: bool) -> bool:
    """Whether a few-token forward (few_token_kernel holds) of an [n, k] weight runs, inside ext_few_token_gemm, the
    register-operand WGMMA kernel (64-token tiles, K split over a thread-block cluster, each weight fragment decoded
    once for all the tokens) rather than the mma kernel (n8 token tiles, each repeating its mmas).
    Measured on the H200 (docs/kernels.md):
    - from 40 tokens, 0.53-0.98x the mma kernel's time on Llama-3.1-8B's q / gate_up / down and Qwen3-1.7B's MLP
      projections; slower on smaller weights;
    - at 33-39 tokens (the mma kernel's six-tile variant) 1.08-1.89x its speed on every eligible weight measured
      (session 35, benchmarks/results/decode/few_tokens_wgmma_from_17_h200.md); at 17-32 tokens 1.10-1.39x on the
      wide MLP weights of Llama-3.1-8B and Qwen2.5-7B (56-65M elements), 0.86-0.99x on the 12-20M-element ones in
      NVFP4 / MXFP4, hence the wide bound;
    - on Qwen3-1.7B's down projection (2048 rows, whose K split leaves about one CTA per SM) 1.18-1.24x the mma
      kernel's time at 40-48 tokens in NVFP4, 1.03-1.07x in NF4 (session 33: 1.14-1.19x), hence the row bound. Its
      value, 3072 since session 33 (4096 before), lets in Qwen2.5-7B's 3584-row q / o and down projections, where the
      WGMMA kernel ran at 1.03-1.30x (q) and 1.47-1.78x (down) the mma kernel's speed at 40-64 tokens in NVFP4 /
      MXFP4, 1.07-1.57x in NF4 (H200, benchmarks/results/decode/few_tokens_mxfp4_rolled_h200.md,
      nf4_rolled_prmt_base_h200.md)."""
    if not (fmt in ("nvfp4", "mxfp4", "nf4") and n >= FEW_TOKEN_WGMMA_MIN_ROWS and m <= FEW_TOKEN_MAX_TOKENS
            and n * k >= FEW_TOKEN_WGMMA_MIN_ELEMENTS and capability is not None and tuple(capability) == (9, 0)
            and sm90a_built):
        return False
    return m >= FEW_TOKEN_WGMMA_MIN_TOKENS or (m >= FEW_TOKEN_WGMMA_WIDE_MIN_TOKENS
                                               and n * k >= FEW_TOKEN_WGMMA_WIDE_MIN_ELEMENTS)


MIXED_INPUT_MIN_TOKENS = 512  # csrc/weight_only/decoded_linear.cpp: kMixedInputMinTokens
MIXED_INPUT_DEFAULT_MAX_TOKENS = 2048  # kMixedInputDefaultMaxTokens
MIXED_INPUT_DEFAULT_MIN_ELEMENTS = 12 << 20  # kMixedInputDefaultMinElements
MIXED_INPUT_WHOLE_K_MIN_ELEMENTS = 4 << 20  # kMixedInputWholeKMinElements: smaller weights whose tiles need no K split
# csrc/weight_only/mixed_input_gemm.h: kMixedInputSpeed, kRouteDecodeTokens, kMixedInputLongFill,
# kMixedInputLongSteps; kMixedInputRows, kMixedInputMaxSplit, kMixedInputMinSplitSteps, kMixedInputMinPairSteps
MIXED_INPUT_SPEED, ROUTE_DECODE_TOKENS, MIXED_INPUT_LONG_FILL, MIXED_INPUT_LONG_STEPS = 0.97, 220, 0.8, 48
MIXED_INPUT_ROWS, MIXED_INPUT_MAX_SPLIT, MIXED_INPUT_MIN_SPLIT_STEPS, MIXED_INPUT_MIN_PAIR_STEPS = 128, 8, 8, 32


def mixed_input_tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(tokens per tile, CTAs per tile) of the mixed-input kernel's launch for m >= 65 rows (mixed_input_tiles in
    csrc/weight_only/mixed_input_gemm.h, which has the rule's measurements; a split's clusters taken to fit, as the
    launcher checks on the device): 256-token tiles unless they would fill at most half the SMs; then K split 2-8 ways
    over a cluster (4x the CTAs, or 2-way with >= 32 stages a CTA, each CTA >= 8 stages); else 128-token tiles."""
    wide = -(-n // MIXED_INPUT_ROWS) * -(-m // 256)
    steps = -(-k // 64)
    if 2 * wide > sms:
        return 256, 1
    for s in range(min(MIXED_INPUT_MAX_SPLIT, steps // MIXED_INPUT_MIN_SPLIT_STEPS), 1, -1):
        if (s >= 4 or steps // s >= MIXED_INPUT_MIN_PAIR_STEPS) and wide * s <= sms:
            return 256, s
    return 128, 1


def mixed_input_fill(m: int, n: int, k: int, sms: int) -> float:
    """The share of the SMs' time the mixed-input kernel's launch keeps busy: its CTAs over whole waves of one per
    SM (mixed_input_fill, mixed_input_gemm.h)."""
    bm, split = mixed_input_tiles(m, n, k, sms)
    ctas = -(-n // MIXED_INPUT_ROWS) * -(-m // bm) * split
    return ctas / (-(-ctas // sms) * sms)


def mixed_input_fast_enough(m: int, n: int, k: int, sms: int) -> bool:
    """The default rule's speed test (mixed_input_fast_enough in csrc/weight_only/mixed_input_gemm.h; the measurements
    are in mixed_input_kernel's docstring): 256-token tiles, and MIXED_INPUT_SPEED x fill x (1 + ROUTE_DECODE_TOKENS /
    m) >= 1, or a fill of >= MIXED_INPUT_LONG_FILL where each CTA runs >= MIXED_INPUT_LONG_STEPS stages."""
    bm, split = mixed_input_tiles(m, n, k, sms)
    if bm != 256:
        return False
    fill = mixed_input_fill(m, n, k, sms)
    run = (-(-k // 64) + split - 1) // split  # stages per CTA
    return (MIXED_INPUT_SPEED * fill * (1 + ROUTE_DECODE_TOKENS / m) >= 1
            or (fill >= MIXED_INPUT_LONG_FILL and run >= MIXED_INPUT_LONG_STEPS))


def mixed_input_kernel(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None,
                       sm90a_built: bool, nf4_block: int = 64, sms: int = 132) -> bool:
    """Whether the decode route's forward base GEMM (surogate::ext_decoded_linear and its graph op) for an [n, k]
    weight and m rows of x, on a GPU of `sms` SMs, is the extension's mixed-input WGMMA kernel
    (csrc/weight_only/mixed_input_gemm.cu, the weight decoded inside the GEMM) rather than a dense decode + cuBLAS.

    It can run for NVFP4, MXFP4 or NF4 (blocks a power of two >= 32 dividing K), >= MIXED_INPUT_MIN_TOKENS bf16 rows,
    K % 32 == 0, on a compute capability 9.0 GPU (WGMMA) with an extension compiled for sm_90a
    (kernels.ext.sm90a_built). Where it can, it is the default for NVFP4 / MXFP4 weights of at least
    MIXED_INPUT_DEFAULT_MIN_ELEMENTS elements at up to MIXED_INPUT_DEFAULT_MAX_TOKENS rows whose 256-token tiles fill
    the GPU well enough: MIXED_INPUT_SPEED x mixed_input_fill x (1 + ROUTE_DECODE_TOKENS / m) >= 1 (on the
    Llama-3.1-8B and Qwen3-1.7B large weights the kernel ran at 0.97x bf16 cuBLAS's speed at full waves, and decode +
    cuBLAS took bf16's time x (1 + 220 / m)). Measured there: 0.97-1.35x decode + cuBLAS's speed (Llama-3.1-8B q / o /
    gate / up / down, Qwen3-1.7B gate / up / down at 512-2048 tokens; H200;
    benchmarks/results/decode/large_m_default_s28_h200.md, docs/kernels.md); the fill leaves out the one loss among
    them (the 1.7B gate / up at 1024 tokens, 0.93x). Where each CTA runs >= MIXED_INPUT_LONG_STEPS stages a fill of
    >= MIXED_INPUT_LONG_FILL is enough: Qwen2.5-7B q / down at 1024-2048 tokens (a fill of 0.85, 56 / 296 stages)
    measured 1.01-1.15x, while shorter runs at such fills (Qwen2.5-1.5B and Gemma-2-2B gate / up at 2048 tokens, 24 /
    36 stages) measured 0.89-0.97x (benchmarks/results/decode/large_m_default_rule_models_h200.md). Weights of
    MIXED_INPUT_WHOLE_K_MIN_ELEMENTS to MIXED_INPUT_DEFAULT_MIN_ELEMENTS pass the same tests where the launch splits
    no K: every such row measured 1.05-1.20x decode + cuBLAS's speed (session 33, H200: the 2048x2048 q projections
    and Gemma-2-2B's q at 2048 tokens, GPT-OSS-20B's q at 1024-2048, Gemma-3-1B's gate / up at 512, Qwen2.5-0.5B's at
    768; benchmarks/results/decode/large_m_whole_k_rule_h200.md), while at 512-1024 tokens, where such weights take
    K-split or 128-token tiles, they measured 0.68-0.93x.
    Elsewhere it measured 0.43-1.18x (smaller weights, 4096 and more rows, NF4), so decode + cuBLAS stays there
    unless SUROGATE_HF_MIXED_INPUT=1 opts every call that can run the kernel in; SUROGATE_HF_MIXED_INPUT=0 turns it
    off. The C++ (mixed_input_applies in csrc/weight_only/decoded_linear.cpp) decides by the same rule, plus 16-byte
    aligned contiguous operands. The input gradient keeps decode + cuBLAS."""
    nf4_ok = nf4_block >= 32 and nf4_block & (nf4_block - 1) == 0 and k % nf4_block == 0
    can_run = (fmt in ("nvfp4", "mxfp4", "nf4") and (fmt != "nf4" or nf4_ok) and m >= MIXED_INPUT_MIN_TOKENS
               and dtype == torch.bfloat16 and k % 32 == 0 and capability is not None and tuple(capability) == (9, 0)
               and sm90a_built)
    choice = os.environ.get("SUROGATE_HF_MIXED_INPUT", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"SUROGATE_HF_MIXED_INPUT={choice!r}: expected 1 (the mixed-input kernel wherever it can "
                         "run), 0 (never: decode + cuBLAS) or unset (the default rule)")
    large = n * k >= MIXED_INPUT_DEFAULT_MIN_ELEMENTS or (
        n * k >= MIXED_INPUT_WHOLE_K_MIN_ELEMENTS and mixed_input_tiles(m, n, k, sms)[1] == 1)
    by_default = (fmt in ("nvfp4", "mxfp4") and MIXED_INPUT_MIN_TOKENS <= m <= MIXED_INPUT_DEFAULT_MAX_TOKENS
                  and large and mixed_input_fast_enough(m, n, k, sms))
    return can_run and (choice == "1" or (choice != "0" and by_default))


_ELEMENT_BLOCK = {"nvfp4": 16, "mxfp4": 32}
_WEIGHT_ONLY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemmPath(NamedTuple):
    path: str  # one of FP8_BLOCK, FUSED, DENSE, REFERENCE
    reason: str  # why the reference path, "" on a fast path
    pad_k: int = 0  # fp8: zero columns added to K (in_features) inside the call
    pad_n: int = 0  # fp8: zero rows added to N (out_features)

    @property
    def fast(self) -> bool:
        return self.path != REFERENCE


def shape_problem(fmt: str, n: int, k: int, nf4_block: int = 64) -> str | None:
    """Why `fmt` cannot hold an [n, k] weight at all (no path, fast or slow, exists), or None."""
    if n < 0 or k < 0:
        return f"weight shape [{n}, {k}]"
    if fmt in _ELEMENT_BLOCK and k % _ELEMENT_BLOCK[fmt]:
        return f"{fmt.upper()} needs in_features % {_ELEMENT_BLOCK[fmt]} == 0, got {k}"
    if fmt == "nf4" and k % nf4_block:
        return f"NF4 needs in_features % {nf4_block} == 0 (its block size), got {k}"
    return None


def fp8_pads(n: int, k: int) -> tuple[int, int]:
    """Zero rows / columns the fp8 block GEMM adds to a [n, k] weight (cuBLASLt's 128x128 blocks)."""
    return -n % 128, -k % 128


@functools.lru_cache(maxsize=8192)
def plan_gemm(fmt: str, m: int, k: int, n: int, dtype: torch.dtype, capability: tuple[int, int] | None, *,
              block_size: tuple[int, int] | None = (128, 128), nf4_block: int = 64, triton: bool = True,
              blockwise_scaled_mm: bool | None = None, dense_min_tokens: int | None = None,
              fp8_weight_only: bool = True) -> GemmPath:
    """The path of y = x W^T (and of its input gradient dy W, which takes the same one) for x [m, k] in
    `dtype`, W [n, k] of format `fmt` on a CUDA device of compute capability `capability` (None: no CUDA
    device). block_size: the fp8 weight blocks (None = one per-tensor scale); nf4_block: NF4 block size;
    triton: whether Triton is importable; blockwise_scaled_mm: whether torch has the block-scaled
    `torch.nn.functional.scaled_mm` (default: this torch). Raises ValueError for a weight the format cannot
    hold. fp8_weight_only: whether a small 128x128-block fp8 weight takes the weight-only dense route (the fp8 base
    linear's rule, formats.fp8_linear_weight_only); the W8A8 ops themselves (surogate::fp8_block_linear, which the
    fp8 recipes call) pass False. Cached: the kernels call it on every GEMM."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    problem = shape_problem(fmt, n, k, nf4_block)
    if problem:
        raise ValueError(problem)
    if capability is None:
        return GemmPath(REFERENCE, "no CUDA device: the reference ops run on CPU tensors")
    cap = tuple(capability)
    if fmt == "fp8":
        if blockwise_scaled_mm is None:
            blockwise_scaled_mm = hasattr(torch.nn.functional, "scaled_mm")
        if block_size is None or tuple(block_size) != (128, 128):
            what = "per-tensor scaling" if block_size is None else f"block size {block_size[0]}x{block_size[1]}"
            return GemmPath(REFERENCE, f"{what} (cuBLASLt block scaling is 128x128)")
        if fp8_weight_only and fp8_linear_weight_only(n, k):
            # the fp8 base linear of a small weight is weight-only: the Triton decode (fp8e4nv loads: SM89+), cuBLAS
            if not triton:
                return GemmPath(REFERENCE, "triton is not installed (pip install triton)")
            if dtype not in _WEIGHT_ONLY_DTYPES:
                return GemmPath(REFERENCE, f"activation dtype {dtype} (needs bf16, fp16 or fp32)")
            if cap < (8, 9):
                return GemmPath(REFERENCE, f"the Triton fp8 decode needs compute capability >= 8.9, this GPU has "
                                           f"{cap[0]}.{cap[1]}")
            return GemmPath(DENSE, "")
        if dtype != torch.bfloat16:
            return GemmPath(REFERENCE, f"activation dtype {dtype} (block-scaled scaled_mm writes bf16)")
        if cap < (9, 0):
            return GemmPath(REFERENCE, f"block-scaled FP8 GEMMs need compute capability >= 9.0, this GPU has "
                                       f"{cap[0]}.{cap[1]}")
        if not blockwise_scaled_mm:
            return GemmPath(REFERENCE, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm "
                                       "(block-scaled FP8 needs torch >= 2.10)")
        pad_n, pad_k = fp8_pads(n, k)
        return GemmPath(FP8_BLOCK, "", pad_k=pad_k, pad_n=pad_n)
    # nvfp4 / mxfp4 / nf4: Triton kernels
    if not triton:
        return GemmPath(REFERENCE, "triton is not installed (pip install triton)")
    if dtype not in _WEIGHT_ONLY_DTYPES:
        return GemmPath(REFERENCE, f"activation dtype {dtype} (needs bf16, fp16 or fp32)")
    need = (8, 0) if dtype == torch.bfloat16 else (7, 0)
    if cap < need:
        return GemmPath(REFERENCE, f"the Triton GEMMs in {dtype} need compute capability >= {need[0]}.{need[1]}, "
                                   f"this GPU has {cap[0]}.{cap[1]}")
    threshold = DENSE_MIN_TOKENS if dense_min_tokens is None else dense_min_tokens
    return GemmPath(DENSE if m >= threshold and m > 0 else FUSED, "")


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


@functools.cache
def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def plan_for(fmt: str, a: torch.Tensor, n: int, k: int, **options) -> GemmPath:
    """plan_gemm for a live activation (x for the forward, dy for the dgrad: m = its rows)."""
    if a.is_cuda:
        dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
        cap = device_capability(dev)
    else:
        cap = None
    m = a.numel() // a.shape[-1] if a.dim() and a.shape[-1] else 0
    return plan_gemm(fmt, m, k, n, a.dtype, cap, triton=_triton_importable(), **options)
