"""The GEMMs of the training recipes as torch.library custom ops (namespace `surogate`).

Layout convention for every op: out[M, N] = a[M, K] @ b[N, K]^T, both operands row-major with the
reduction dim K last ("TN", what cuBLASLt's FP8 and CUTLASS's block-scaled FP4 GEMMs take; pass
`b.t()` of a row-major [N, K] tensor to `torch._scaled_mm`). The default kernels below are the
reference numerics and run on any device; surogate_hf.kernels registers CUDA implementations under
the same names (e.g. `torch._scaled_mm` for fp8_scaled_mm) and must match them within the
accumulation-order tolerance the docstrings state.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .. import formats as F
from ._outputs import fresh_outputs

NS = "surogate"


def below_autograd():
    """Skip the Autograd dispatch key for the engine's ops where no graph can be recorded anyway.

    Inside Function.forward (and a backward without create_graph) grad mode is off, yet every
    surogate:: custom op still enters torch.library's Python autograd wrapper (autograd_impl ->
    forward_no_grad -> redispatch), ~6 us of host time per op per call on a 2-core CPU. This is the
    guard that wrapper itself takes (torch/_library/autograd.py); ADInplaceOrView still runs, so
    in-place updates of the recipe buffers bump their version counters as before. Not taken while
    grad mode is on (double backward must keep raising) or while dynamo traces.
    """
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


def _no_autocast(device: torch.device):
    # An enclosing autocast (accelerate mixed_precision="bf16") must not turn the fp32 reference GEMM into bf16.
    return torch.autocast(device_type=device.type, enabled=False)


@torch.library.custom_op(f"{NS}::fp8_scaled_mm", mutates_args=())
@fresh_outputs
def fp8_scaled_mm(
    a: Tensor, b: Tensor, scale_a_inv: Tensor, scale_b_inv: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """Per-tensor scaled FP8 GEMM: out = cast((a.f32 @ b.f32^T) * (sa * sb) + bias.f32, out_dtype).

    a: [M, K] float8 (e4m3 or e5m2), b: [N, K] float8, scale_a_inv / scale_b_inv: fp32 scalars (the
    dequantization scales, 1/scale of the cast), bias: [N] or None. Products of two FP8 values are
    exact in fp32, accumulation is fp32, the combined scale multiplies the fp32 accumulator once,
    bias is added in fp32 and the result is rounded once to out_dtype (RNE). This is cuBLASLt's
    `torch._scaled_mm(a, b.t(), scale_a_inv, scale_b_inv, bias, out_dtype=...)`; a kernel differs
    from the reference only by fp32 summation order (|err| <= K * 2^-24 * sum|a_i b_i| * sa * sb
    before the output rounding).
    """
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in F.FP8_MAX:
            raise TypeError(f"fp8_scaled_mm: operand {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"fp8_scaled_mm: reduction dims differ, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    with _no_autocast(a.device):
        acc = a.float() @ b.float().t()
        out = acc * (scale_a_inv.float() * scale_b_inv.float())
        if bias is not None:
            out = out + bias.float()
    return out.to(out_dtype)


@fp8_scaled_mm.register_fake
def _(a, b, scale_a_inv, scale_b_inv, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op(f"{NS}::nvfp4_mm", mutates_args=())
@fresh_outputs
def nvfp4_mm(
    a_packed: Tensor,
    a_scale: Tensor,
    a_global: Tensor,
    b_packed: Tensor,
    b_scale: Tensor,
    b_global: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """Block-scaled NVFP4 GEMM: out = cast((A @ B^T) * (ga * gb) + bias.f32, out_dtype).

    a_packed [M, K/2] / b_packed [N, K/2]: E2M1 codes two per byte (formats.e2m1 layout);
    a_scale [M, K/16] / b_scale [N, K/16]: E4M3 block scales; a_global / b_global: fp32 decode
    globals (formats.nvfp4: x = e2m1 * s_blk * global). A and B are the operands decoded WITHOUT
    their globals (e2m1 * s_blk, exact in fp32); products accumulate in fp32, the product of the two
    globals scales the accumulator once (CUTLASS's alpha), bias is added in fp32, one rounding to
    out_dtype. A native SM100 kernel differs only by fp32 summation order.
    """
    if a_packed.shape[-1] != b_packed.shape[-1]:
        raise ValueError(f"nvfp4_mm: reduction dims differ, a {tuple(a_packed.shape)} vs b {tuple(b_packed.shape)}")
    one = torch.ones((), dtype=torch.float32, device=a_packed.device)
    with _no_autocast(a_packed.device):
        a = F.dequantize_nvfp4(a_packed, a_scale, one, torch.float32)
        b = F.dequantize_nvfp4(b_packed, b_scale, one, torch.float32)
        return F.mm_qdq(a, b.t(), a_global, b_global, bias, out_dtype)


@nvfp4_mm.register_fake
def _(a_packed, a_scale, a_global, b_packed, b_scale, b_global, bias, out_dtype):
    return a_packed.new_empty((a_packed.shape[0], b_packed.shape[0]), dtype=out_dtype)


@torch.library.custom_op(f"{NS}::nvfp4_qdq_mm", mutates_args=())
@fresh_outputs
def nvfp4_qdq_mm(a: Tensor, b: Tensor, ga: Tensor, gb: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """formats.nvfp4.mm_qdq: cast((a @ b) * (ga * gb) + bias.f32, out_dtype) for two surogate::nvfp4_qdq operands (bf16
    values that hold e2m1 * s_blk exactly; ga / gb their decode globals), a [M, K], b [K, N] of any strides. The NVFP4
    GEMM up to fp32 summation order."""
    with _no_autocast(a.device):
        return F.mm_qdq(a, b, ga, gb, bias, out_dtype)


@nvfp4_qdq_mm.register_fake
def _(a, b, ga, gb, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op(f"{NS}::delayed_scaling_update", mutates_args=("history", "scale"))
@fresh_outputs
def delayed_scaling_update(history: Tensor, scale: Tensor, amax: Tensor, fp8_dtype: torch.dtype, margin: int,
                           use_max: bool) -> None:
    """One delayed-scaling step for n roles, in place (recipes.scaling.Fp8ScalingState semantics).

    history [n, L] newest first, scale [n], amax [n]: amax is sanitized (NaN/inf -> 0), pushed in front of the
    history (the oldest entry drops out), and scale becomes formats.fp8_scale_from_amax of the max over the new
    window (use_max) or of the new amax, keeping the previous scale where that gives no positive finite value.
    """
    a = torch.nan_to_num(amax.float(), nan=0.0, posinf=0.0, neginf=0.0)
    # newest first: [amax, history[:, :-1]] in one op (no roll + copy + index write)
    pushed = torch.cat((a.unsqueeze(1), history[:, :-1]), dim=1)
    history.copy_(pushed)
    window = pushed.amax(dim=1) if use_max else a
    scale.copy_(F.fp8_scale_from_amax(window, fp8_dtype, margin, previous=scale))


@delayed_scaling_update.register_fake
def _(history, scale, amax, fp8_dtype, margin, use_max):
    return None


@torch.library.custom_op(f"{NS}::take_step", mutates_args=("counter",))
@fresh_outputs
def take_step(counter: Tensor) -> Tensor:
    """A forward's step from a step counter (the nvfp4 recipe's stochastic-rounding step, read inside compiled graphs).

    A training forward gets the counter's value (a new tensor) and advances the counter by one. A forward that the
    autograd engine runs during a backward is an activation-checkpoint recompute (the rule recipes.linear._pass_mode
    applies in eager mode): it gets the value the forward it recomputes got, counter - 1, and leaves the counter.
    One opaque op because as torch ops (clone, add_) AOTAutograd's partitioner may recompute the clone in the
    backward from the graph input, which by then holds the advanced value (measured: the backward drew with step + 1).
    """
    if torch._C._current_graph_task_id() != -1:
        return counter - 1
    old = counter.clone()
    counter.add_(1)
    return old


@take_step.register_fake
def _(counter):
    return torch.empty_like(counter)


@torch.library.custom_op(f"{NS}::fp8_tiles_wgrad", mutates_args=())
@fresh_outputs
def fp8_tiles_wgrad(dy: Tensor, x: Tensor, tile: int, out_dtype: torch.dtype) -> Tensor:
    """Weight gradient of the fine-grained FP8 recipe (DeepSeek-V3): dW [N, K] = dy^T [N, T] @ x [T, K].

    The reduction runs over tokens, so both operands are quantized to E4M3 in 1 x `tile` tiles ALONG THE TOKENS
    (dy^T and x^T row-wise, i.e. `tile` x 1 tiles of dy [T, N] and x [T, K]; formats.quantize_fp8_tiles, current
    scaling), products accumulate in fp32, one rounding to out_dtype. A native kernel may differ only by fp32
    summation order and by where the tile scales are applied (kernels.triton_fp8_wgrad: per 128-token partial sum).
    """
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"fp8_tiles_wgrad: token counts differ, dy {tuple(dy.shape)} vs x {tuple(x.shape)}")
    return fp8_tiles_wgrad_reference(dy, x, tile, out_dtype)


def fp8_tiles_wgrad_reference(dy: Tensor, x: Tensor, tile: int, out_dtype: torch.dtype) -> Tensor:
    """surogate::fp8_tiles_wgrad's numerics (the op's CPU kernel; CUDA takes it for tiles its kernel lacks)."""
    with _no_autocast(dy.device):
        aq, a_s = F.quantize_fp8_tiles(dy.t(), tile)
        bq, b_s = F.quantize_fp8_tiles(x.t(), tile)
        a = F.dequantize_fp8_tiles(aq, a_s, tile, torch.float32)
        b = F.dequantize_fp8_tiles(bq, b_s, tile, torch.float32)
        out = a @ b.t()
    return out.to(out_dtype)


@fp8_tiles_wgrad.register_fake
def _(dy, x, tile, out_dtype):
    return dy.new_empty((dy.shape[1], x.shape[1]), dtype=out_dtype)


def has_native_kernel(op_name: str, device: torch.device) -> bool:
    """True when a kernel other than the reference is registered for `op_name` on `device`'s backend."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NS}::{op_name}", "CUDA")
