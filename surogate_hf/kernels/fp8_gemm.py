"""FP8 GEMMs on the tensor cores through torch's cuBLASLt bindings.

- block-scaled (fp8 bases, DeepSeek-V3 recipe): activations / output gradients quantized in 1x128
  tiles by our Triton kernel, weights in 128x128 blocks, `torch.nn.functional.scaled_mm` with
  BlockWise1x128 x BlockWise128x128 scaling (layout: ../shared/notes/anchors.md).
- per-tensor (fp8-hybrid recipe): `torch._scaled_mm`.
Any weight shape: K and N that are not multiples of 128 are zero-padded to them inside the call
(`fp8_layout.pad_weight`; HF's ceil-div `weight_scale_inv` has the partial blocks' scales). The fp8 base linear of a
small weight is weight-only instead (formats.fp8_linear_weight_only): `dense_linear`, a decode and cuBLAS. Where no
kernel exists (kernels.paths.plan_gemm says which: a GPU before SM90, a non-bf16 activation, blocks
other than 128x128) the reference math runs, warned once with the why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

from .. import formats as F
from . import paths
from ..ops._warn import warn_once
from . import triton_quant as TQ
from .fp8_layout import RECIPE_1X128 as _RECIPE_1X128
from .fp8_layout import RECIPE_128X128 as _RECIPE_128X128
from .fp8_layout import mm_scales, pad_columns, pad_weight

_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _plan(a: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, block_n: int, block_k: int) -> paths.GemmPath:
    n, k = w.shape
    plan = paths.plan_for("fp8", a, n, k, block_size=(block_n, block_k), fp8_weight_only=False)  # these ops are W8A8
    if plan.path == paths.FP8_BLOCK and tuple(w_scale_inv.shape) != (-(-n // 128), -(-k // 128)):
        raise ValueError(f"fp8 weight_scale_inv has shape {tuple(w_scale_inv.shape)}, expected "
                         f"{(-(-n // 128), -(-k // 128))} (ceil-div 128x128 blocks) for a weight of shape {(n, k)}")
    return plan


def _block_mm(a2: torch.Tensor, a_tile: int, wt_q: torch.Tensor, wt_s_mm: torch.Tensor) -> torch.Tensor:
    """a2 [M, K] bf16 @ (block-scaled W')^T with W' = wt_q [N, K] e4m3 and its scales laid out by
    `mm_scales`. cuBLASLt wants M a multiple of 16: we pad the activation rows (the quantize kernel
    writes the real rows, the pad rows stay zero)."""
    m, k = a2.shape
    mp = -(-m // 16) * 16
    if mp != m:
        a2 = torch.cat((a2, a2.new_zeros((mp - m, k))))
    aq, as_ = TQ.quantize_fp8_tiles(a2, a_tile, scale_colmajor=True)
    out = Fn.scaled_mm(
        aq, wt_q.t(), as_, Fn.ScalingType.BlockWise1x128, wt_s_mm.t(), Fn.ScalingType.BlockWise128x128,
        output_dtype=a2.dtype,
    )
    return out[:m] if mp != m else out


_NATIVE = []  # [module or None], resolved on first use


def _native():
    """The csrc extension when it is built (one C++ call per GEMM: tile quantization, the byte transpose of
    the dgrad weight and cuBLASLt), else None and the Triton kernels + torch's binding do the same math."""
    if not _NATIVE:
        from . import ext

        mod = ext.load(build=False)
        if mod is None:
            warn_once("fp8_block_gemm_ext", "surogate_hf: the fp8 block-scaled linear runs its tile quantization "
                      f"with Triton from Python (more host time per call); the CUDA extension is {ext.status()[1]}")
        _NATIVE.append(mod)
    return _NATIVE[0]


def _block_gemm(a2: torch.Tensor, w: torch.Tensor, ws_mm: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    """a2 @ w^T (forward, a2 [M, K]) or a2 @ w (transpose_w, the dgrad GEMM, a2 [M, N]) for w [N, K] e4m3;
    ws_mm: the scales of the operand multiplied (w, or w^T for dgrad) laid out by `mm_scales`."""
    mod = _native()
    if mod is not None:
        return mod.fp8_block_gemm(a2, w, ws_mm, transpose_w, _RECIPE_1X128, _RECIPE_128X128)
    return _block_mm(a2, 128, TQ.transpose_2d(w) if transpose_w else w, ws_mm)


def native_linear_ok(dtype: torch.dtype, n: int, k: int, block_n: int, block_k: int, device_index: int) -> bool:
    """Whether the extension's `surogate::ext_fp8_block_gemm` kernel takes this linear (after padding to 128, which
    the caller does); its schema and fake are surogate_hf.ops.ext's."""
    plan = paths.plan_gemm("fp8", 1, k, n, dtype, paths.device_capability(device_index), block_size=(block_n, block_k),
                           fp8_weight_only=False)
    return plan.path == paths.FP8_BLOCK and _native() is not None


def _reference_linear(x, w, w_scale_inv, block_n, block_k):
    xq, xs = TQ.quantize_fp8_tiles(x, block_k)
    xd = F.dequantize_fp8_tiles(xq, xs, block_k, torch.float32)
    wd = TQ.dequantize_fp8_blocks(w, w_scale_inv, block_n, block_k, torch.float32)
    return (xd @ wd.t()).to(x.dtype)


def fp8_block_linear(x, w, w_scale_inv, block_n, block_k, w_scales_mm=None):
    plan = _plan(x, w, w_scale_inv, block_n, block_k)
    if plan.path == paths.REFERENCE:
        warn_once("fp8_block_linear", f"surogate::fp8_block_linear runs the fp32 reference GEMM: {plan.reason}")
        return _reference_linear(x, w, w_scale_inv, block_n, block_k)
    n, k = w.shape
    ws = w_scales_mm if w_scales_mm is not None else mm_scales(w_scale_inv)
    a2 = pad_columns(x.reshape(-1, k), plan.pad_k)
    y = _block_gemm(a2, pad_weight(w, plan.pad_n, plan.pad_k), ws, transpose_w=False)
    if plan.pad_n:
        y = y[:, :n].contiguous()
    # a 2-D input gets the GEMM output itself, not a view of it (callers may accumulate into it in place)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def fp8_block_linear_dgrad(dy, w, w_scale_inv, block_n, block_k, wt_scales_mm=None):
    plan = _plan(dy, w, w_scale_inv, block_n, block_k)
    if plan.path == paths.REFERENCE:
        warn_once("fp8_block_linear_dgrad",
                  f"surogate::fp8_block_linear_dgrad runs the fp32 reference GEMM: {plan.reason}")
        dq, ds = TQ.quantize_fp8_tiles(dy, block_n)
        dd = F.dequantize_fp8_tiles(dq, ds, block_n, torch.float32)
        wd = TQ.dequantize_fp8_blocks(w, w_scale_inv, block_n, block_k, torch.float32)
        return (dd @ wd).to(dy.dtype)
    n, k = w.shape
    # dx = dy @ W: the reduction runs over W's rows, so the GEMM takes W^T [K, N] (blocks transpose
    # with it); one fp8 transpose of the weight per call (1 byte/param), no dense copy.
    ws = wt_scales_mm if wt_scales_mm is not None else mm_scales(w_scale_inv.t())
    a2 = pad_columns(dy.reshape(-1, n), plan.pad_n)
    dx = _block_gemm(a2, pad_weight(w, plan.pad_n, plan.pad_k), ws, transpose_w=True)
    if plan.pad_k:
        dx = dx[:, :k].contiguous()
    return dx if dy.dim() == 2 else dx.reshape(*dy.shape[:-1], k)


def _dense_weight(op, a, w, w_scale_inv, block_n, block_k):
    """The decoded weight of a weight-only fp8 base linear in a's dtype: the Triton decode where paths.plan_gemm plans
    the dense route, else (a GPU or dtype it does not take) the reference decode, said once."""
    n, k = w.shape
    plan = paths.plan_for("fp8", a, n, k, block_size=(block_n, block_k))
    if plan.path == paths.DENSE:
        return TQ.dequantize_fp8_blocks(w, w_scale_inv, block_n, block_k, a.dtype)
    warn_once(op, f"surogate_hf: the weight-only fp8 linear decodes its weight with the reference ops: {plan.reason}")
    return F.dequantize_fp8_blocks(w, w_scale_inv, (block_n, block_k), a.dtype)


def dense_linear(x, w, w_scale_inv, block_n, block_k):
    """x @ deq(W)^T, the fp8 base linear of a weight-only (small) weight: decoded to x's dtype, then cuBLAS."""
    return Fn.linear(x, _dense_weight("fp8_dense_linear", x, w, w_scale_inv, block_n, block_k))


def dense_linear_dgrad(dy, w, w_scale_inv, block_n, block_k):
    return dy @ _dense_weight("fp8_dense_linear_dgrad", dy, w, w_scale_inv, block_n, block_k)


def _planned_fwd(x, w, w_scale_inv, block_n, block_k, ws_mm, wts_mm):
    return fp8_block_linear(x, w, w_scale_inv, block_n, block_k, ws_mm)


def _planned_dgrad(dy, w, w_scale_inv, block_n, block_k, ws_mm, wts_mm):
    return fp8_block_linear_dgrad(dy, w, w_scale_inv, block_n, block_k, wts_mm)


def plan_block_linear(w, w_scale_inv, block_n, block_k):
    """(forward, dgrad, args) for a frozen block-scaled weight: both scale layouts cuBLASLt reads
    are built once here instead of per call (4 bytes per 128x128 block each)."""
    ws_mm = wts_mm = None
    if (block_n, block_k) == (128, 128) and w_scale_inv.dim() == 2:
        ws_mm, wts_mm = mm_scales(w_scale_inv), mm_scales(w_scale_inv.t())
    return _planned_fwd, _planned_dgrad, (w, w_scale_inv, block_n, block_k, ws_mm, wts_mm)


def _aligned_scale(s):
    """cuBLASLt rejects (CUBLAS_STATUS_NOT_SUPPORTED) a scale pointer that is not 16-byte aligned, which a
    view into a grouped scale tensor (the recipes cast x and W together) can be: copy only those."""
    s = s.float().reshape(())
    return s if s.data_ptr() % 16 == 0 else s.clone()


def fp8_scaled_mm(a, b, scale_a_inv, scale_b_inv, bias, out_dtype, use_fast_accum=False):
    m, k = a.shape
    n = b.shape[0]
    why = None
    if out_dtype not in _OUT:
        why = f"out_dtype {out_dtype}"
    elif a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        why = "e5m2 x e5m2 (cuBLASLt needs one e4m3 operand)"
    elif k % 16 or n % 16:
        why = f"K={k}, N={n} not multiples of 16"
    if why:
        warn_once("fp8_scaled_mm", f"surogate::fp8_scaled_mm runs the fp32 reference GEMM: {why}")
        acc = a.float() @ b.float().t()
        out = acc * (scale_a_inv.float() * scale_b_inv.float())
        return (out if bias is None else out + bias.float()).to(out_dtype)
    sa = _aligned_scale(scale_a_inv)
    sb = _aligned_scale(scale_b_inv)
    a = a.contiguous()
    bt = b.contiguous().t()
    if bias is None or (bias.dtype == out_dtype and out_dtype != torch.float32):
        # cuBLASLt adds the bias in fp32 in its epilogue before the single output rounding
        return torch._scaled_mm(a, bt, sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    out = torch._scaled_mm(a, bt, sa, sb, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
    return (out + bias.float()).to(out_dtype)
