"""CUDA implementations of the surogate:: ops, registered with torch.library.register_kernel.

Registration is cheap: each wrapper imports its Triton module (or the native extension) on its
first call, so importing surogate_hf never imports triton. On a CUDA device without Triton the
first call raises one actionable error (`_require_triton`).
"""

from __future__ import annotations

import importlib

import torch

from . import fp8_cast, paths, probe
from . import nvfp4_qdq as _nvfp4_qdq
from ..ops._warn import warn_once
from .fp8_layout import RECIPE_1X128, RECIPE_128X128, mm_scales, pad_columns, pad_weight

NS = "surogate"
_registered = False


def _require_triton():
    ok, why = probe.triton_ok()
    if not ok:
        raise RuntimeError(
            f"surogate_hf's CUDA kernels need Triton: {why}. Install it (`pip install triton`, bundled with "
            "CUDA builds of torch) or run the op on CPU tensors for the reference path."
        )


_modules: dict[str, object] = {}


def _load(name: str):
    # resolved once: these sit on every GEMM call's path (host time is what small layers pay)
    mod = _modules.get(name)
    if mod is None:
        _require_triton()
        mod = _modules[name] = importlib.import_module(name, __package__)
    return mod


def _tq():
    return _load(".triton_quant")


def _tg():
    return _load(".triton_gemm")


def _fp8():
    return _load(".fp8_gemm")


# ---------------------------------------------------------------- quantize / dequantize
def quantize_fp8_tensorwise(x, scale, fp8_dtype):
    # elementwise: any contiguous 2-D view will do, one row keeps empty and 0-dim tensors valid
    am = torch.zeros(1, dtype=torch.int32, device=x.device)
    q, _ = fp8_cast.cast_fp8_into(x.contiguous().reshape(1, -1), _scale_row(scale), am, fp8_dtype, False)
    return q.reshape(x.shape), am.view(torch.float32).reshape(())


def quantize_fp8_tensorwise_t(x, scale, fp8_dtype):
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_tensorwise_t needs a tensor with >= 2 dims, got shape {tuple(x.shape)}")
    am = torch.zeros(1, dtype=torch.int32, device=x.device)
    q, qt = fp8_cast.cast_fp8_into(x.reshape(-1, x.shape[-1]).contiguous(), _scale_row(scale), am, fp8_dtype, True)
    return q.reshape(x.shape), qt, am.view(torch.float32).reshape(())


def _scale_row(scale):
    return scale.float().reshape(1).contiguous()


def delayed_scaling_update(history, scale, amax, fp8_dtype, margin, use_max):
    return _tq().delayed_scaling_update(history, scale, amax.float(), fp8_dtype, margin, use_max)


def quantize_fp8_blocks(w, block_n, block_k, ue8m0):
    return _tq().quantize_fp8_blocks(w, block_n, block_k, ue8m0)


def dequantize_fp8_blocks(q, scale_inv, block_n, block_k, out_dtype):
    return _tq().dequantize_fp8_blocks(q, scale_inv, block_n, block_k, out_dtype)


def quantize_fp8_tiles(x, tile):
    return _tq().quantize_fp8_tiles(x, tile)


def quantize_nvfp4(x, block_2d, four_over_six, rule, stochastic, seed, amax, seed_tensor=None):
    return _tq().quantize_nvfp4(x, block_2d, four_over_six, rule, stochastic, seed if seed_tensor is None else seed_tensor,
                                amax)


def dequantize_nvfp4(packed, block_scale, global_scale, out_dtype):
    return _tq().dequantize_nvfp4(packed, block_scale, global_scale, out_dtype)


def quantize_mxfp4(x):
    return _tq().quantize_mxfp4(x)


def dequantize_mxfp4(packed, scales, out_dtype):
    return _tq().dequantize_mxfp4(packed, scales, out_dtype)


def nvfp4_amax(x, signs, axis):
    return _nvfp4_qdq.amax(x, signs, axis)


def nvfp4_qdq(x, amax, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor=None):
    return _nvfp4_qdq.qdq(x, amax, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor)


def rht(x, signs):
    return _tq().rht(x, signs)


# ---------------------------------------------------------------- quantized-base linears
def fp8_block_linear(x, w, w_scale_inv, block_n, block_k):
    return _fp8().fp8_block_linear(x, w, w_scale_inv, block_n, block_k)


def fp8_block_linear_dgrad(dy, w, w_scale_inv, block_n, block_k):
    return _fp8().fp8_block_linear_dgrad(dy, w, w_scale_inv, block_n, block_k)


def _formats():
    # the fallback decodes with the spec itself (pure torch): it must work where Triton does not
    from .. import formats

    return formats


def _weight_only(op: str, fwd: bool, fmt_name: str, a, n, k, packed, scale, gscale=None, code=None, nf4_bs=64,
                 reference=None):
    plan = paths.plan_for(fmt_name, a, n, k, nf4_block=nf4_bs)
    if plan.path == paths.REFERENCE:
        warn_once(op, f"surogate::{op} dequantizes the weight (reference path): {plan.reason}")
        return reference()
    tg = _tg()
    fmt = tg.FORMAT_IDS[fmt_name]
    if plan.path == paths.DENSE:
        return tg.dense_gemm(fwd, fmt, a, packed, scale, gscale, code, n, k, nf4_bs)
    if fwd:
        y = _few_token_linear(fmt_name, a, packed, scale, gscale, code, n, k, nf4_bs)
        if y is not None:
            return y
    fn = tg.linear if fwd else tg.linear_dgrad
    return fn(fmt, a, packed, scale, gscale, code, n, k, nf4_bs)


_few_token_op = None  # the extension's op once looked up, False when it is not built (looked up once per process)


def _few_token_linear(fmt_name, x, packed, scale, gscale, code, n, k, nf4_bs):
    """x @ deq(W)^T through surogate::ext_few_token_gemm where paths.few_token_kernel says it applies, else None
    (the caller runs the Triton split kernel; where only the missing extension keeps it off, that is said once)."""
    global _few_token_op
    m = x.numel() // k if k else 0
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if not paths.few_token_kernel(fmt_name, m, k, x.dtype, paths.device_capability(dev), True, nf4_bs):
        return None
    if _few_token_op is None:
        from . import ext

        _few_token_op = torch.ops.surogate.ext_few_token_gemm.default if ext.load(build=False) is not None else False
        if _few_token_op is False:
            warn_once("few_token_ext", "surogate_hf: weight-only GEMMs with <= 64 tokens run the Triton split kernel "
                      "(two launches; 1.2-1.7x the time of the extension's few-token kernel on Llama-3.1-8B's "
                      f"linears); the CUDA extension is {ext.status()[1]}")
    operands_ok = (packed.is_contiguous() and packed.data_ptr() % 16 == 0 and scale.is_contiguous()
                   and (code is None or code.is_contiguous()))  # what the kernel reads as flat arrays
    if not (_few_token_op and operands_ok):
        return None
    from ..ops.ext import FEW_TOKEN_FORMATS

    y = _few_token_op(x.reshape(m, k), packed, scale, gscale, code, FEW_TOKEN_FORMATS.index(fmt_name), n, k, nf4_bs)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def nvfp4_linear(x, packed, block_scale, global_scale):
    n, k = packed.shape[0], packed.shape[1] * 2

    def ref():
        return torch.nn.functional.linear(x, _formats().dequantize_nvfp4(packed, block_scale, global_scale, x.dtype))

    return _weight_only("nvfp4_linear", True, "nvfp4", x, n, k, packed, block_scale, global_scale, reference=ref)


def nvfp4_linear_dgrad(dy, packed, block_scale, global_scale):
    n, k = packed.shape[0], packed.shape[1] * 2

    def ref():
        return dy @ _formats().dequantize_nvfp4(packed, block_scale, global_scale, dy.dtype)

    return _weight_only("nvfp4_linear_dgrad", False, "nvfp4", dy, n, k, packed, block_scale, global_scale,
                        reference=ref)


def mxfp4_linear(x, packed, scales):
    n, k = packed.shape[0], packed.shape[1] * 2

    def ref():
        return torch.nn.functional.linear(x, _formats().dequantize_mxfp4(packed, scales, x.dtype))

    return _weight_only("mxfp4_linear", True, "mxfp4", x, n, k, packed, scales, reference=ref)


def mxfp4_linear_dgrad(dy, packed, scales):
    n, k = packed.shape[0], packed.shape[1] * 2

    def ref():
        return dy @ _formats().dequantize_mxfp4(packed, scales, dy.dtype)

    return _weight_only("mxfp4_linear_dgrad", False, "mxfp4", dy, n, k, packed, scales, reference=ref)


def _nf4_ref(a, packed, absmax, code, block_size, n, k, fwd):
    from ..formats.nf4 import dequantize_nf4_raw

    w = dequantize_nf4_raw(packed, absmax, code, block_size, (n, k), a.dtype)
    return torch.nn.functional.linear(a, w) if fwd else a @ w


def nf4_linear(x, packed, absmax, code, block_size, out_features, in_features):
    return _weight_only(
        "nf4_linear", True, "nf4", x, out_features, in_features, packed, absmax.float().contiguous(), None,
        code.float().contiguous(), block_size,
        reference=lambda: _nf4_ref(x, packed, absmax, code, block_size, out_features, in_features, True),
    )


def nf4_linear_dgrad(dy, packed, absmax, code, block_size, out_features, in_features):
    return _weight_only(
        "nf4_linear_dgrad", False, "nf4", dy, out_features, in_features, packed, absmax.float().contiguous(), None,
        code.float().contiguous(), block_size,
        reference=lambda: _nf4_ref(dy, packed, absmax, code, block_size, out_features, in_features, False),
    )


# ---------------------------------------------------------------- GEMM plans (module hot path)
# A frozen layer's CUDA forward / dgrad with their arguments prepared once: nn.QuantizedLinear calls
# these directly on CUDA (outside torch.compile), skipping the custom-op dispatch on every call. They
# are the very functions registered for the ops, so the numerics are the ops'. The fourth item of each plan is the
# weight's operands for the extension's C++ decode + GEMM op (surogate::ext_decoded_linear), or None where that op
# cannot take them: see decode_operands.
def _warn_at_trace_time(ctx):
    """comptime hook of decode_operands: its frame's `key` and `msg`, said while dynamo traces."""
    warn_once(ctx.get_local("key").as_python_constant(), ctx.get_local("msg").as_python_constant())


def decode_operands(fmt_name, w, scales, gscale, levels, n, k, block, nested=None, quiet=False):
    """(w, scales, gscale, levels, fmt, n, k, block), the weight's arguments of surogate::ext_dequantize /
    ext_decoded_linear (fmt indexes ops.ext.DECODE_FORMATS), checked here once per plan so that the C++ ops never see
    operands they would refuse (the route also checks that x is on w's device). nested: an NF4 absmax's double
    quantization (nested absmax, nested code, offset; scales its one-byte codes), which the ops take as their
    trailing operands, checked here too. None, said once with the reason, when they do not fit: the layer then keeps the Python
    plan (the same math, more host time); quiet: None without saying so."""
    from ..formats.nf4 import NF4_NESTED_BLOCK
    from ..ops.ext import DECODE_FORMATS, FP32_BYTES

    fmt = DECODE_FORMATS.index(fmt_name)
    four_bit = fmt_name != "fp8"
    scale_count = {"nvfp4": n * k // 16, "mxfp4": n * k // 32, "nf4": n * k // max(block, 1),
                   "fp8": -(-n // block) * -(-k // block)}[fmt_name]
    dev = w.device
    scale_bytes = 4 if fmt_name in ("nf4", "fp8") and nested is None else 1

    def fp32_on_dev(t, count):
        return t.device == dev and t.is_contiguous() and t.dtype in FP32_BYTES and t.numel() == count

    problems = (
        (not (w.is_contiguous() and w.element_size() == 1 and w.numel() == (n * k // 2 if four_bit else n * k)),
         f"codes {tuple(w.shape)} {w.dtype} (contiguous one-byte data of the [{n}, {k}] weight expected)"),
        (not (scales.device == dev and scales.is_contiguous() and scales.numel() == scale_count
              and scales.element_size() == scale_bytes),
         f"scales {tuple(scales.shape)} {scales.dtype} on {scales.device} ({scale_count} contiguous values on {dev})"),
        (nested is not None and not (fmt_name == "nf4" and len(nested) == 3
                                     and fp32_on_dev(nested[0], -(-scale_count // NF4_NESTED_BLOCK))
                                     and fp32_on_dev(nested[1], 256) and fp32_on_dev(nested[2], 1)),
         f"nested absmax operands (NF4 only: the fp32 absmax of each {NF4_NESTED_BLOCK} blocks, 256 code values and the "
         f"offset on {dev})"),
        (fmt_name == "nvfp4" and not (gscale is not None and gscale.device == dev and gscale.dtype in FP32_BYTES
                                      and gscale.numel() == 1), "the decode global (one fp32 value on the codes' device)"),
        (fmt_name == "nf4" and not (levels is not None and levels.device == dev and levels.is_contiguous()
                                    and levels.dtype in FP32_BYTES and levels.numel() == 16),
         "the 16 fp32 levels on the codes' device"),
    )
    for bad, what in problems:
        if bad and quiet:  # (a caller that only asks, as a layer registering its operands at load does)
            return None
        if bad:
            key = f"decode_operands:{fmt_name}"
            msg = (f"surogate_hf: a {fmt_name} layer [{n}, {k}] keeps a slower decode + GEMM path (the Python plan; "
                   f"under torch.compile the decode traced into the graph) instead of the extension's C++ op: "
                   f"unexpected {what}")
            if torch.compiler.is_compiling():  # a warning cannot be traced: said once, at trace time
                from torch._dynamo.comptime import comptime

                comptime(_warn_at_trace_time)
            else:
                warn_once(key, msg)
            return None
    return (w, scales, gscale, levels, fmt, n, k, block)


def _decoded(operands, nested=None):
    """A plan's `decoded`: decode_operands' tuple and the NF4 nested absmax operands (or None); None without
    operands."""
    return None if operands is None else (*operands, nested)


def plan_fp8(w, w_scale_inv, block_n, block_k):
    return (*_fp8().plan_block_linear(w, w_scale_inv, block_n, block_k), None)  # W8A8: no decode route


def plan_fp8_weight_only(w, w_scale_inv, block_n, block_k):
    """The fp8 base linear of a small 128x128-block weight (formats.fp8_linear_weight_only): decode + cuBLAS."""
    g = _fp8()
    n, k = w.shape
    return (g.dense_linear, g.dense_linear_dgrad, (w, w_scale_inv, block_n, block_k),
            _decoded(decode_operands("fp8", w, w_scale_inv, None, None, n, k, block_n)) if block_n == block_k else None)


def plan_nvfp4(packed, block_scale, global_scale):
    n, k = packed.shape[0], packed.shape[1] * 2
    return (nvfp4_linear, nvfp4_linear_dgrad, (packed, block_scale, global_scale),
            _decoded(decode_operands("nvfp4", packed, block_scale, global_scale, None, n, k, 16)))


def plan_mxfp4(packed, scales):
    n, k = packed.shape[0], packed.shape[1] * 2
    return (mxfp4_linear, mxfp4_linear_dgrad, (packed, scales),
            _decoded(decode_operands("mxfp4", packed, scales, None, None, n, k, 32)))


def plan_nf4(packed, absmax, code, block_size, out_features, in_features, nested=None):
    """absmax: the fp32 absmax per block; or, with `nested` (double quantization's nested absmax, nested code values and
    offset), its one-byte codes as stored. Then the C++ decode route de-nests per block, and the fp32 absmax that the
    few-token / Triton / Python paths take is built on their first call (a training step at >= DENSE_MIN_TOKENS
    tokens never builds it: 4 bytes per block, +0.0625 B/param at block 64, not held)."""
    levels = code.float().contiguous()
    n, k = out_features, in_features
    if nested is None:
        args = (packed, absmax.float().contiguous(), levels, block_size, n, k)
        return nf4_linear, nf4_linear_dgrad, args, _decoded(decode_operands("nf4", packed, args[1], None, levels, n, k,
                                                                            block_size))

    def args():
        from ..formats.nf4 import nf4_denest_absmax

        return (packed, nf4_denest_absmax(absmax, *nested).contiguous(), levels, block_size, n, k)

    return (nf4_linear, nf4_linear_dgrad, args,
            _decoded(decode_operands("nf4", packed, absmax, None, levels, n, k, block_size, nested), nested))


def _fp8_native_ok(dtype, n, k, block_n, block_k, device_index) -> bool:
    return _fp8().native_linear_ok(dtype, n, k, block_n, block_k, device_index)


# torch.compiler.assume_constant_result(_fp8_native_ok), spelled out: dynamo then calls it at trace time and uses
# the result as a constant, so tracing never enters the checks or the first import of the kernels. The official
# decorator imports torch._dynamo (and with it triton) at surogate_hf's import, and all it does is set this
# marker; tests/ops/test_ops.py::test_dynamo_constant_marker_is_what_the_official_decorator_sets fails if that changes.
_fp8_native_ok._dynamo_marked_constant = True


def fp8_block_linear_native(a, w, w_scale_inv, block_n, block_k, dgrad):
    """The fp8 block linear (a @ W^T) or its dgrad (a @ W) through the native extension's dispatcher op
    `surogate::ext_fp8_block_gemm`, which torch.compile graphs call with no Python in between; None where it
    does not apply (extension not built, a dtype or GPU paths.plan_gemm sends elsewhere): the caller runs the
    surogate:: op. Dims that are not multiples of 128 are zero-padded here (see fp8_layout.pad_weight)."""
    n, k = w.shape
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if not _fp8_native_ok(a.dtype, n, k, block_n, block_k, dev):
        return None
    pad_n, pad_k = paths.fp8_pads(n, k)
    ws = mm_scales(w_scale_inv.t() if dgrad else w_scale_inv)
    a2 = pad_columns(a.reshape(-1, a.shape[-1]), pad_n if dgrad else pad_k)
    y = torch.ops.surogate.ext_fp8_block_gemm(a2, pad_weight(w, pad_n, pad_k), ws, dgrad, RECIPE_1X128,
                                              RECIPE_128X128)
    out = k if dgrad else n
    if y.shape[1] != out:
        y = y[:, :out].contiguous()
    return y if a.dim() == 2 else y.view(*a.shape[:-1], out)


# ---------------------------------------------------------------- recipe GEMMs
def fp8_scaled_mm(a, b, scale_a_inv, scale_b_inv, bias, out_dtype):
    return _fp8().fp8_scaled_mm(a, b, scale_a_inv, scale_b_inv, bias, out_dtype)


def nvfp4_mm(a_packed, a_scale, a_global, b_packed, b_scale, b_global, bias, out_dtype):
    # FP4 tensor cores where the GPU has them (SM100+, kernels.fp4_native: written, never run here); otherwise each
    # operand decoded without its global (e2m1 * s_blk, exact in bf16) and the nvfp4 recipe's bf16 GEMM, said once
    native = _load(".fp4_native")
    ok, why = native.supported(a_packed, b_packed)
    if ok:
        return native.nvfp4_mm(a_packed, a_scale, a_global, b_packed, b_scale, b_global, bias, out_dtype,
                               _load(".triton_recipe").scale_bias_cast)
    major = torch.cuda.get_device_capability(a_packed.device)[0]
    warn_once("nvfp4_mm", f"surogate::nvfp4_mm on SM{major}x runs on bf16 tensor cores with exactly decoded FP4 "
              f"operands (no native FP4 GEMM: {why})")
    one = torch.ones((), dtype=torch.float32, device=a_packed.device)
    a = _tq().dequantize_nvfp4(a_packed, a_scale, one, torch.bfloat16)
    b = _tq().dequantize_nvfp4(b_packed, b_scale, one, torch.bfloat16)
    return _nvfp4_qdq.gemm(a, b.t(), a_global, b_global, bias, out_dtype)


def nvfp4_qdq_mm(a, b, ga, gb, bias, out_dtype):
    return _nvfp4_qdq.gemm(a, b, ga, gb, bias, out_dtype)


def fp8_tiles_wgrad(dy, x, tile, out_dtype):
    wg = _load(".triton_fp8_wgrad")
    if tile not in wg.TILES:  # (the recipe uses 128)
        warn_once("fp8_tiles_wgrad", f"surogate::fp8_tiles_wgrad with {tile}-token tiles runs the fp32 reference: the "
                  f"Triton kernel takes tiles of {wg.TILES}")
        from ..ops.recipe import fp8_tiles_wgrad_reference

        return fp8_tiles_wgrad_reference(dy, x, tile, out_dtype)
    return wg.fp8_tiles_wgrad(dy, x, tile, out_dtype)


_QUANT = (
    "quantize_fp8_tensorwise", "quantize_fp8_tensorwise_t", "delayed_scaling_update", "quantize_fp8_blocks",
    "dequantize_fp8_blocks",
    "quantize_fp8_tiles", "quantize_nvfp4", "dequantize_nvfp4", "quantize_mxfp4", "dequantize_mxfp4", "rht",
    "nvfp4_amax", "nvfp4_qdq",
)
_LINEAR = (
    "fp8_block_linear", "fp8_block_linear_dgrad", "nvfp4_linear", "nvfp4_linear_dgrad", "mxfp4_linear",
    "mxfp4_linear_dgrad", "nf4_linear", "nf4_linear_dgrad",
)
_RECIPE = ("fp8_scaled_mm", "nvfp4_mm", "nvfp4_qdq_mm", "fp8_tiles_wgrad")


def registered_ops() -> tuple[str, ...]:
    return _QUANT + _LINEAR + _RECIPE


def register() -> None:
    """Register every CUDA implementation once (idempotent, imports no Triton)."""
    global _registered
    if _registered:
        return
    from .. import ops  # noqa: F401  (declares every op this registers for)

    from ..ops._outputs import fresh_outputs

    g = globals()
    for name in _QUANT + _LINEAR + _RECIPE:
        torch.library.register_kernel(f"{NS}::{name}", "cuda", fresh_outputs(g[name]))
    _registered = True
