"""FP8 GEMMs with per-tensor delayed scaling (fp8-hybrid recipe; bf16 recipe with matmul_dtype e4m3).

forward  y  = x  W^T : E4M3(x)  x E4M3(W)   -> activation dtype
dgrad    dx = dy W   : E5M2(dy) x E4M3(W)   -> activation dtype
wgrad    dW = dy^T x : E5M2(dy) x E4M3(x)   -> the master weight's dtype (fp32 accumulation, one rounding)
All three are "TN" scaled GEMMs (fp32 accumulation, both operands K-major: torch._scaled_mm on CUDA,
surogate::fp8_scaled_mm's reference elsewhere). A per-tensor cast commutes with transposition, so
each operand is cast ONCE, writing q and the K-major transpose the backward GEMM needs in the same
pass (x^T for wgrad, W^T for dgrad, dy^T for wgrad); the forward saves only the transposes the
backward uses (1 byte per element).

Scales and amaxes live in the model's flat state (scaling.Fp8ScalingState): a cast reads its row's
scale and raises its row's running amax, nothing else; the state is updated once per optimizer step.
The weight is cast once per optimizer step (eager): the FP8 weight and its transpose are cached and
reused by gradient-accumulation micro-batches and activation-checkpoint recomputes; an fp32 master is
cast straight to FP8 (no bf16 work copy in between).

Three executions of the same arithmetic (formats.quantize_fp8_tensorwise is the spec):
  - eager on CUDA: casts that write into the state directly (kernels.fp8_cast: the csrc kernel, or Triton) and the
    extension's cached cuBLASLt GEMM; with the extension built, a training call after the first step is one C++ op
    with a C++ autograd node instead of Fp8LinearFn (surogate::ext_fp8_linear, the same casts and GEMMs: NATIVE_LINEAR);
  - under torch.compile: plain torch ops, so inductor fuses the cast (and its amax) into the kernel that
    produces the operand, and the GEMM as the surogate::fp8_scaled_mm op (cuBLASLt);
  - CPU: the same torch ops and the reference GEMM.
With a float gradient_dtype (bf16 recipe, matmul_dtype e4m3, gradient_dtype bf16/fp32) the backward is
the float one of bf16.py instead.
"""

from __future__ import annotations

import warnings

import torch

from .. import formats as F
from ..kernels import fp8_cast, probe
from ..ops import recipe as recipe_ops
from .bf16 import FloatBackward

_warned = set()  # (op, device type) already checked: one check and at most one warning each


def warn_emulation_once(op_name: str, device: torch.device, what: str) -> None:
    """One warning per (op, device type) when the reference runs instead of a native kernel."""
    key = (op_name, device.type)
    if key in _warned:
        return
    _warned.add(key)
    if recipe_ops.has_native_kernel(op_name, device):
        return
    where = "CPU" if device.type == "cpu" else f"{device} (no native surogate::{op_name} kernel registered)"
    warnings.warn(
        f"surogate_hf: {what} runs as exact emulation on {where}: operands are quantized exactly as the "
        "recipe specifies, then dequantized and multiplied in fp32. Numerics match the recipe; speed does not.",
        RuntimeWarning,
        stacklevel=3,
    )


def _tr():
    return probe.triton_kernels("triton_recipe", "the fp8 recipe's CUDA casts")


def _eager_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and not torch.compiler.is_compiling()


class RowViews(tuple):
    """A state row as the views an eager CUDA cast reads and writes, made once per layer (not per call: on a slow
    host every view is a few microseconds of dispatch): (row, scale [1], running-amax int32 bits [1], dequant
    scale 0-dim, 16-byte aligned for cuBLASLt)."""

    __slots__ = ()

    @classmethod
    def of(cls, row: int, scale, scale_inv, amax_bits):
        return cls((row, scale[row : row + 1], amax_bits, scale_inv[row, 0]))


def cast(x2d, scale, scale_inv, amax, row, fmt, transpose: bool, record: bool, current: bool, amax_row=None):
    """Cast x2d [R, C] for state row `row`. Returns (q, q^T contiguous or None, dequant scale 0-dim fp32).

    row: an int, a RowViews (eager CUDA: its views, no indexing per call), or (traced) a 0-dim int64 tensor, so
    that one compiled graph serves every layer.
    amax / amax_row: where the running amax goes (default: amax[row]; a RowViews carries its own).
    current: scale by x's own amax (the first step); otherwise by scale[row]. record: raise amax[row] to
    amax(|x|) (training passes; evaluation leaves the state alone).
    """
    if isinstance(row, RowViews):
        if not current and record and _eager_cuda(x2d):
            q, qt = fp8_cast.cast_fp8_into(x2d.contiguous(), row[1], row[2], fmt, transpose)
            return q, qt, row[3]
        row = row[0]
    if amax_row is None:
        amax_row = row
    if _eager_cuda(x2d):
        x2d = x2d.contiguous()
        bits = (amax.view(torch.int32)[amax_row : amax_row + 1] if record
                else torch.zeros(1, dtype=torch.int32, device=x2d.device))
        if current:
            a = torch.zeros(1, dtype=torch.int32, device=x2d.device)
            _tr().amax_into(x2d, a)
            s = F.fp8_scale_from_amax(a.view(torch.float32), fmt)
            q, qt = fp8_cast.cast_fp8_into(x2d, s, bits, fmt, transpose)
            return q, qt, s.reciprocal().reshape(())
        q, qt = fp8_cast.cast_fp8_into(x2d, scale[row : row + 1], bits, fmt, transpose)
        return q, qt, scale_inv[row, 0]
    if TRACED_CAST == "op" and torch.compiler.is_compiling():
        # the cast as one opaque op (our Triton kernel on CUDA: cast, transpose and amax in one pass) instead of
        # torch ops that inductor fuses into the producer; same numbers (the op's reference is this formula)
        s = F.fp8_scale_from_amax(x2d.detach().abs().amax().float(), fmt) if current else _at(scale, row)
        if transpose:
            q, qt, a = torch.ops.surogate.quantize_fp8_tensorwise_t(x2d, s, fmt)
        else:
            (q, a), qt = torch.ops.surogate.quantize_fp8_tensorwise(x2d, s, fmt), None
    else:
        a = x2d.detach().abs().amax().float() if (record or current) else None
        s = F.fp8_scale_from_amax(a, fmt) if current else _at(scale, row)
        q = F.cast_to_fp8(x2d.float() * s, fmt)
        qt = q.t().contiguous() if transpose else None
    if record:
        if isinstance(amax_row, int):
            amax[amax_row] = torch.maximum(amax[amax_row], a)
        else:  # a traced row: index ops, not t[row] (dynamo would specialize the index to a Python int)
            amax.index_put_((amax_row.reshape(1),), torch.maximum(_at(amax, amax_row), a).reshape(1))
    if current or not isinstance(row, int):
        # traced: a fresh 0-dim reciprocal (what update() stores in scale_inv, bit for bit); inductor's scaled-GEMM
        # lowering failed on a gathered view of the padded scale_inv rows (H100, torch 2.11)
        return q, qt, s.reciprocal()
    return q, qt, scale_inv[row, 0]


def _at(t, row):
    """t[row]: a view for an int row, a gather for a traced (tensor) row."""
    return t[row] if isinstance(row, int) else t.index_select(0, row.reshape(1)).squeeze(0)


def scaled_mm(a, b, sa_inv, sb_inv, bias, out_dtype, fast_accum: bool = False):
    """out [M, N] = (a [M, K] @ b [N, K]^T) * sa_inv * sb_inv (+ bias), fp32 accumulation, one rounding.

    fast_accum: let cuBLASLt accumulate in the tensor cores' fast mode (the fp8_fast_accum knob; forward only). The
    reference (CPU, the op) always accumulates in fp32: the two differ by accumulation precision, nothing else."""
    if a.is_cuda and not torch.compiler.is_compiling():
        bias_ok = bias is None or (bias.dtype == out_dtype and out_dtype != torch.float32)
        if (bias_ok and sa_inv.dim() == 0 and sb_inv.dim() == 0 and a.is_contiguous() and b.is_contiguous()
                and _aten_ok(a, b, out_dtype) and sa_inv.data_ptr() % 16 == 0 and sb_inv.data_ptr() % 16 == 0):
            # the recipe's own operands: contiguous, scales 0-dim views of 16-byte rows (or fresh): straight to cuBLASLt
            return _eager_gemm()(a, b, sa_inv, sb_inv, bias, out_dtype, fast_accum)
        from ..kernels import fp8_gemm  # checks shapes, copies misaligned scales, warns once on a fallback

        return fp8_gemm.fp8_scaled_mm(a, b, sa_inv, sb_inv, bias, out_dtype, use_fast_accum=fast_accum)
    if a.is_cuda and TRACED_GEMM == "aten" and _aten_ok(a, b, out_dtype):
        # in the graph as aten._scaled_mm: inductor calls cuBLASLt from its generated code (no Python op wrapper
        # on the host path of every GEMM)
        sa, sb = sa_inv.reshape(()), sb_inv.reshape(())
        if bias is None or (bias.dtype == out_dtype and out_dtype != torch.float32):
            return torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
        out = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=fast_accum)
        return (out + bias.float()).to(out_dtype)
    # CPU: the reference; traced otherwise: the op (its CUDA kernel is the function above) as one opaque node
    return torch.ops.surogate.fp8_scaled_mm(a, b, sa_inv, sb_inv, bias, out_dtype)


_EAGER_GEMM = []  # [the eager CUDA GEMM], resolved at the first call


def _eager_gemm():
    """The eager CUDA scaled GEMM: the extension's surogate::ext_fp8_scaled_mm when it is built (torch._scaled_mm's
    cuBLASLt call with the heuristic's answer cached: ~96 us of host time per _scaled_mm call otherwise, three per
    linear per step), else torch._scaled_mm (same bits). An unbuilt extension is reported once by the casts."""
    if not _EAGER_GEMM:
        from ..kernels import ext

        if ext.load(build=False) is not None:
            _EAGER_GEMM.append(torch.ops.surogate.ext_fp8_scaled_mm.default)
        else:
            _EAGER_GEMM.append(lambda a, b, sa, sb, bias, out_dtype, fast: torch._scaled_mm(
                a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast))
    return _EAGER_GEMM[0]


# the eager CUDA training linear: True takes surogate::ext_fp8_linear (the casts and GEMMs below, in C++ with a C++
# autograd node) where native_linear_ok says it applies and the extension is built; False keeps Fp8LinearFn (the
# GPU test compares the two bit for bit)
NATIVE_LINEAR = True
_NATIVE_LINEAR = []  # [the op or None], resolved at the first call


def native_linear():
    """surogate::ext_fp8_linear when NATIVE_LINEAR is on and the extension is built, else None."""
    if not NATIVE_LINEAR:
        return None
    if not _NATIVE_LINEAR:
        from ..kernels import ext

        _NATIVE_LINEAR.append(torch.ops.surogate.ext_fp8_linear.default if ext.load(build=False) is not None else None)
    return _NATIVE_LINEAR[0]


_NATIVE_X = (torch.bfloat16, torch.float16, torch.float32)


def native_linear_ok(x, wq, wqt, scales) -> bool:
    """Whether ext_fp8_linear takes this training call (after the first step, FP8 backward, x's cast from its state
    row): what its casts (x 16-byte aligned after its contiguous copy) and cuBLASLt's FP8 GEMMs (widths and the
    token count multiples of 16, 16-byte aligned scales) take, and a dgrad operand wherever x wants a gradient.
    Elsewhere Fp8LinearFn runs the same casts and GEMMs (with its own fallbacks) from Python."""
    n, k = wq.shape
    m = x.numel() // k if k else 0
    return (x.dtype in _NATIVE_X and m > 0 and m % 16 == 0 and n % 16 == 0 and k % 16 == 0
            and (wqt is not None or not x.requires_grad) and all(s.data_ptr() % 16 == 0 for s in scales))


TRACED_GEMM = "aten"  # how a traced CUDA GEMM enters the graph: "aten" (torch._scaled_mm) or "op" (surogate::)
# how a traced cast enters the graph: "inductor" (torch ops, fused by inductor into the kernel that produces the
# operand) or "op" (surogate::quantize_fp8_tensorwise[_t], one opaque call: on the H100 inductor's fused
# cast-transpose kernels ran at 1/2-1/3 of bandwidth, benchmarks/results/recipes_profile.md)
TRACED_CAST = "inductor"


def _aten_ok(a, b, out_dtype) -> bool:
    """Shapes and dtypes cuBLASLt's FP8 GEMM takes (the others go through the op, which warns and emulates)."""
    return (a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not (a.dtype == b.dtype == torch.float8_e5m2))


_WGRAD_OUT = (torch.float32, torch.bfloat16)  # dtypes the scaled GEMM writes dW in directly


class Fp8LinearFn(torch.autograd.Function):
    """y = x W^T + b with FP8 operands. Only tensors and constants cross it, so dynamo traces it whole.

    wq / wqt / w_sinv: the weight's FP8 cast (wqt None when no dgrad will run); scale, scale_inv, amax: the
    state's flat tensors; dy_amax: the layer's own [1] running amax of dy (folded into the flat state at the
    update; a buffer of its own because a compiled backward checks the version of what it reads, and the
    flat buffer moves with every other layer's casts); rows: the layer's (x, W, dy) rows (ints, or an int64 tensor when traced);
    xq / xqt / x_sinv: x's cast when the kernel that produced x already wrote it (eager; None: cast here);
    spec = (fwd_fmt, bwd_fmt, fp8_backward, record, current, fast_accum), bwd_fmt being the float gradient
    dtype's name when fp8_backward is false; fast_accum applies to the forward GEMM only (TE and torchao do the same:
    dgrad and wgrad sum over the token dimension, where reduced-precision accumulation costs most).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, wq, wqt, w_sinv, scale, scale_inv, amax, dy_amax, rows, spec,
                xq=None, xqt=None, x_sinv=None):
        fwd_fmt, bwd_fmt, fp8_backward, record, current, fast_accum = spec
        row_x = rows[0]
        need_dw = ctx.needs_input_grad[1]
        x2d = x.reshape(-1, x.shape[-1])
        if xq is None:  # else: x's cast handed over by the kernel that produced x (recipes.norm), amax recorded there
            xq, xqt, x_sinv = cast(x2d, scale, scale_inv, amax, row_x, fwd_fmt, fp8_backward and need_dw, record,
                                   current)
        y = scaled_mm(xq, wq, x_sinv, w_sinv, bias, x.dtype, fast_accum)
        ctx.spec, ctx.row_dy, ctx.x_shape, ctx.w_dtype = spec, rows[2], x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        if fp8_backward:
            ctx.save_for_backward(xqt, x_sinv, wqt, w_sinv)
            ctx.scale, ctx.scale_inv, ctx.dy_amax = scale, scale_inv, dy_amax
        else:
            ctx.save_for_backward(x2d, weight)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        fwd_fmt, bwd_fmt, fp8_backward, record, current, _ = ctx.spec
        row_dy = ctx.row_dy
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        if fp8_backward:
            xqt, x_sinv, wqt, w_sinv = ctx.saved_tensors
            # dgrad reads dy [M, N], wgrad dy^T [N, M]
            dyq, dyqt, dy_sinv = cast(dy2d, ctx.scale, ctx.scale_inv, ctx.dy_amax, row_dy, bwd_fmt, need_dw, True, current,
                                      amax_row=0)
            dx = scaled_mm(dyq, wqt, dy_sinv, w_sinv, None, dy.dtype) if need_dx else None
            dw = None
            if need_dw:
                out = ctx.w_dtype if ctx.w_dtype in _WGRAD_OUT else torch.float32
                dw = scaled_mm(dyqt, xqt, dy_sinv, x_sinv, None, out)
                dw = dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype)
        else:
            x2d, w = ctx.saved_tensors
            dx, dw = FloatBackward(bwd_fmt).backward(dy2d, x2d, w, need_dx, need_dw)  # bwd_fmt: 'bf16' / 'fp32'
            dw = dw.to(ctx.w_dtype) if dw is not None else None
        dx = dx.reshape(ctx.x_shape) if dx is not None else None
        db = dy2d.float().sum(0).to(ctx.b_dtype) if need_db else None
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None, None
