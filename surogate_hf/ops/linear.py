"""Quantized-base linear ops: forward (y = x W^T) and input gradient (dx = dy W) for frozen bases.

The references below define the numerics; GPU kernels register under the same names:
- fp8 (128x128 block-scaled E4M3 weight): W8A8. The activation (forward) and the output gradient
  (backward) are quantized to E4M3 in 1x128 tiles along the GEMM's reduction dim, products
  accumulate in fp32, the output is in x's dtype. This is DeepSeek-V3's fine-grained recipe and what
  `torch.nn.functional.scaled_mm` runs block-scaled on Hopper. The fp8 base linear (nn FP8Format) takes
  these ops from 16M weight elements on and the fp8 recipes always; a smaller base is weight-only
  (formats.fp8_linear_weight_only: dequantize_fp8_blocks, then a plain linear).
- nvfp4, mxfp4, nf4: weight-only. The weight is decoded to x's dtype and multiplied with fp32
  accumulation (Hopper has no FP4 tensor cores: the kernels decode in registers, never into a dense
  weight in memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import Tensor

from .. import formats as F
from ._outputs import fresh_outputs

NS = "surogate"


def _fake_linear(x: Tensor, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# ---------------------------------------------------------------- fp8 block-scaled base
@torch.library.custom_op(f"{NS}::fp8_block_linear", mutates_args=())
@fresh_outputs
def fp8_block_linear(x: Tensor, w: Tensor, w_scale_inv: Tensor, block_n: int, block_k: int) -> Tensor:
    xq, xs = F.quantize_fp8_tiles(x, block_k)
    xd = F.dequantize_fp8_tiles(xq, xs, block_k, torch.float32)
    wd = F.dequantize_fp8_blocks(w, w_scale_inv, (block_n, block_k), torch.float32)
    return (xd @ wd.t()).to(x.dtype)


@fp8_block_linear.register_fake
def _(x, w, w_scale_inv, block_n, block_k):
    return _fake_linear(x, w.shape[0])


@torch.library.custom_op(f"{NS}::fp8_block_linear_dgrad", mutates_args=())
@fresh_outputs
def fp8_block_linear_dgrad(dy: Tensor, w: Tensor, w_scale_inv: Tensor, block_n: int, block_k: int) -> Tensor:
    dq, ds = F.quantize_fp8_tiles(dy, block_n)
    dd = F.dequantize_fp8_tiles(dq, ds, block_n, torch.float32)
    wd = F.dequantize_fp8_blocks(w, w_scale_inv, (block_n, block_k), torch.float32)
    return (dd @ wd).to(dy.dtype)


@fp8_block_linear_dgrad.register_fake
def _(dy, w, w_scale_inv, block_n, block_k):
    return _fake_linear(dy, w.shape[1])


# ---------------------------------------------------------------- nvfp4 weight-only
@torch.library.custom_op(f"{NS}::nvfp4_linear", mutates_args=())
@fresh_outputs
def nvfp4_linear(x: Tensor, packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    return Fn.linear(x, F.dequantize_nvfp4(packed, block_scale, global_scale, x.dtype))


@nvfp4_linear.register_fake
def _(x, packed, block_scale, global_scale):
    return _fake_linear(x, packed.shape[0])


@torch.library.custom_op(f"{NS}::nvfp4_linear_dgrad", mutates_args=())
@fresh_outputs
def nvfp4_linear_dgrad(dy: Tensor, packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    return dy @ F.dequantize_nvfp4(packed, block_scale, global_scale, dy.dtype)


@nvfp4_linear_dgrad.register_fake
def _(dy, packed, block_scale, global_scale):
    return _fake_linear(dy, packed.shape[1] * 2)


# ---------------------------------------------------------------- mxfp4 weight-only
@torch.library.custom_op(f"{NS}::mxfp4_linear", mutates_args=())
@fresh_outputs
def mxfp4_linear(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    return Fn.linear(x, F.dequantize_mxfp4(packed, scales, x.dtype))


@mxfp4_linear.register_fake
def _(x, packed, scales):
    return _fake_linear(x, packed.shape[0])


@torch.library.custom_op(f"{NS}::mxfp4_linear_dgrad", mutates_args=())
@fresh_outputs
def mxfp4_linear_dgrad(dy: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    return dy @ F.dequantize_mxfp4(packed, scales, dy.dtype)


@mxfp4_linear_dgrad.register_fake
def _(dy, packed, scales):
    return _fake_linear(dy, packed.shape[1] * 2)


# ---------------------------------------------------------------- nf4 weight-only
# packed: bitsandbytes' uint8 data; absmax: fp32 per block (double quantization already undone,
# formats.nf4.nf4_absmax); code: the 16 NF4 levels.
@torch.library.custom_op(f"{NS}::nf4_linear", mutates_args=())
@fresh_outputs
def nf4_linear(
    x: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, block_size: int, out_features: int, in_features: int
) -> Tensor:
    w = F.dequantize_nf4_raw(packed, absmax, code, block_size, (out_features, in_features), x.dtype)
    return Fn.linear(x, w)


@nf4_linear.register_fake
def _(x, packed, absmax, code, block_size, out_features, in_features):
    return _fake_linear(x, out_features)


@torch.library.custom_op(f"{NS}::nf4_linear_dgrad", mutates_args=())
@fresh_outputs
def nf4_linear_dgrad(
    dy: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, block_size: int, out_features: int, in_features: int
) -> Tensor:
    w = F.dequantize_nf4_raw(packed, absmax, code, block_size, (out_features, in_features), dy.dtype)
    return dy @ w


@nf4_linear_dgrad.register_fake
def _(dy, packed, absmax, code, block_size, out_features, in_features):
    return _fake_linear(dy, in_features)
