"""The native extension's ops (csrc/, `surogate::ext_*`): schemas, fakes and reference kernels live here.

The extension (surogate_hf.kernels.ext, built on demand) registers CUDA kernels for these names from C++
(`TORCH_LIBRARY_IMPL(surogate, CUDA, ...)` in csrc/bindings.cpp); without it, or off CUDA, each op runs the
reference below, which states its numerics (on CUDA tensors it says so once: `warns_on_cuda`). Callers in surogate_hf.kernels take these ops only once the extension is
loaded (kernels.ext.load), so the references serve the CPU opcheck tests and a GPU comparison, not a hot path.
The schemas spell `int` (not SymInt) because the C++ kernels take int64_t. They are declared with torch.library's
define/impl rather than custom_op so that a call reaches the C++ kernel with no Python autograd wrapper on the
host path: most run inside autograd Functions and compiled graphs; ext_decoded_linear records its own C++ autograd
node, and ext_decoded_linear_fwd (its twin for compiled graphs) has an autograd that calls ext_decoded_linear_bwd
through the dispatcher, so AOTAutograd traces it: in C++ for CUDA tensors (csrc/weight_only/decoded_linear.cpp,
DecodedLinearFwd), in Python below for the CPU reference and without the extension. ext_fp8_linear (the eager fp8
recipes' training linear) records a C++ autograd node on CUDA too (csrc/fp8/fp8_linear.cpp); its reference here is
the forward alone.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import formats as F
from ._outputs import fresh_outputs
from ._warn import warn_once
from .quant import nvfp4_qdq_fake

NS = "surogate"
TILE = 128
_lib = torch.library.Library(NS, "FRAGMENT")
# torch's ScalingType codes for the 1x128 activation tiles and the 128x128 weight blocks (torch >= 2.10): the only
# pair the block GEMM takes (kernels.fp8_layout re-exports them)
_SCALING = getattr(torch.nn.functional, "ScalingType", None)
RECIPE_1X128 = int(_SCALING.BlockWise1x128.value) if _SCALING is not None else -1
RECIPE_128X128 = int(_SCALING.BlockWise128x128.value) if _SCALING is not None else -1


def warns_on_cuda(fn):
    """A reference kernel of an ext op, saying once per op when it runs on CUDA tensors: there the extension's CUDA
    kernel would have taken the call, so the extension is not loaded in this process and the op runs its far slower
    torch-ops reference (a probe that called an op before loading the extension once timed that reference as the
    kernel). Never a silent slow path."""
    name = fn.__name__.lstrip("_")

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        if any(isinstance(a, Tensor) and a.is_cuda for a in args):
            warn_once(f"ext_reference:{name}", f"surogate::{name} ran its reference kernel (torch ops, far slower) on "
                      "CUDA tensors: the CUDA extension is not loaded in this process. surogate_hf's own callers load "
                      "it first; a direct call needs surogate_hf.kernels.ext.load() (python -m surogate_hf.kernels.build "
                      "builds it)")
        return fn(*args, **kwargs)

    return kernel


_lib.define("ext_fp8_cast_amax(Tensor x, Tensor scale, Tensor(a!) q, Tensor(b!) amax_bits) -> ()")
_lib.define("ext_fp8_cast_transpose_amax(Tensor x, Tensor scale, Tensor(a!) q, Tensor(b!) qt, Tensor(c!) amax_bits) "
            "-> ()")
_lib.define("ext_fp8_quantize_tiles(Tensor x, int row_multiple) -> (Tensor, Tensor)")
_lib.define("ext_transpose_bytes(Tensor x) -> Tensor")
_lib.define("ext_fp8_block_gemm(Tensor x, Tensor w, Tensor w_scales_mm, bool transpose_w, int recipe_a, int recipe_b) "
            "-> Tensor")
_lib.define("ext_nvfp4_amax(Tensor x, Tensor? signs, int axis) -> Tensor")
_lib.define("ext_nvfp4_qdq(Tensor x, Tensor? amax, Tensor? signs, int axis, bool four_over_six, int rule, "
            "bool stochastic, int seed, Tensor? seed_tensor=None) -> (Tensor, Tensor)")
_lib.define("ext_nvfp4_gemm(Tensor a, Tensor b, Tensor ga, Tensor gb, Tensor? bias, ScalarType out_dtype) -> Tensor")
_lib.define("ext_few_token_gemm(Tensor x, Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, int fmt, int n, int k, "
            "int nf4_block) -> Tensor")
_lib.define("ext_mixed_input_gemm(Tensor x, Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, int fmt, int n, "
            "int k, int nf4_block, Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None) "
            "-> Tensor")
_lib.define("ext_dequantize(Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, int fmt, int n, int k, int block, "
            "ScalarType dtype) -> Tensor")
# (nested_*: NF4 double quantization's operands, as the module stores them: decode_reference. The graph ops _fwd /
# _bwd give them no default: inductor passes every defaulted argument by keyword, and a keyword costs the op call's
# argument parsing ~1.5 us more than a positional one, twice per linear and step.)
_lib.define("ext_decoded_linear(Tensor x, Tensor? x_lora, Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, "
            "Tensor? bias, Tensor? lora_a, Tensor? lora_b, float scaling, int fmt, int n, int k, int block, "
            "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None) -> Tensor")
_lib.define("ext_decoded_linear_fwd(Tensor x, Tensor? x_lora, Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, "
            "Tensor? bias, Tensor? lora_a, Tensor? lora_b, float scaling, int fmt, int n, int k, int block, "
            "Tensor? nested_absmax, Tensor? nested_code, Tensor? nested_offset) -> (Tensor, Tensor)")
_lib.define("ext_decoded_linear_bwd(Tensor dy, Tensor? x_lora, Tensor? h, Tensor w, Tensor scales, Tensor? gscale, "
            "Tensor? levels, Tensor? lora_a, Tensor? lora_b, float scaling, int fmt, int n, int k, int block, "
            "bool separate_xl, bool want_x, bool want_xl, bool want_a, bool want_b, Tensor? nested_absmax, "
            "Tensor? nested_code, Tensor? nested_offset) -> (Tensor, Tensor, Tensor, Tensor)")
# The registered-operands twins of the two graph ops: the codes alone, the weight's other operands registered for them
# (register_decode_operands below); n and k state the call's weight for the fakes and the checks.
_lib.define("ext_registered_linear_fwd(Tensor x, Tensor? x_lora, Tensor w, Tensor? bias, Tensor? lora_a, "
            "Tensor? lora_b, float scaling, int n, int k) -> (Tensor, Tensor)")
_lib.define("ext_registered_linear_bwd(Tensor dy, Tensor? x_lora, Tensor? h, Tensor w, Tensor? lora_a, Tensor? lora_b, "
            "float scaling, int n, int k, bool separate_xl, bool want_x, bool want_xl, bool want_a, bool want_b) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("ext_rmsnorm(Tensor x, Tensor weight, float eps, bool gemma, ScalarType out_dtype) -> Tensor")
_lib.define("ext_fp8_linear(Tensor x, Tensor weight, Tensor? bias, Tensor wq, Tensor? wqt, Tensor w_sinv, Tensor? xq, "
            "Tensor? xqt, Tensor x_sinv, Tensor x_scale, Tensor(a!) x_amax_bits, Tensor dy_scale, Tensor dy_amax_bits, "
            "Tensor dy_sinv, bool e5m2_grad, bool fast_accum) -> Tensor")
_lib.define("ext_fp8_scaled_mm(Tensor a, Tensor b, Tensor sa, Tensor sb, Tensor? bias, ScalarType out_dtype, "
            "bool fast_accum) -> Tensor")
NVFP4_RULES = F.nvfp4.FOUR_OVER_SIX_RULES  # the int `rule` of ext_nvfp4_qdq indexes this


@torch.library.impl(f"{NS}::ext_fp8_cast_amax", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_cast_amax(x: Tensor, scale: Tensor, q: Tensor, amax_bits: Tensor) -> None:
    """q = sat_rne(x * scale) written into the preallocated FP8 tensor q (x's numel); amax_bits (int32 [1], the bits
    of a non-negative fp32) becomes max(amax_bits, max|x|) as float bits (NaN propagates)."""
    if q.numel() != x.numel() or amax_bits.numel() != 1 or amax_bits.dtype != torch.int32:
        raise ValueError(f"ext_fp8_cast_amax: q must have x's numel and amax_bits be int32[1]; got q {tuple(q.shape)}, "
                         f"amax_bits {tuple(amax_bits.shape)} {amax_bits.dtype}")
    q.view(-1).copy_(F.cast_to_fp8(x.float().reshape(-1) * scale.float().reshape(()), q.dtype))
    if x.numel():
        a = x.float().abs().amax().reshape(1)
        amax_bits.copy_(torch.maximum(amax_bits.view(torch.float32), a).view(torch.int32))


@torch.library.register_fake(f"{NS}::ext_fp8_cast_amax", lib=_lib)
def _(x, scale, q, amax_bits):
    return None


@torch.library.impl(f"{NS}::ext_fp8_cast_transpose_amax", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_cast_transpose_amax(x: Tensor, scale: Tensor, q: Tensor, qt: Tensor, amax_bits: Tensor) -> None:
    """ext_fp8_cast_amax of the 2-D x [R, C] that also writes q's contiguous transpose into qt [C, R]."""
    if x.dim() != 2 or tuple(q.shape) != tuple(x.shape) or tuple(qt.shape) != (x.shape[1], x.shape[0]):
        raise ValueError(f"ext_fp8_cast_transpose_amax: x must be 2-D, q of its shape and qt of its transposed shape; "
                         f"got x {tuple(x.shape)}, q {tuple(q.shape)}, qt {tuple(qt.shape)}")
    torch.ops.surogate.ext_fp8_cast_amax(x, scale, q, amax_bits)  # (the decorated reference is not a callable)
    qt.copy_(q.t())


@torch.library.register_fake(f"{NS}::ext_fp8_cast_transpose_amax", lib=_lib)
def _(x, scale, q, qt, amax_bits):
    return None


@torch.library.impl(f"{NS}::ext_fp8_quantize_tiles", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_quantize_tiles(x: Tensor, row_multiple: int) -> tuple[Tensor, Tensor]:
    """(q [Mp, K] E4M3, scale_inv [Mp, K/128] fp32 as an Mp-contiguous view) of x [M, K] in 1x128 tiles
    (formats.quantize_fp8_tiles), M padded up to a multiple of row_multiple with zero rows (quantized as zeros,
    scale_inv 1): the operand layout cuBLASLt's block-scaled GEMM reads."""
    if x.dim() != 2 or x.shape[1] % TILE or row_multiple < 1:
        raise ValueError(f"ext_fp8_quantize_tiles: x must be 2-D with a last dim that is a multiple of {TILE} and "
                         f"row_multiple >= 1; got {tuple(x.shape)}, {row_multiple}")
    m = x.shape[0]
    mp = -(-m // row_multiple) * row_multiple
    xp = torch.cat((x, x.new_zeros((mp - m, x.shape[1])))) if mp != m else x
    q, s = F.quantize_fp8_tiles(xp, TILE)
    return q, s.t().contiguous().t()


@torch.library.register_fake(f"{NS}::ext_fp8_quantize_tiles", lib=_lib)
def _(x, row_multiple):
    mp = -(-x.shape[0] // row_multiple) * row_multiple
    return (x.new_empty((mp, x.shape[1]), dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[1] // TILE, mp), dtype=torch.float32).t())


@torch.library.impl(f"{NS}::ext_transpose_bytes", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_transpose_bytes(x: Tensor) -> Tensor:
    """The contiguous transpose of a 2-D tensor of 1-byte elements (FP8 or uint8)."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"ext_transpose_bytes: x must be 2-D with 1-byte elements, got {tuple(x.shape)} {x.dtype}")
    return x.view(torch.uint8).t().contiguous().view(x.dtype)


@torch.library.register_fake(f"{NS}::ext_transpose_bytes", lib=_lib)
def _(x):
    return x.new_empty((x.shape[1], x.shape[0]))


@torch.library.impl(f"{NS}::ext_fp8_block_gemm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_block_gemm(x: Tensor, w: Tensor, w_scales_mm: Tensor, transpose_w: bool, recipe_a: int,
                       recipe_b: int) -> Tensor:
    """y = x @ W^T (forward; x [M, K], w [N, K]) or x @ W (transpose_w, the dgrad; x [M, N]) for an E4M3 weight in
    128x128 blocks, x quantized in 1x128 tiles; fp32 accumulation, one rounding to x's dtype. w_scales_mm: the
    block scales of the operand multiplied (W, or W^T for the dgrad), [blocks, L4] with the block columns padded
    to a multiple of 4 (kernels.fp8_layout.mm_scales). The weight's dims are multiples of 128 (the caller pads)."""
    if (recipe_a, recipe_b) != (RECIPE_1X128, RECIPE_128X128):
        raise ValueError(f"ext_fp8_block_gemm: only 1x128 x 128x128 scaling ({RECIPE_1X128}, {RECIPE_128X128}), "
                         f"got ({recipe_a}, {recipe_b})")
    wk = torch.ops.surogate.ext_transpose_bytes(w) if transpose_w else w  # [N', K'], K' contiguous
    n, k = wk.shape
    if x.dim() != 2 or x.shape[1] != k or n % TILE or k % TILE:
        raise ValueError(f"ext_fp8_block_gemm: x [M, {k}] and a weight with dims that are multiples of {TILE} "
                         f"expected; got x {tuple(x.shape)}, operand {tuple(wk.shape)}")
    ws = w_scales_mm[:, : k // TILE]
    wd = F.dequantize_fp8_blocks(wk, ws, (TILE, TILE), torch.float32)
    xq, xs = F.quantize_fp8_tiles(x, TILE)
    xd = F.dequantize_fp8_tiles(xq, xs, TILE, torch.float32)
    return (xd @ wd.t()).to(x.dtype)


@torch.library.register_fake(f"{NS}::ext_fp8_block_gemm", lib=_lib)
def _(x, w, w_scales_mm, transpose_w, recipe_a, recipe_b):
    return x.new_empty((x.shape[0], w.shape[1] if transpose_w else w.shape[0]))


@torch.library.impl(f"{NS}::ext_fp8_scaled_mm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_scaled_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, bias: Tensor | None, out_dtype: torch.dtype,
                       fast_accum: bool) -> Tensor:
    """surogate::fp8_scaled_mm (a [M, K] @ b [N, K]^T, per-tensor scales, fp32 accumulation, one rounding). The CUDA
    kernel is torch._scaled_mm's own cuBLASLt call with its heuristic answer cached (csrc/fp8/scaled_mm.cpp);
    fast_accum is cuBLASLt's reduced-precision accumulation mode there, which this fp32 reference does not model."""
    return torch.ops.surogate.fp8_scaled_mm(a, b, sa, sb, bias, out_dtype)


@torch.library.register_fake(f"{NS}::ext_fp8_scaled_mm", lib=_lib)
def _(a, b, sa, sb, bias, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.impl(f"{NS}::ext_fp8_linear", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, wq: Tensor, wqt: Tensor | None, w_sinv: Tensor,
                    xq: Tensor | None, xqt: Tensor | None, x_sinv: Tensor, x_scale: Tensor, x_amax_bits: Tensor,
                    dy_scale: Tensor, dy_amax_bits: Tensor, dy_sinv: Tensor, e5m2_grad: bool, fast_accum: bool) -> Tensor:
    """The forward of the eager fp8 recipes' linear (recipes.fp8_hybrid.Fp8LinearFn's delayed-scaling training path):
    y = E4M3(x) @ wq^T * x_sinv * w_sinv + bias, x cast with x_scale (its amax raised into x_amax_bits) unless its
    cast xq is handed over. The CUDA kernel is csrc/fp8/fp8_linear.cpp, whose C++ autograd node also runs the E5M2
    (e5m2_grad) or E4M3 dgrad / wgrad with dy_scale, dy_amax_bits and dy_sinv; this reference has no backward (the
    recipe takes the op only on CUDA with the extension loaded; elsewhere Fp8LinearFn runs)."""
    k = wq.shape[1]
    if xq is None:
        x2d = x.reshape(-1, k)
        xq = torch.empty(x2d.shape, dtype=torch.float8_e4m3fn, device=x.device)
        torch.ops.surogate.ext_fp8_cast_amax(x2d, x_scale, xq, x_amax_bits)
    y = torch.ops.surogate.fp8_scaled_mm(xq, wq, x_sinv, w_sinv, bias, x.dtype)
    return y.reshape(*x.shape[:-1], wq.shape[0])


@torch.library.register_fake(f"{NS}::ext_fp8_linear", lib=_lib)
def _(x, weight, bias, wq, wqt, w_sinv, xq, xqt, x_sinv, x_scale, x_amax_bits, dy_scale, dy_amax_bits, dy_sinv,
      e5m2_grad, fast_accum):
    return x.new_empty((*x.shape[:-1], wq.shape[0]))


@torch.library.impl(f"{NS}::ext_nvfp4_amax", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_nvfp4_amax(x: Tensor, signs: Tensor | None, axis: int) -> Tensor:
    """surogate::nvfp4_amax (the csrc kernel reads a contiguous 2-D x, 16-byte aligned)."""
    return torch.ops.surogate.nvfp4_amax(x, signs, axis)


@torch.library.register_fake(f"{NS}::ext_nvfp4_amax", lib=_lib)
def _(x, signs, axis):
    return x.new_empty((), dtype=torch.float32)


@torch.library.impl(f"{NS}::ext_nvfp4_qdq", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_nvfp4_qdq(x: Tensor, amax: Tensor | None, signs: Tensor | None, axis: int, four_over_six: bool, rule: int,
                   stochastic: bool, seed: int, seed_tensor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """surogate::nvfp4_qdq with the 4/6 rule as its index in NVFP4_RULES (amax None: the operand's own, taken in the
    same call; seed_tensor, one int64 on x's device, read by the kernel in place of seed)."""
    return torch.ops.surogate.nvfp4_qdq(x, amax, signs, axis, four_over_six, NVFP4_RULES[rule], stochastic, seed,
                                        seed_tensor)


@torch.library.register_fake(f"{NS}::ext_nvfp4_qdq", lib=_lib)
def _(x, amax, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor=None):
    return nvfp4_qdq_fake(x, axis)


@torch.library.impl(f"{NS}::ext_nvfp4_gemm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_nvfp4_gemm(a: Tensor, b: Tensor, ga: Tensor, gb: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """cast((a @ b) * (ga * gb) + bias.f32, out_dtype): the NVFP4 GEMM over two nvfp4_qdq operands (bf16 values that
    hold e2m1 * s_blk exactly, ga / gb their decode globals); fp32 accumulation, the globals' product applied once,
    one rounding. The CUDA kernel differs by fp32 summation order only."""
    return F.mm_qdq(a, b, ga, gb, bias, out_dtype)


@torch.library.register_fake(f"{NS}::ext_nvfp4_gemm", lib=_lib)
def _(a, b, ga, gb, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


FEW_TOKEN_FORMATS = ("nvfp4", "mxfp4", "nf4")  # the int `fmt` of ext_few_token_gemm indexes this (DECODE_FORMATS' first 3)


@torch.library.impl(f"{NS}::ext_few_token_gemm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_few_token_gemm(x: Tensor, w: Tensor, scales: Tensor, gscale: Tensor | None, levels: Tensor | None, fmt: int,
                        n: int, k: int, nf4_block: int) -> Tensor:
    """y [M, N] = x [M, K] @ deq(W)^T for a 4-bit weight W [N, K] (fmt indexes FEW_TOKEN_FORMATS), in x's dtype:
    each weight element decoded as the formats' reference does and rounded to x's dtype (NVFP4 without its decode
    global, e2m1 * s_blk, exact), products summed in fp32, the NVFP4 global applied to the fp32 sum, one rounding.
    nvfp4: w uint8 [N, K/2], scales E4M3 [N, K/16], gscale the decode global; mxfp4: scales E8M0 [N, K/32];
    nf4: w bitsandbytes-packed, scales the fp32 absmax of each nf4_block elements, levels its 16 values.
    The CUDA kernel (csrc/fp4/few_token_gemm.cu, 1 <= M <= 64) differs by fp32 summation order only."""
    if fmt not in (0, 1, 2) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"ext_few_token_gemm: fmt 0, 1 or 2 and x [M, {k}] expected, got fmt {fmt}, x {tuple(x.shape)}")
    return _weight_only_gemm_reference(x, w, scales, gscale, levels, fmt, n, k, nf4_block)


def _weight_only_gemm_reference(x, w, scales, gscale, levels, fmt, n, k, nf4_block, nested=None):
    """The weight-only GEMM kernels' numerics (ext_few_token_gemm, ext_mixed_input_gemm)."""
    # (FEW_TOKEN_FORMATS indexes like DECODE_FORMATS) NVFP4 decoded without its global, NF4 rounded to x's dtype
    one = torch.ones((), dtype=torch.float32, device=x.device)
    wd = decode_reference(w, scales, one, levels, fmt, n, k, nf4_block, x.dtype if fmt == 2 else torch.float32,
                          nested).float()
    y = x.float() @ wd.t()
    return (y * gscale.float().reshape(()) if fmt == 0 else y).to(x.dtype)


@torch.library.register_fake(f"{NS}::ext_few_token_gemm", lib=_lib)
def _(x, w, scales, gscale, levels, fmt, n, k, nf4_block):
    return x.new_empty((x.shape[0], n))


@torch.library.impl(f"{NS}::ext_mixed_input_gemm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_mixed_input_gemm(x: Tensor, w: Tensor, scales: Tensor, gscale: Tensor | None, levels: Tensor | None,
                          fmt: int, n: int, k: int, nf4_block: int, nested_absmax: Tensor | None = None,
                          nested_code: Tensor | None = None, nested_offset: Tensor | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ deq(W)^T for an NVFP4 (fmt 0), MXFP4 (fmt 1) or NF4 (fmt 2) weight W [N, K], any M: the
    reference of the many-token kernels (csrc/weight_only/mixed_input_gemm.cu), with ext_few_token_gemm's operands
    and numerics: each element decoded as the reference decodes it (NVFP4 without its decode global, exact; NF4 rounded
    to x's dtype), products summed in fp32, the NVFP4 global applied to the fp32 sum, one rounding. NF4 may come with
    a double-quantized absmax (scales its one-byte codes, plus the nested operands, as ext_decoded_linear takes them).
    The kernels differ by fp32 summation order only."""
    if fmt not in (0, 1, 2) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"ext_mixed_input_gemm: fmt 0 (nvfp4), 1 (mxfp4) or 2 (nf4) and x [M, {k}] expected, got "
                         f"fmt {fmt}, x {tuple(x.shape)}")
    nested = _nested(nested_absmax, nested_code, nested_offset)
    return _weight_only_gemm_reference(x, w, scales, gscale, levels, fmt, n, k, nf4_block, nested)


@torch.library.register_fake(f"{NS}::ext_mixed_input_gemm", lib=_lib)
def _(x, w, scales, gscale, levels, fmt, n, k, nf4_block, nested_absmax=None, nested_code=None, nested_offset=None):
    return x.new_empty((x.shape[0], n))


DECODE_FORMATS = ("nvfp4", "mxfp4", "nf4", "fp8")  # the int `fmt` of ext_dequantize / ext_decoded_linear indexes this


FP32_BYTES = (torch.float32, torch.int32)  # the dtypes an fp32 operand comes in: as such, or as its slot's storage


def _fp32_bytes(t: Tensor | None) -> Tensor | None:
    return t.view(torch.float32) if t is not None and t.dtype == torch.int32 else t


def decode_reference(w: Tensor, scales: Tensor, gscale: Tensor | None, levels: Tensor | None, fmt: int, n: int, k: int,
                     block: int, dtype: torch.dtype, nested: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """The dense [n, k] weight in dtype, by the formats' reference dequantization (fmt indexes DECODE_FORMATS):
    nvfp4 w uint8 [n, k/2], scales E4M3 [n, k/16] (or their bytes), gscale the decode global; mxfp4 scales E8M0
    [n, k/32]; nf4 w bitsandbytes-packed, scales the fp32 absmax of each `block` elements, levels its 16 values, or
    with `nested` (double quantization: the fp32 nested absmax of each 256 blocks, its 256 code values, the offset)
    scales the one-byte absmax codes; fp8 w E4M3 [n, k] (or its bytes), scales the fp32 scale_inv of block x block
    tiles. An fp32 operand may come as its int32 bytes (a quantized module's slot as stored, nn.slots)."""
    gscale, levels = _fp32_bytes(gscale), _fp32_bytes(levels)
    if nested is not None:
        if fmt != 2:
            raise ValueError(f"nested absmax operands are NF4's only, got fmt {fmt}")
        from ..formats.nf4 import nf4_denest_absmax

        scales = nf4_denest_absmax(scales, *(_fp32_bytes(t) for t in nested))
    if fmt == 0:
        s = scales if scales.dtype == torch.float8_e4m3fn else scales.view(torch.float8_e4m3fn)
        return F.dequantize_nvfp4(w.reshape(n, k // 2), s.reshape(n, k // 16), gscale, dtype)
    if fmt == 1:
        return F.dequantize_mxfp4(w.reshape(n, k // 2), scales.reshape(n, k // 32), dtype)
    if fmt == 2:
        from ..formats.nf4 import dequantize_nf4_raw

        return dequantize_nf4_raw(w, scales, levels, block, (n, k), dtype)
    if fmt == 3:
        q = w if w.dtype == torch.float8_e4m3fn else w.view(torch.float8_e4m3fn)
        return F.dequantize_fp8_blocks(q.reshape(n, k), _fp32_bytes(scales).reshape(-(-n // block), -(-k // block)),
                                       (block, block), dtype)
    raise ValueError(f"fmt must index {DECODE_FORMATS}, got {fmt}")


@torch.library.impl(f"{NS}::ext_dequantize", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_dequantize(w: Tensor, scales: Tensor, gscale: Tensor | None, levels: Tensor | None, fmt: int, n: int, k: int,
                    block: int, dtype: torch.dtype) -> Tensor:
    """decode_reference; the CUDA kernel (csrc/weight_only/decode.cu) is bit-identical to it."""
    return decode_reference(w, scales, gscale, levels, fmt, n, k, block, dtype).contiguous()


@torch.library.register_fake(f"{NS}::ext_dequantize", lib=_lib)
def _(w, scales, gscale, levels, fmt, n, k, block, dtype):
    return w.new_empty((n, k), dtype=dtype)


def _decoded_linear_2d(x2, xl2, wd, bias, lora_a, lora_b, scaling):
    """The C++ forward_2d's aten calls: with an adapter its GEMM first, the base GEMM accumulating onto it."""
    dt = x2.dtype
    if lora_a is None:
        return (x2 @ wd.t() if bias is None else torch.addmm(bias.to(dt), x2, wd.t())), None
    h = xl2 @ lora_a.to(dt).t()
    bt = lora_b.to(dt).t()
    y = (torch.addmm(bias.to(dt), h, bt, alpha=scaling) if bias is not None
         else torch.addmm(h.new_zeros(()), h, bt, beta=0, alpha=scaling))
    return torch.addmm(y, x2, wd.t()), h


@torch.library.impl(f"{NS}::ext_decoded_linear", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_decoded_linear(x: Tensor, x_lora: Tensor | None, w: Tensor, scales: Tensor, gscale: Tensor | None,
                        levels: Tensor | None, bias: Tensor | None, lora_a: Tensor | None, lora_b: Tensor | None,
                        scaling: float, fmt: int, n: int, k: int, block: int, nested_absmax: Tensor | None = None,
                        nested_code: Tensor | None = None, nested_offset: Tensor | None = None) -> Tensor:
    """y = x deq(W)^T + bias (+ scaling * h B^T for h = x_lora A^T, x_lora None: x itself; A and B cast to x's dtype),
    in _decoded_linear_2d's aten calls: without an adapter addmm(bias, x, W^T); with one, the adapter's GEMM first
    (addmm(bias, h, B^T, alpha=scaling)) and the base GEMM accumulating onto it. The weight is decode_reference's. Gradients flow to x, x_lora, lora_a and lora_b (cast to their dtypes; the scaling is each
    adapter GEMM's alpha); the weight operands and bias are frozen. The C++ kernels
    (csrc/weight_only/decoded_linear.cpp, forward and backward) run the same aten calls on the CUDA decode."""
    if (lora_a is None) != (lora_b is None) or x.shape[-1] != k:
        raise ValueError(f"ext_decoded_linear: x [..., {k}] and lora_a / lora_b together expected, got x "
                         f"{tuple(x.shape)}, lora_a {lora_a is not None}, lora_b {lora_b is not None}")
    wd = decode_reference(w, scales, gscale, levels, fmt, n, k, block, x.dtype,
                          _nested(nested_absmax, nested_code, nested_offset))
    x2 = x.reshape(-1, k)
    xl2 = x2 if x_lora is None else x_lora.reshape(-1, k)
    y, _ = _decoded_linear_2d(x2, xl2, wd, bias, lora_a, lora_b, scaling)
    return y.reshape(*x.shape[:-1], n)


@torch.library.register_fake(f"{NS}::ext_decoded_linear", lib=_lib)
def _(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block, nested_absmax=None,
      nested_code=None, nested_offset=None):
    return x.new_empty((*x.shape[:-1], n))


def _decoded_linear_setup(ctx, inputs, output):
    x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block, *nested = inputs
    ctx.save_for_backward(x, x_lora, lora_a, lora_b)
    ctx.weight = (w, scales, gscale, levels, fmt, n, k, block)
    ctx.nested = _nested(*(list(nested) + [None] * 3)[:3])
    ctx.scaling = scaling


def _decoded_linear_grads(dy2, xl2, h, w, scales, gscale, levels, lora_a, lora_b, s, fmt, n, k, block, separate_xl,
                          want_x, want_xl, want_a, want_b, nested=None):
    """(dx, dx_lora, dA, dB) on 2-D operands, None where not wanted: the math of the C++ backward (backward_2d).
    xl2 is the adapter's input (x itself unless separate_xl, when its gradient is summed into dx); h = xl2 A^T (None:
    recomputed)."""
    dt = dy2.dtype
    dx = dxl = da = db = dh = None
    if lora_a is not None:
        dh = torch.addmm(dy2.new_zeros(()), dy2, lora_b.to(dt), beta=0, alpha=s)
        if want_a:
            da = (dh.t() @ xl2).to(lora_a.dtype)
        if want_b:
            h = xl2 @ lora_a.to(dt).t() if h is None else h
            db = torch.addmm(dy2.new_zeros(()), dy2.t(), h, beta=0, alpha=s).to(lora_b.dtype)
        if want_xl and separate_xl:
            dxl = dh @ lora_a.to(dt)
    if want_x:
        wd = decode_reference(w, scales, gscale, levels, fmt, n, k, block, dt, nested)
        dx = torch.addmm(dh @ lora_a.to(dt), dy2, wd) if lora_a is not None and not separate_xl else dy2 @ wd
    return dx, dxl, da, db


def _decoded_linear_backward(ctx, dy):
    """The reference backward (CPU, or CUDA without the extension), the math of the C++ one."""
    x, x_lora, lora_a, lora_b = ctx.saved_tensors
    w, scales, gscale, levels, fmt, n, k, block = ctx.weight
    xl2 = (x if x_lora is None else x_lora).reshape(-1, k)
    want = ctx.needs_input_grad
    dx, dxl, da, db = _decoded_linear_grads(dy.reshape(-1, n), xl2, None, w, scales, gscale, levels, lora_a, lora_b,
                                            ctx.scaling, fmt, n, k, block, x_lora is not None, want[0], want[1],
                                            want[7], want[8], ctx.nested)
    dx = None if dx is None else dx.reshape(x.shape)
    dxl = None if dxl is None else dxl.reshape(x_lora.shape)
    return dx, dxl, None, None, None, None, None, da, db, None, None, None, None, None, None, None, None


torch.library.register_autograd(f"{NS}::ext_decoded_linear", _decoded_linear_backward,
                                setup_context=_decoded_linear_setup, lib=_lib)


# ---- the decode + GEMM route inside torch.compile graphs: ext_decoded_linear_fwd / _bwd, one opaque call each way.
# (ext_decoded_linear's autograd is a C++ node that launches kernels, which AOTAutograd's tracing with fake tensors
# cannot run; these two are plain ops, and the forward's autograd, below and as the extension's C++ twin for CUDA
# tensors, calls the backward op: it is traced into the graph. The C++ twin spares a compiled forward the Python
# kernel's crossing per call, ~20 us at a 135M step's widths.)
@torch.library.impl(f"{NS}::ext_decoded_linear_fwd", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_decoded_linear_fwd(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block,
                            nested_absmax=None, nested_code=None, nested_offset=None):
    """(ext_decoded_linear's y, h): h = x_lora A^T in x's dtype, the adapter's [M, r] intermediate that the backward
    takes (empty without an adapter)."""
    nested = _nested(nested_absmax, nested_code, nested_offset)
    if (lora_a is None) != (lora_b is None) or x.shape[-1] != k:
        raise ValueError(f"ext_decoded_linear_fwd: x [..., {k}] and lora_a / lora_b together expected, got x "
                         f"{tuple(x.shape)}, lora_a {lora_a is not None}, lora_b {lora_b is not None}")
    x2 = x.reshape(-1, k)
    xl2 = x2 if x_lora is None else x_lora.reshape(-1, k)
    y, h = _decoded_linear_2d(x2, xl2, decode_reference(w, scales, gscale, levels, fmt, n, k, block, x.dtype, nested),
                              bias, lora_a, lora_b, scaling)
    return y.reshape(*x.shape[:-1], n), (x.new_empty((0,)) if h is None else h)


@torch.library.register_fake(f"{NS}::ext_decoded_linear_fwd", lib=_lib)
def _(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block, nested_absmax=None,
      nested_code=None, nested_offset=None):
    return _graph_fwd_fake(x, lora_a, n)


def _graph_fwd_fake(x, lora_a, n):
    """The graph forward ops' outputs (y, h) as fakes: h [M, r], or empty without an adapter."""
    m = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], n)), (x.new_empty((0,)) if lora_a is None else x.new_empty((m, lora_a.shape[0])))


def _nested(absmax, code, offset):
    """decode_reference's `nested` from the ops' three optional operands (all or none)."""
    given = [t is not None for t in (absmax, code, offset)]
    if any(given) and not all(given):
        raise ValueError("ext_decoded_linear: nested_absmax, nested_code and nested_offset go together")
    return (absmax, code, offset) if all(given) else None


def _empty_or(t, like):
    return like.new_empty((0,)) if t is None else t


@torch.library.impl(f"{NS}::ext_decoded_linear_bwd", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_decoded_linear_bwd(dy, x_lora, h, w, scales, gscale, levels, lora_a, lora_b, scaling, fmt, n, k, block,
                            separate_xl, want_x, want_xl, want_a, want_b, nested_absmax=None, nested_code=None,
                            nested_offset=None):
    """(dx, dx_lora, dA, dB) of ext_decoded_linear_fwd on 2-D gradients ([M, k], [M, k], A's and B's shapes and
    dtypes); an empty tensor (dy's dtype) for each that is not wanted or has no adapter. x_lora: the adapter's input
    (x itself unless separate_xl, when dx also carries the adapter's input gradient)."""
    lora = lora_a is not None
    xl2 = None if x_lora is None else x_lora.reshape(-1, k)
    grads = _decoded_linear_grads(dy.reshape(-1, n), xl2, h, w, scales, gscale, levels, lora_a, lora_b, scaling, fmt,
                                  n, k, block, separate_xl, want_x, want_xl and lora, want_a and lora, want_b and lora,
                                  _nested(nested_absmax, nested_code, nested_offset))
    return tuple(_empty_or(g, dy) for g in grads)


def _graph_bwd_fake(dy, lora_a, lora_b, n, k, separate_xl, want_x, want_xl, want_a, want_b):
    """The graph backward ops' outputs (dx, dx_lora, dA, dB) as fakes: empty where not wanted or without an adapter."""
    m, lora = dy.numel() // n, lora_a is not None
    return (dy.new_empty((m, k) if want_x else (0,)),
            dy.new_empty((m, k) if want_xl and lora and separate_xl else (0,)),
            lora_a.new_empty(lora_a.shape) if want_a and lora else dy.new_empty((0,)),
            lora_b.new_empty(lora_b.shape) if want_b and lora else dy.new_empty((0,)))


@torch.library.register_fake(f"{NS}::ext_decoded_linear_bwd", lib=_lib)
def _(dy, x_lora, h, w, scales, gscale, levels, lora_a, lora_b, scaling, fmt, n, k, block, separate_xl, want_x,
      want_xl, want_a, want_b, nested_absmax=None, nested_code=None, nested_offset=None):
    return _graph_bwd_fake(dy, lora_a, lora_b, n, k, separate_xl, want_x, want_xl, want_a, want_b)


def _decoded_linear_fwd_setup(ctx, inputs, output):
    x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block, *nested = inputs
    nested = (list(nested) + [None] * 3)[:3]
    ctx.mark_non_differentiable(output[1])  # h is the backward's, not the caller's
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x if x_lora is None else x_lora, output[1], w, scales, gscale, levels, lora_a, lora_b,
                          *nested)
    ctx.meta = (x.shape, None if x_lora is None else x_lora.shape, scaling, fmt, n, k, block)


def _decoded_linear_fwd_backward(ctx, dy, _dh):
    xl, h, w, scales, gscale, levels, lora_a, lora_b, *nested = ctx.saved_tensors
    x_shape, xl_shape, scaling, fmt, n, k, block = ctx.meta
    want = ctx.needs_input_grad
    none = (None,) * 17
    if dy is None:
        return none
    separate = xl_shape is not None
    lora = lora_a is not None
    dx, dxl, da, db = ext_decoded_linear_bwd(
        dy.contiguous(), xl if lora else None, h if lora else None, w, scales, gscale, levels, lora_a, lora_b, scaling,
        fmt, n, k, block, separate, want[0], want[1], want[7], want[8], *nested)
    return (dx.reshape(x_shape) if want[0] else None, dxl.reshape(xl_shape) if separate and want[1] and lora else None,
            None, None, None, None, None, da if want[7] and lora else None, db if want[8] and lora else None,
            None, None, None, None, None, None, None, None)


torch.library.register_autograd(f"{NS}::ext_decoded_linear_fwd", _decoded_linear_fwd_backward,
                                setup_context=_decoded_linear_fwd_setup, lib=_lib)


# ---- the registered-operands route (ext_registered_linear_fwd / _bwd): a compiled graph hands each linear's op its
# codes alone. Every frozen operand a graph takes crosses it three times a step (a forward input, a forward output saved
# for the backward, a backward input: host work per tensor; through the Trainer with CUDA graphs it measured no gain,
# docs/kernels.md), so a layer registers its decode operands here once per load or move (surogate_hf.nn.linear) and
# the ops find them by the codes' address. The
# registry holds the operands (views of the layer's own slots: no copy), so an address stays theirs while registered;
# the extension keeps a C++ twin of it for its CUDA kernels (csrc/weight_only/decoded_linear.cpp).
# (device, codes' data_ptr) -> (w, scales, gscale, levels, fmt, n, k, block, nested)
REGISTERED_DECODE_OPERANDS: dict[tuple[str, int], tuple] = {}


def decode_registry_key(w: Tensor) -> tuple[str, int]:
    return str(w.device), w.data_ptr()


def register_decode_operands(operands: tuple) -> tuple[str, int]:
    """Register (w, scales, gscale, levels, fmt, n, k, block, nested) (kernels.registry.decode_operands' tuple and the
    nested operands or None) for the registered graph ops, here and, for CUDA operands, in the extension (now if it is
    loaded, else when it loads: sync_decode_registry). Returns the key release_decode_operands takes."""
    key = decode_registry_key(operands[0])
    REGISTERED_DECODE_OPERANDS[key] = tuple(operands)
    if operands[0].is_cuda and _extension_registry() is not None:
        _set_in_extension(operands)
    return key


def _extension_registry():
    """The extension's ext_decode_registry_set op, or None before the extension is loaded (sync_decode_registry then
    hands it every CUDA registration when it loads)."""
    try:
        return torch.ops.surogate.ext_decode_registry_set
    except (AttributeError, RuntimeError):
        return None


def _set_in_extension(operands) -> None:
    w, scales, gscale, levels, fmt, n, k, block, nested = operands
    torch.ops.surogate.ext_decode_registry_set(w, scales, gscale, levels, fmt, n, k, block,
                                               *(nested or (None, None, None)))


def sync_decode_registry() -> None:
    """Hand the just-loaded extension every CUDA registration made before it loaded (kernels.ext.load calls it)."""
    for key, operands in REGISTERED_DECODE_OPERANDS.items():
        if key[0].startswith("cuda"):
            _set_in_extension(operands)


def release_decode_operands(key: tuple[str, int]) -> None:
    """Drop what register_decode_operands registered under key (nothing if absent)."""
    if REGISTERED_DECODE_OPERANDS.pop(key, None) is not None and key[0].startswith("cuda"):
        if _extension_registry() is not None:
            torch.ops.surogate.ext_decode_registry_release(key[1])


def registered_operands(w: Tensor, n: int, k: int, who: str) -> tuple:
    """The operands registered for codes w, checked against the call's [n, k]; a clear error where there are none."""
    operands = REGISTERED_DECODE_OPERANDS.get(decode_registry_key(w))
    if operands is None:
        raise RuntimeError(f"{who}: no decode operands are registered for these codes (a quantized layer's slots "
                           "replaced after the graph was compiled, outside loading and moving the layer: call its "
                           "slots_loaded(), or torch._dynamo.reset())")
    # (Tensor.numel: a slot's PackedParameter counts the weights it represents in its own numel)
    if operands[5] != n or operands[6] != k or Tensor.numel(operands[0]) != Tensor.numel(w):
        raise RuntimeError(f"{who}: the operands registered for these codes are of a [{operands[5]}, {operands[6]}] "
                           f"weight, the call's is [{n}, {k}]")
    return operands


def _registered_args(operands) -> tuple:
    """ext_decoded_linear_fwd's weight operands (w, scales, gscale, levels) and constants (fmt, n, k, block, nested
    x3) from a registered tuple."""
    w, scales, gscale, levels, fmt, n, k, block, nested = operands
    return (w, scales, gscale, levels), (fmt, n, k, block, *(nested or (None, None, None)))


@torch.library.impl(f"{NS}::ext_registered_linear_fwd", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_registered_linear_fwd(x, x_lora, w, bias, lora_a, lora_b, scaling, n, k):
    """ext_decoded_linear_fwd over the operands registered for the codes w (its reference kernel: a CPU call)."""
    weight, (fmt, n_, k_, block, *nested) = _registered_args(registered_operands(w, n, k, "ext_registered_linear_fwd"))
    return ext_decoded_linear_fwd(x, x_lora, *weight, bias, lora_a, lora_b, scaling, fmt, n_, k_, block, *nested)


@torch.library.register_fake(f"{NS}::ext_registered_linear_fwd", lib=_lib)
def _(x, x_lora, w, bias, lora_a, lora_b, scaling, n, k):
    return _graph_fwd_fake(x, lora_a, n)


@torch.library.impl(f"{NS}::ext_registered_linear_bwd", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_registered_linear_bwd(dy, x_lora, h, w, lora_a, lora_b, scaling, n, k, separate_xl, want_x, want_xl, want_a,
                               want_b):
    """ext_decoded_linear_bwd over the operands registered for the codes w."""
    weight, (fmt, n_, k_, block, *nested) = _registered_args(registered_operands(w, n, k, "ext_registered_linear_bwd"))
    return ext_decoded_linear_bwd(dy, x_lora, h, *weight, lora_a, lora_b, scaling, fmt, n_, k_, block, separate_xl,
                                  want_x, want_xl, want_a, want_b, *nested)


@torch.library.register_fake(f"{NS}::ext_registered_linear_bwd", lib=_lib)
def _(dy, x_lora, h, w, lora_a, lora_b, scaling, n, k, separate_xl, want_x, want_xl, want_a, want_b):
    return _graph_bwd_fake(dy, lora_a, lora_b, n, k, separate_xl, want_x, want_xl, want_a, want_b)


def _registered_linear_fwd_setup(ctx, inputs, output):
    x, x_lora, w, bias, lora_a, lora_b, scaling, n, k = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x if x_lora is None else x_lora, output[1], w, lora_a, lora_b)
    ctx.meta = (x.shape, None if x_lora is None else x_lora.shape, scaling, n, k)


def _registered_linear_fwd_backward(ctx, dy, _dh):
    xl, h, w, lora_a, lora_b = ctx.saved_tensors
    x_shape, xl_shape, scaling, n, k = ctx.meta
    want = ctx.needs_input_grad
    if dy is None:
        return (None,) * 9
    separate, lora = xl_shape is not None, lora_a is not None
    dx, dxl, da, db = ext_registered_linear_bwd(
        dy.contiguous(), xl if lora else None, h if lora else None, w, lora_a, lora_b, scaling, n, k, separate,
        want[0], want[1], want[4], want[5])
    return (dx.reshape(x_shape) if want[0] else None, dxl.reshape(xl_shape) if separate and want[1] and lora else None,
            None, None, da if want[4] and lora else None, db if want[5] and lora else None, None, None, None)


torch.library.register_autograd(f"{NS}::ext_registered_linear_fwd", _registered_linear_fwd_backward,
                                setup_context=_registered_linear_fwd_setup, lib=_lib)


# ---- FusedRMSNorm's eager CUDA path (csrc/norm): one op forward, its backward a C++ autograd node
def _rmsnorm_reference(x, weight, eps, gemma, out_dtype):
    from ..recipes.norm import rmsnorm_reference  # (the formulas live there; recipes imports ops)

    return rmsnorm_reference(x, weight, eps, "gemma" if gemma else "llama", out_dtype)


@torch.library.impl(f"{NS}::ext_rmsnorm", "CompositeExplicitAutograd", lib=_lib)
@warns_on_cuda
@fresh_outputs
def _ext_rmsnorm(x: Tensor, weight: Tensor, eps: float, gemma: bool, out_dtype: torch.dtype) -> Tensor:
    """recipes.norm.rmsnorm_reference (the transformers formula, "gemma" or "llama"), then out_dtype (x's dtype or
    fp32). The CUDA kernels (csrc/norm/rmsnorm.cu) differ only in the order of the row and column sums."""
    return _rmsnorm_reference(x, weight, eps, gemma, out_dtype)


@torch.library.register_fake(f"{NS}::ext_rmsnorm", lib=_lib)
def _(x, weight, eps, gemma, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, eps, gemma, out_dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (eps, gemma, out_dtype)


def _rmsnorm_backward(ctx, dy):
    """The reference backward (CPU, or CUDA without the extension): autograd through the reference formula."""
    x, weight = ctx.saved_tensors
    want_x, want_w = ctx.needs_input_grad[:2]
    with torch.enable_grad():
        xr, wr = x.detach().requires_grad_(want_x), weight.detach().requires_grad_(want_w)
        y = _rmsnorm_reference(xr, wr, *ctx.args)
        inputs = [t for t, want in ((xr, want_x), (wr, want_w)) if want]
        grads = iter(torch.autograd.grad(y, inputs, dy) if inputs else ())
    return (next(grads) if want_x else None), (next(grads) if want_w else None), None, None, None


torch.library.register_autograd(f"{NS}::ext_rmsnorm", _rmsnorm_backward, setup_context=_rmsnorm_setup, lib=_lib)


ext_fp8_cast_amax = torch.ops.surogate.ext_fp8_cast_amax.default
ext_fp8_cast_transpose_amax = torch.ops.surogate.ext_fp8_cast_transpose_amax.default
ext_fp8_quantize_tiles = torch.ops.surogate.ext_fp8_quantize_tiles.default
ext_transpose_bytes = torch.ops.surogate.ext_transpose_bytes.default
ext_fp8_block_gemm = torch.ops.surogate.ext_fp8_block_gemm.default
ext_nvfp4_amax = torch.ops.surogate.ext_nvfp4_amax.default
ext_nvfp4_qdq = torch.ops.surogate.ext_nvfp4_qdq.default
ext_nvfp4_gemm = torch.ops.surogate.ext_nvfp4_gemm.default
ext_few_token_gemm = torch.ops.surogate.ext_few_token_gemm.default
ext_mixed_input_gemm = torch.ops.surogate.ext_mixed_input_gemm.default
ext_dequantize = torch.ops.surogate.ext_dequantize.default
ext_decoded_linear = torch.ops.surogate.ext_decoded_linear.default
ext_decoded_linear_fwd = torch.ops.surogate.ext_decoded_linear_fwd.default
ext_decoded_linear_bwd = torch.ops.surogate.ext_decoded_linear_bwd.default
ext_registered_linear_fwd = torch.ops.surogate.ext_registered_linear_fwd.default
ext_registered_linear_bwd = torch.ops.surogate.ext_registered_linear_bwd.default
ext_rmsnorm = torch.ops.surogate.ext_rmsnorm.default
ext_fp8_scaled_mm = torch.ops.surogate.ext_fp8_scaled_mm.default
ext_fp8_linear = torch.ops.surogate.ext_fp8_linear.default
