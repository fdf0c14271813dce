"""Fine-grained FP8 GEMMs (fp8_scaling='blockwise'): DeepSeek-V3's recipe, current scaling, no history.

forward  y  = x W^T   : x in 1x128 E4M3 tiles along K, W in 128x128 E4M3 blocks  (surogate::fp8_block_linear)
dgrad    dx = dy W    : dy in 1x128 E4M3 tiles along N, the same W blocks          (surogate::fp8_block_linear_dgrad)
wgrad    dW = dy^T x  : dy and x in 128x1 E4M3 tiles along the tokens              (surogate::fp8_tiles_wgrad)
Every tile and block is scaled by its own amax when it is cast, so there is no delayed-scaling state: one
outlier costs the precision of its own 128 values only, and E4M3 serves the gradients too (what E5M2's range
bought per-tensor scaling). The forward and dgrad ops are the fp8 QLoRA base's (native block-scaled kernels on
SM90, any shape); the wgrad op's CUDA kernel is kernels/triton_fp8_wgrad.py (elsewhere: exact emulation, warned once).

The weight's 128x128 cast is taken once per optimizer step (from an fp32 master directly) and reused by
micro-batches and checkpoint recomputes, like the delayed path's.
"""

from __future__ import annotations

import torch

from ..ops import linear as _linear_ops  # noqa: F401  (registers fp8_block_linear, fp8_block_linear_dgrad)
from ..ops import recipe as _recipe_ops  # noqa: F401  (registers fp8_tiles_wgrad)
from .bf16 import FloatBackward
from .fp8_hybrid import warn_emulation_once

TILE = 128
BLOCK = (128, 128)


def quantize_weight(w: torch.Tensor):
    """(E4M3 [N, K], fp32 inverse scales [ceil(N/128), ceil(K/128)]) of a weight, 128x128 blocks."""
    return torch.ops.surogate.quantize_fp8_blocks(w, BLOCK[0], BLOCK[1], False)


class Fp8BlockwiseLinearFn(torch.autograd.Function):
    """y = x W^T + b with fine-grained FP8 operands; only tensors and constants cross it (dynamo traces it whole).

    wq / ws: the weight's 128x128 cast; grad: the backward's format, "e4m3" (FP8 tiles) or a float dtype name
    ('bf16' / 'fp32': the recipe's float backward on the master weight).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, wq, ws, grad):
        x2d = x.reshape(-1, x.shape[-1])
        y = torch.ops.surogate.fp8_block_linear(x2d, wq, ws, BLOCK[0], BLOCK[1])
        if bias is not None:  # the block GEMM (no bias epilogue) rounds first; the bias is added in fp32 to that
            y = (y.float() + bias.float()).to(y.dtype)
        ctx.save_for_backward(x2d, weight, wq, ws)
        ctx.grad, ctx.x_shape = grad, x.shape
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, wq, ws = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        if ctx.grad == "e4m3":
            dx = torch.ops.surogate.fp8_block_linear_dgrad(dy2d, wq, ws, BLOCK[0], BLOCK[1]) if need_dx else None
            dw = None
            if need_dw:
                if not torch.compiler.is_compiling():
                    warn_emulation_once("fp8_tiles_wgrad", dy.device, "the fine-grained FP8 weight gradient")
                dw = torch.ops.surogate.fp8_tiles_wgrad(dy2d, x2d, TILE, torch.float32)
        else:
            dx, dw = FloatBackward(ctx.grad).backward(dy2d, x2d, weight, need_dx, need_dw)
        dx = dx.reshape(ctx.x_shape) if dx is not None else None
        dw = dw.to(weight.dtype) if dw is not None and dw.dtype != weight.dtype else dw
        db = dy2d.float().sum(0).to(ctx.b_dtype) if need_db else None
        return dx, dw, db, None, None, None


def gradient_format(cfg) -> str:
    """'e4m3' when the recipe's gradients are FP8 (fp8-hybrid; matmul_dtype e4m3 with gradient_dtype e5m2), else the
    float gradient dtype's name."""
    grad = cfg.resolved_gradient_dtype()
    return "e4m3" if grad == "e5m2" else grad

