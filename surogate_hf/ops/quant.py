"""Quantize / dequantize entry points as torch.library custom ops.

Each op's default kernel is the reference in surogate_hf.formats (CPU and any device); GPU kernels
register under the same names (surogate_hf.kernels) and are tested bit for bit against these.
Fake (meta) implementations make every op traceable by torch.compile and usable on meta tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import formats as F
from ._outputs import fresh_outputs

NS = "surogate"


# ---------------------------------------------------------------- FP8
@torch.library.custom_op(f"{NS}::quantize_fp8_tensorwise", mutates_args=())
@fresh_outputs
def quantize_fp8_tensorwise(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cast x * scale to FP8 (saturating) and return (q, amax(|x|)), the amax fused for delayed scaling."""
    q, _ = F.quantize_fp8_tensorwise(x, fp8_dtype, scale=scale)
    return q, x.detach().abs().amax().float()


@quantize_fp8_tensorwise.register_fake
def _(x, scale, fp8_dtype):
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::quantize_fp8_tensorwise_t", mutates_args=())
@fresh_outputs
def quantize_fp8_tensorwise_t(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tensor FP8 cast of a 2D view [rows, cols] of x (last dim kept), its transpose, and amax(|x|).

    Returns (q [..., cols] like x, qt [cols, rows] contiguous, amax fp32 scalar). The transposed copy
    feeds the backward GEMMs (cuBLASLt FP8 wants K-major operands) without a second pass over x.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_tensorwise_t needs a tensor with >= 2 dims, got shape {tuple(x.shape)}")
    q, _ = F.quantize_fp8_tensorwise(x, fp8_dtype, scale=scale)
    # clone, not contiguous(): for one row or column the transpose is already contiguous and would alias q
    return q, q.reshape(-1, x.shape[-1]).t().clone(memory_format=torch.contiguous_format), x.detach().abs().amax().float()


@quantize_fp8_tensorwise_t.register_fake
def _(x, scale, fp8_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((x.shape[-1], rows), dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
    )


@torch.library.custom_op(f"{NS}::quantize_fp8_blocks", mutates_args=())
@fresh_outputs
def quantize_fp8_blocks(w: Tensor, block_n: int, block_k: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    return F.quantize_fp8_blocks(w, (block_n, block_k), F.E4M3, ue8m0)


@quantize_fp8_blocks.register_fake
def _(w, block_n, block_k, ue8m0):
    *lead, n, k = w.shape
    return (
        torch.empty_like(w, dtype=F.E4M3),
        w.new_empty((*lead, -(-n // block_n), -(-k // block_k)), dtype=torch.float32),
    )


@torch.library.custom_op(f"{NS}::dequantize_fp8_blocks", mutates_args=())
@fresh_outputs
def dequantize_fp8_blocks(q: Tensor, scale_inv: Tensor, block_n: int, block_k: int, out_dtype: torch.dtype) -> Tensor:
    return F.dequantize_fp8_blocks(q, scale_inv, (block_n, block_k), out_dtype)


@dequantize_fp8_blocks.register_fake
def _(q, scale_inv, block_n, block_k, out_dtype):
    return torch.empty_like(q, dtype=out_dtype)


@torch.library.custom_op(f"{NS}::quantize_fp8_tiles", mutates_args=())
@fresh_outputs
def quantize_fp8_tiles(x: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    return F.quantize_fp8_tiles(x, tile, F.E4M3)


@quantize_fp8_tiles.register_fake
def _(x, tile):
    return torch.empty_like(x, dtype=F.E4M3), x.new_empty((*x.shape[:-1], -(-x.shape[-1] // tile)), dtype=torch.float32)


# ---------------------------------------------------------------- NVFP4
@torch.library.custom_op(f"{NS}::quantize_nvfp4", mutates_args=())
@fresh_outputs
def quantize_nvfp4(
    x: Tensor, block_2d: bool, four_over_six: bool, rule: str, stochastic: bool, seed: int, amax: Tensor | None,
    seed_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """formats.nvfp4.quantize_nvfp4 as (packed codes, block scales, global). seed_tensor: as nvfp4_qdq's."""
    if seed_tensor is not None:
        check_seed_tensor(seed_tensor, x)
        seed = seed_tensor.reshape(())
    qt = F.quantize_nvfp4(
        x, block_2d=block_2d, four_over_six=four_over_six, rule=rule, stochastic=stochastic, seed=seed, amax=amax
    )
    return qt.packed, qt.block_scale, qt.global_scale


@quantize_nvfp4.register_fake
def _(x, block_2d, four_over_six, rule, stochastic, seed, amax, seed_tensor=None):
    *lead, k = x.shape
    return (
        x.new_empty((*lead, k // 2), dtype=torch.uint8),
        x.new_empty((*lead, k // 16), dtype=F.E4M3),
        x.new_empty((), dtype=torch.float32),
    )


@torch.library.custom_op(f"{NS}::dequantize_nvfp4", mutates_args=())
@fresh_outputs
def dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return F.dequantize_nvfp4(packed, block_scale, global_scale, out_dtype)


@dequantize_nvfp4.register_fake
def _(packed, block_scale, global_scale, out_dtype):
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=out_dtype)


@torch.library.custom_op(f"{NS}::nvfp4_amax", mutates_args=())
@fresh_outputs
def nvfp4_amax(x: Tensor, signs: Tensor | None, axis: int) -> Tensor:
    """fp32 amax (0-dim) of the NVFP4 operand of the 2-D x with blocks along `axis` (formats.nvfp4.nvfp4_operand:
    axis 0 zero-pads and transposes, axis 2 takes 16x16 tiles, `signs` applies the random Hadamard transform); NaN
    propagates."""
    t = F.nvfp4_operand(x, axis, signs)
    return t.float().abs().amax() if t.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


@nvfp4_amax.register_fake
def _(x, signs, axis):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::nvfp4_qdq", mutates_args=())
@fresh_outputs
def nvfp4_qdq(x: Tensor, amax: Tensor | None, signs: Tensor | None, axis: int, four_over_six: bool, rule: str,
              stochastic: bool, seed: int, seed_tensor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """formats.nvfp4.qdq_nvfp4: (e2m1 * s_blk in bf16, laid out like x ([R, C], or [ceil16(R), C] for axis 0), the
    decode global) of x's NVFP4 operand under the global scale of `amax` (None: the operand's own amax).
    seed_tensor (one int64, on x's device), when given, replaces `seed` with the same draws: a seed computed on the
    device (a compiled graph's step counter) that no kernel launch has to read on the host."""
    if seed_tensor is not None:
        check_seed_tensor(seed_tensor, x)
        seed = seed_tensor.reshape(())
    return F.qdq_nvfp4(x, amax, axis=axis, signs=signs, four_over_six=four_over_six, rule=rule,
                       stochastic=stochastic, seed=seed)


def check_seed_tensor(seed: Tensor, x: Tensor) -> None:
    """A stochastic-rounding seed given as a tensor: one int64 value (0-dim or [1]) on x's device."""
    if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != x.device:
        raise ValueError(f"seed_tensor must be one int64 value on {x.device} (the tensor it seeds), got {seed.dtype} of shape "
                         f"{tuple(seed.shape)} on {seed.device}")


def nvfp4_qdq_fake(x, axis):
    """The outputs nvfp4_qdq (and its csrc kernel) give for x: [R, C] bf16 ([ceil16(R), C] for axis 0), fp32 0-dim."""
    r, c = x.shape
    rows = -(-r // F.NVFP4_BLOCK) * F.NVFP4_BLOCK if axis == 0 else r
    return x.new_empty((rows, c), dtype=torch.bfloat16), x.new_empty((), dtype=torch.float32)


@nvfp4_qdq.register_fake
def _(x, amax, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor=None):
    return nvfp4_qdq_fake(x, axis)


# ---------------------------------------------------------------- MXFP4
@torch.library.custom_op(f"{NS}::quantize_mxfp4", mutates_args=())
@fresh_outputs
def quantize_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    return F.quantize_mxfp4(x)


@quantize_mxfp4.register_fake
def _(x):
    *lead, k = x.shape
    return x.new_empty((*lead, k // 2), dtype=torch.uint8), x.new_empty((*lead, k // 32), dtype=torch.uint8)


@torch.library.custom_op(f"{NS}::dequantize_mxfp4", mutates_args=())
@fresh_outputs
def dequantize_mxfp4(packed: Tensor, scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    return F.dequantize_mxfp4(packed, scales, out_dtype)


@dequantize_mxfp4.register_fake
def _(packed, scales, out_dtype):
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=out_dtype)


# ---------------------------------------------------------------- Hadamard
@torch.library.custom_op(f"{NS}::rht", mutates_args=())
@fresh_outputs
def rht(x: Tensor, signs: Tensor) -> Tensor:
    """Random Hadamard transform of 16-chunks of the last dim, result in fp32, contiguous (whatever x's layout: the
    CUDA kernel writes it so, and a compiled graph's fake must agree)."""
    return F.rht(x, signs).contiguous()


@rht.register_fake
def _(x, signs):
    return x.new_empty(x.shape, dtype=torch.float32)
