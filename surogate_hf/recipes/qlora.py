"""QLoRA x recipe: the base GEMMs of a quantized model in the recipe's precision.

The contract: the QLoRA format (SurogateConfig) decides how the frozen base weights are STORED; the recipe
decides the precision of the base GEMMs' compute, activations and gradients. apply_recipe attaches a
`BaseRecipeGemm` to every surogate_hf quantized base linear (nn.linear.QuantizedLinear, as `recipe_gemm`); its
forward asks it first. Per recipe:

| recipe | base forward y = x W^T | base dgrad dx = dy W |
|---|---|---|
| none | the format's own GEMM (weight-only decode in the GEMM; fp8 bases: W8A8 1x128 / 128x128) | same |
| bf16 (matmul_dtype bf16/fp32) | weight-only: the weight decoded to the matmul dtype, fp32 accumulation | the same in gradient_dtype |
| fp8-hybrid, fp8_scaling delayed | E4M3 x (its state row) x E4M3 W (the decoded weight, its own row) | E5M2 dy x E4M3 W^T |
| fp8-hybrid, fp8_scaling blockwise | x 1x128 tiles x W 128x128 blocks (an fp8 128x128 base: its own blocks, the format's native GEMM) | dy 1x128 tiles x W |
| nvfp4 | x NVFP4 1x16 (RNE) x W NVFP4 16x16 blocks (of the decoded weight) | dy NVFP4 1x16 (stochastic rounding) x W^T |

The bf16 recipe keeps the format's own weight-only GEMM where it already is that (nvfp4 / mxfp4 / nf4 bases with
bf16 activations and bf16 gradients); an fp8 base under the bf16 recipe leaves W8A8 for the weight-only GEMM.

Memory: the base stays packed. Nothing dense or re-quantized is cached across steps (a per-step FP8 copy of every
base weight would cost 1-2 bytes per parameter, more than the 4-bit base itself): each forward decodes and casts
the weight, and the backward does it again for the dgrad; nothing weight-sized is saved for backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import formats as F
from ..ops import linear as _linear_ops  # noqa: F401  (fp8_block_linear, fp8_block_linear_dgrad)
from ..ops import quant as _quant_ops  # noqa: F401  (quantize_nvfp4, quantize_fp8_blocks)
from ..ops import recipe as _recipe_ops  # noqa: F401  (fp8_scaled_mm, nvfp4_mm)
from .bf16 import FloatBackward, float_mm
from .config import TORCH_DTYPES, RecipeConfig
from .fp8_hybrid import cast, scaled_mm, warn_emulation_once
from .nvfp4 import ROLE_DGRAD, sr_seed, transpose_nvfp4_2d

_BLOCK = (128, 128)


def _decode(fmt, n, k, keys, tensors, dtype) -> Tensor:
    return fmt.dequantize(dict(zip(keys, tensors)), n, k, dtype)


class _FloatBaseFn(torch.autograd.Function):
    """bf16 recipe on a base: weight-only GEMMs on the decoded weight (spec = (matmul dtype, gradient dtype))."""

    @staticmethod
    def forward(ctx, x, spec, fmt, n, k, keys, *tensors):
        x2d = x.reshape(-1, k)
        y = float_mm(x2d, _decode(fmt, n, k, keys, tensors, spec[0]), spec[0], x.dtype)
        ctx.spec, ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.x_shape = spec, fmt, n, k, keys, x.shape
        ctx.save_for_backward(*tensors)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            w = _decode(ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.saved_tensors, ctx.spec[1])
            dx, _ = FloatBackward(ctx.spec[1]).backward(dy.reshape(-1, ctx.n), None, w, True, False)
            dx = dx.reshape(ctx.x_shape)
        return (dx, None, None, None, None, None, *([None] * len(ctx.saved_tensors)))


class _Fp8BaseFn(torch.autograd.Function):
    """fp8-hybrid (delayed scaling) on a base: E4M3 x and W forward, E5M2 dy x E4M3 W^T backward.

    state = (scale, scale_inv, amax, dy_amax) of the model's flat state; rows = the base's (x, W, dy) rows;
    spec = (record, current, fast_accum)."""

    @staticmethod
    def forward(ctx, x, state, rows, spec, fmt, n, k, keys, *tensors):
        scale, scale_inv, amax, dy_amax = state
        record, current, fast_accum = spec
        x2d = x.reshape(-1, k)
        xq, _, x_sinv = cast(x2d, scale, scale_inv, amax, rows[0], F.E4M3, False, record, current)
        w = _decode(fmt, n, k, keys, tensors, x.dtype)
        wq, _, w_sinv = cast(w, scale, scale_inv, amax, rows[1], F.E4M3, False, record, current)
        y = scaled_mm(xq, wq, x_sinv, w_sinv, None, x.dtype, fast_accum)
        ctx.state, ctx.rows, ctx.current = state, rows, current
        ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.x_shape = fmt, n, k, keys, x.shape
        ctx.save_for_backward(*tensors)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            scale, scale_inv, amax, dy_amax = ctx.state
            dy2d = dy.reshape(-1, ctx.n)
            dyq, _, dy_sinv = cast(dy2d, scale, scale_inv, dy_amax, ctx.rows[2], F.E5M2, False, True, ctx.current,
                                   amax_row=0)
            w = _decode(ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.saved_tensors, dy.dtype)
            # the forward's scale for W (no update in between); W^T [K, N] is the K-major operand of dx = dy W
            _, wqt, w_sinv = cast(w, scale, scale_inv, amax, ctx.rows[1], F.E4M3, True, False, ctx.current)
            dx = scaled_mm(dyq, wqt, dy_sinv, w_sinv, None, dy.dtype).reshape(ctx.x_shape)
        return (dx, None, None, None, None, None, None, None, *([None] * len(ctx.saved_tensors)))


class _BlockwiseBaseFn(torch.autograd.Function):
    """fp8-hybrid blockwise on a base whose storage is not 128x128 fp8: the decoded weight cast to 128x128 blocks."""

    @staticmethod
    def forward(ctx, x, fmt, n, k, keys, *tensors):
        w = _decode(fmt, n, k, keys, tensors, x.dtype)
        wq, ws = torch.ops.surogate.quantize_fp8_blocks(w, _BLOCK[0], _BLOCK[1], False)
        y = torch.ops.surogate.fp8_block_linear(x.reshape(-1, k), wq, ws, _BLOCK[0], _BLOCK[1])
        ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.x_shape = fmt, n, k, keys, x.shape
        ctx.save_for_backward(*tensors)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            w = _decode(ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.saved_tensors, dy.dtype)
            wq, ws = torch.ops.surogate.quantize_fp8_blocks(w, _BLOCK[0], _BLOCK[1], False)
            dx = torch.ops.surogate.fp8_block_linear_dgrad(dy.reshape(-1, ctx.n), wq, ws, _BLOCK[0], _BLOCK[1])
            dx = dx.reshape(ctx.x_shape)
        return (dx, None, None, None, None, *([None] * len(ctx.saved_tensors)))


class _Nvfp4BaseFn(torch.autograd.Function):
    """nvfp4 recipe on a base: FP4 x (1x16, RNE) and W (16x16 blocks of the decoded weight); dgrad FP4 dy (1x16,
    stochastic rounding with seed `dgrad_seed`, or RNE) x the same W transposed. spec = (four_over_six, rule)."""

    @staticmethod
    def forward(ctx, x, spec, dgrad_seed, fmt, n, k, keys, *tensors):
        fos, rule, sr = spec
        x2d = x.reshape(-1, k)
        xq = torch.ops.surogate.quantize_nvfp4(x2d, False, fos, rule, False, 0, None)
        wq = torch.ops.surogate.quantize_nvfp4(_decode(fmt, n, k, keys, tensors, torch.float32), True, fos, rule,
                                               False, 0, None)
        y = torch.ops.surogate.nvfp4_mm(*xq, *wq, None, x.dtype)
        ctx.spec, ctx.seed = spec, dgrad_seed
        ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.x_shape = fmt, n, k, keys, x.shape
        ctx.save_for_backward(*tensors)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            fos, rule, sr = ctx.spec
            dyq = torch.ops.surogate.quantize_nvfp4(dy.reshape(-1, ctx.n), False, fos, rule, sr, ctx.seed, None)
            w = _decode(ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.saved_tensors, torch.float32)
            wt = transpose_nvfp4_2d(*torch.ops.surogate.quantize_nvfp4(w, True, fos, rule, False, 0, None))
            dx = torch.ops.surogate.nvfp4_mm(*dyq, *wt, None, dy.dtype).reshape(ctx.x_shape)
        return (dx, None, None, None, None, None, None, *([None] * len(ctx.saved_tensors)))


class BaseRecipeGemm:
    """The recipe's GEMMs for one quantized base linear (`base.recipe_gemm`, set by apply_recipe).

    __call__(x) -> y without bias, or None when the format's own GEMM already is the recipe's (the base then
    runs its usual path). For fp8-hybrid with delayed scaling the base owns three rows of the model's flat
    state, like a RecipeLinear (fp8_rows, fp8_rows_t and the fp8_dy_amax buffer are set on the base module).
    """

    def __init__(self, base, cfg: RecipeConfig, index: int, state=None, layer: int | None = None):
        self.base, self.cfg, self.index = base, cfg, index
        self.state = state
        self.sr_step = 0
        fmt = base.fmt
        native_blockwise = base.quant_format == "fp8" and getattr(fmt, "block_size", None) == _BLOCK
        if cfg.recipe == "nvfp4":
            for dim, v in (("in_features", base.in_features), ("out_features", base.out_features)):
                if v % F.NVFP4_BLOCK:
                    raise ValueError(f"recipe='nvfp4' on a quantized base needs {dim} to be a multiple of 16, got {v}")
            self.kind = "nvfp4"
        elif cfg.uses_fp8() and cfg.fp8_scaling == "blockwise":
            self.kind = "native" if native_blockwise else "blockwise"
        elif cfg.uses_fp8():
            self.kind = "fp8"
            if state is None or layer is None:
                raise ValueError("BaseRecipeGemm: fp8-hybrid with delayed scaling needs the model's scaling state")
            base.fp8_layer, base.fp8_rows = layer, state.rows(layer)
            base.register_buffer("fp8_rows_t", torch.tensor(base.fp8_rows, device=state.scale.device), persistent=False)
            base.register_buffer("fp8_dy_amax", torch.zeros(1, device=state.scale.device), persistent=False)
            state.register_layer(layer, base)
        else:
            matmul, grad = cfg.resolved_matmul_dtype(), cfg.resolved_gradient_dtype()
            own = base.quant_format != "fp8" and matmul == grad == "bf16"
            self.kind = "native" if own else "float"
            self.float_spec = (TORCH_DTYPES[matmul], TORCH_DTYPES[grad])

    def __repr__(self) -> str:
        return f"BaseRecipeGemm(recipe={self.cfg.recipe}, kind={self.kind})"

    def __call__(self, x: Tensor) -> Tensor | None:
        if self.kind == "native":
            return None
        base = self.base
        n, k = base.out_features, base.in_features
        tensors = base._tensors()
        keys = tuple(tensors)
        if self.kind == "float":
            return _FloatBaseFn.apply(x, self.float_spec, base.fmt, n, k, keys, *tensors.values())
        if self.kind == "blockwise":
            return _BlockwiseBaseFn.apply(x, base.fmt, n, k, keys, *tensors.values())
        if self.kind == "nvfp4":
            if not torch.compiler.is_compiling():
                warn_emulation_once("nvfp4_mm", x.device, "the NVFP4 recipe GEMM (no FP4 tensor cores used)")
            sr = not self.cfg.no_fp4_stochastic_rounding
            seed = 0
            if sr and torch.is_grad_enabled():
                seed = sr_seed(self.cfg.seed, self.index, self.sr_step, ROLE_DGRAD)
                self.sr_step += 1
            spec = (self.cfg.four_over_six, self.cfg.four_over_six_rule, sr)
            return _Nvfp4BaseFn.apply(x, spec, seed, base.fmt, n, k, keys, *tensors.values())
        st = self.state
        record = torch.is_grad_enabled()
        compiling = torch.compiler.is_compiling()
        if not compiling:
            warn_emulation_once("fp8_scaled_mm", x.device, "the FP8 recipe GEMM")
        rows = base.fp8_rows_t if compiling else base.fp8_rows
        state = (st.scale, st.scale_inv, st.amax, base.fp8_dy_amax)
        return _Fp8BaseFn.apply(x, state, rows, (record, not st.initialized, self.cfg.fp8_fast_accum), base.fmt, n,
                                k, keys, *tensors.values())
