"""QLoRA x recipe: the base GEMMs of a quantized model in the recipe's precision.

The contract: the QLoRA format (SurogateConfig) decides how the frozen base weights are STORED; the recipe
decides the precision of the base GEMMs' compute, activations and gradients. apply_recipe attaches a
`BaseRecipeGemm` to every surogate_hf quantized base linear (nn.linear.QuantizedLinear, as `recipe_gemm`); its
forward asks it first. Per recipe:

| recipe | base forward y = x W^T | base dgrad dx = dy W |
|---|---|---|
| none | the format's own GEMM (weight-only decode in the GEMM; fp8 bases: W8A8 1x128 / 128x128, weight-only below 16M elements, formats.fp8_linear_weight_only) | same |
| bf16 (matmul_dtype bf16/fp32) | weight-only: the weight decoded to the matmul dtype, fp32 accumulation | the same in gradient_dtype |
| fp8-hybrid, fp8_scaling delayed | E4M3 x (its state row) x E4M3 W (the decoded weight, its own row) | E5M2 dy x E4M3 W^T |
| fp8-hybrid, fp8_scaling blockwise | x 1x128 tiles x W 128x128 blocks of the decoded weight | dy 1x128 tiles x W |
| either FP8 scaling, on a 128x128 fp8 base | the W8A8 GEMM: x 1x128 E4M3 tiles x the stored blocks (the format's own linear from 16M elements on; below, where that is weight-only, the recipe runs the same W8A8 kernels: the base's cached W8A8 plan on CUDA, the op on CPU and under compile) | dy 1x128 E4M3 tiles x W |
| nvfp4 | x NVFP4 1x16 (RNE) x W NVFP4 (the decoded weight, 1x16 along K; fp4_weight_blocks="2d": 16x16 tiles) | dy NVFP4 1x16 (stochastic rounding) x W (1x16 along N; 2d: the tiles transposed) |

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
from ..nn.linear import planned_linear, use_cuda_plan
from ..ops import linear as _linear_ops  # noqa: F401  (fp8_block_linear, fp8_block_linear_dgrad)
from ..ops import quant as _quant_ops  # noqa: F401  (quantize_nvfp4)
from ..ops import recipe as _recipe_ops  # fp8_scaled_mm, nvfp4_mm; below_autograd
from . import fp8_blockwise
from .bf16 import FloatBackward, float_mm
from .config import TORCH_DTYPES, RecipeConfig
from .fp8_hybrid import cast, scaled_mm, warn_emulation_once
from .norm import input_handoff
from .nvfp4 import ROLE_DGRAD, sr_seed, sr_seeds_traced, take_sr_step
from .nvfp4 import gemm as nvfp4_gemm
from .nvfp4 import qdq as nvfp4_qdq



def _decode(fmt, n, k, keys, tensors, dtype) -> Tensor:
    return fmt.dequantize(dict(zip(keys, tensors)), n, k, dtype)


class _BaseGemmFn(torch.autograd.Function):
    """y = x W^T over a frozen quantized base in a recipe's precision. `kind` names the class below holding the
    forward and the dgrad (_GEMMS), `args` their recipe arguments; the packed slots are saved (no copy) and decoded
    again for the dgrad. Only tensors and constants cross it, so dynamo traces it."""

    @staticmethod
    def forward(ctx, x, kind, args, fmt, n, k, keys, tensors):
        # the slots come as one tuple: dynamo (torch 2.13) misbinds an autograd.Function's *varargs of two or more
        # tensors
        gemms = _GEMMS[kind]
        ctx.gemms, ctx.args = gemms, args
        ctx.fmt, ctx.n, ctx.k, ctx.keys, ctx.x_shape = fmt, n, k, keys, x.shape
        ctx.save_for_backward(*tensors)
        with _recipe_ops.below_autograd():  # the decode and quantize ops skip their autograd wrappers
            y = gemms.forward(x.reshape(-1, k), lambda dtype: _decode(fmt, n, k, keys, tensors, dtype), args)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            saved = ctx.saved_tensors
            decode = lambda dtype: _decode(ctx.fmt, ctx.n, ctx.k, ctx.keys, saved, dtype)  # noqa: E731
            with _recipe_ops.below_autograd():
                dx = ctx.gemms.dgrad(dy.reshape(-1, ctx.n), decode, ctx.args).reshape(ctx.x_shape)
        return dx, None, None, None, None, None, None, None


class _Float:
    """bf16 recipe: weight-only GEMMs on the decoded weight. args = (matmul dtype, gradient dtype)."""

    @staticmethod
    def forward(x2d, decode, args):
        return float_mm(x2d, decode(args[0]), args[0], x2d.dtype)

    @staticmethod
    def dgrad(dy2d, decode, args):
        return FloatBackward(args[1]).backward(dy2d, None, decode(args[1]), True, False)[0]


class _Fp8Delayed:
    """fp8-hybrid, delayed scaling: E4M3 x and W forward, E5M2 dy x E4M3 W^T dgrad.
    args = ((scale, scale_inv, amax, dy_amax) of the flat state, the base's (x, W, dy) rows, record, current,
    fast_accum, (xq, x dequant scale) handed over by a FusedRMSNorm or None)."""

    @staticmethod
    def forward(x2d, decode, args):
        (scale, scale_inv, amax, _), rows, record, current, fast_accum, pre = args
        if pre is not None:  # x's cast written by the FusedRMSNorm that produced x (recipes.norm)
            xq, x_sinv = pre
        else:
            xq, _, x_sinv = cast(x2d, scale, scale_inv, amax, rows[0], F.E4M3, False, record, current)
        wq, _, w_sinv = cast(decode(x2d.dtype), scale, scale_inv, amax, rows[1], F.E4M3, False, record, current)
        return scaled_mm(xq, wq, x_sinv, w_sinv, None, x2d.dtype, fast_accum)

    @staticmethod
    def dgrad(dy2d, decode, args):
        (scale, scale_inv, amax, dy_amax), rows, _, current, _, _ = args
        dyq, _, dy_sinv = cast(dy2d, scale, scale_inv, dy_amax, rows[2], F.E5M2, False, True, current, amax_row=0)
        # the forward's scale for W (no update in between); W^T [K, N] is the K-major operand of dx = dy W
        _, wqt, w_sinv = cast(decode(dy2d.dtype), scale, scale_inv, amax, rows[1], F.E4M3, True, False, current)
        return scaled_mm(dyq, wqt, dy_sinv, w_sinv, None, dy2d.dtype)


class _Fp8Blockwise:
    """fp8-hybrid blockwise on a base whose storage is not 128x128 fp8: the decoded weight cast to 128x128 blocks."""

    @staticmethod
    def _blocks(decode, dtype):
        return fp8_blockwise.quantize_weight(decode(dtype))

    @staticmethod
    def forward(x2d, decode, args):
        wq, ws = _Fp8Blockwise._blocks(decode, x2d.dtype)
        return torch.ops.surogate.fp8_block_linear(x2d, wq, ws, *fp8_blockwise.BLOCK)

    @staticmethod
    def dgrad(dy2d, decode, args):
        wq, ws = _Fp8Blockwise._blocks(decode, dy2d.dtype)
        return torch.ops.surogate.fp8_block_linear_dgrad(dy2d, wq, ws, *fp8_blockwise.BLOCK)


class _Fp8Stored:
    """Either FP8 scaling on a small 128x128 fp8 base, whose own linear is weight-only (formats.fp8_linear_weight_only):
    the recipe asks for FP8 compute, so its stored blocks go through the W8A8 block GEMM (x and dy in 1x128 E4M3
    tiles), as the larger fp8 bases' own linear does. args = (codes, scale_inv)."""

    @staticmethod
    def forward(x2d, decode, args):
        return torch.ops.surogate.fp8_block_linear(x2d, *args, *fp8_blockwise.BLOCK)

    @staticmethod
    def dgrad(dy2d, decode, args):
        return torch.ops.surogate.fp8_block_linear_dgrad(dy2d, *args, *fp8_blockwise.BLOCK)


class _Nvfp4:
    """nvfp4 recipe: FP4 x (1x16, RNE) x W (16x16 tiles of the decoded weight, or 1x16 along K with
    fp4_weight_blocks="1d"); dgrad FP4 dy (1x16, stochastic rounding with the seed in args, or RNE) x the same tiles
    transposed (or W in 1x16 blocks along N). args = (four_over_six, rule, sr, dgrad seed (an int, or one int64 tensor
    when traced), 1d weight blocks, forward in x's dtype (recipes.switch)).
    Operands as recipes.nvfp4 makes them (bf16 e2m1 * s_blk, one GEMM with the globals in its epilogue)."""

    @staticmethod
    def forward(x2d, decode, args):
        fos, rule, _, _, w1d, high_forward = args
        if high_forward:  # weight-only, as the bf16 recipe's base forward
            return float_mm(x2d, decode(x2d.dtype), x2d.dtype, x2d.dtype)
        xv, xg = nvfp4_qdq(x2d, 1, fos, rule)
        wv, wg = nvfp4_qdq(decode(torch.float32), 1 if w1d else 2, fos, rule)
        return nvfp4_gemm(xv, wv.t(), xg, wg, None, x2d.dtype)

    @staticmethod
    def dgrad(dy2d, decode, args):
        fos, rule, sr, seed, w1d, _ = args
        dyv, dyg = nvfp4_qdq(dy2d, 1, fos, rule, sr, seed)
        wv, wg = nvfp4_qdq(decode(torch.float32), 0 if w1d else 2, fos, rule)
        return nvfp4_gemm(dyv, wv, dyg, wg, None, dy2d.dtype)


_GEMMS = {"float": _Float, "fp8": _Fp8Delayed, "blockwise": _Fp8Blockwise, "fp8_stored": _Fp8Stored, "nvfp4": _Nvfp4}


def base_gemm_kind(base, cfg: RecipeConfig) -> str:
    """Which of _GEMMS runs `base`'s GEMMs under `cfg` ("native": the format's own, no recipe GEMM).

    A 128x128 fp8 base keeps its own W8A8 GEMMs under both FP8 scalings: its weight already is E4M3 with 128x128
    block scales, so the delayed recipe's per-tensor cast of it would quantize the weight a second time (less
    accurate than the stored one), and its own kernels (x and dy in 1x128 E4M3 tiles, finer than one per-tensor
    scale) run with no decode (measured at the Qwen3-1.7B shape, QLoRA: 24,353 tok/s native vs 19,935 through
    the per-tensor path, 08618da)."""
    if cfg.recipe == "nvfp4":
        return "nvfp4"
    if cfg.uses_fp8():
        native = base.quant_format == "fp8" and getattr(base.fmt, "block_size", None) == fp8_blockwise.BLOCK
        if native:  # (a small one's own linear is weight-only: the recipe's FP8 compute calls the W8A8 op itself)
            return "fp8_stored" if base.fmt.weight_only(base.out_features, base.in_features) else "native"
        return "blockwise" if cfg.fp8_scaling == "blockwise" else "fp8"
    own = base.quant_format != "fp8" and cfg.resolved_matmul_dtype() == cfg.resolved_gradient_dtype() == "bf16"
    return "native" if own else "float"


class BaseRecipeGemm:
    """The recipe's GEMMs for one quantized base linear (`base.recipe_gemm`, set by apply_recipe).

    __call__(x) -> y without bias, or None when the format's own GEMM already is the recipe's (the base then
    runs its usual path). For fp8-hybrid with delayed scaling the base owns three rows of the model's flat
    state, like a RecipeLinear (fp8_rows, fp8_rows_t and the fp8_dy_amax buffer are set on the base module).
    """

    def __init__(self, base, cfg: RecipeConfig, index: int, state=None, layer: int | None = None, name: str = ""):
        self.base, self.cfg, self.index = base, cfg, index
        self.state = state
        self.last_seed = 0  # nvfp4, eager: the dgrad seed of the last training forward (reused by a recompute)
        self.high_precision = None  # nvfp4: the GEMMs a precision switch moved to model_dtype (recipes.switch)
        self.kind = base_gemm_kind(base, cfg)
        if self.kind == "nvfp4":
            for dim, v in (("in_features", base.in_features), ("out_features", base.out_features)):
                if v % F.NVFP4_BLOCK:
                    raise ValueError(
                        f"recipe='nvfp4' on the quantized base {name or type(base).__name__} needs {dim} to be a "
                        f"multiple of 16 (16x16 weight blocks), got {v}; add it to modules_to_not_convert"
                    )
            # the stochastic-rounding step (recipes.nvfp4.take_sr_step; not in checkpoints: the adapters are what a
            # QLoRA run saves) and the index as tensors, which a compiled graph reads: one graph for every layer
            dev = next(iter(base._tensors().values())).device
            base.register_buffer("fp4_sr_step", torch.zeros((), dtype=torch.int64, device=dev), persistent=False)
            base.register_buffer("recipe_index_t", torch.tensor(index, device=dev), persistent=False)
        elif self.kind == "fp8":
            if state is None or layer is None:
                raise ValueError("BaseRecipeGemm: fp8-hybrid with delayed scaling needs the model's scaling state")
            base.fp8_layer, base.fp8_rows = layer, state.rows(layer)
            base.register_buffer("fp8_rows_t", torch.tensor(base.fp8_rows, device=state.scale.device), persistent=False)
            base.register_buffer("fp8_dy_amax", torch.zeros(1, device=state.scale.device), persistent=False)
            state.register_layer(layer, self)  # the state reads fp8_dy_amax and re-shares rows after a load through us
        elif self.kind == "float":
            self.float_spec = (TORCH_DTYPES[cfg.resolved_matmul_dtype()], TORCH_DTYPES[cfg.resolved_gradient_dtype()])

    def __repr__(self) -> str:
        switched = f", {self.high_precision} GEMMs switched to model dtype" if self.high_precision else ""
        return f"BaseRecipeGemm(recipe={self.cfg.recipe}, kind={self.kind}{switched})"

    # ---- an FP8 consumer of the state (fp8 kind): what Fp8ScalingState and recipes.norm.input_handoff read
    _fp8_backward = True  # the dgrad casts dy to E5M2; the frozen base never needs x's transpose

    @property
    def scaling_state(self):
        return self.state

    @property
    def weight(self):
        return self.base.weight

    @property
    def fp8_rows(self):
        return self.base.fp8_rows

    @property
    def fp8_dy_amax(self):
        return self.base.fp8_dy_amax

    def _share_input_row(self, row: int) -> None:
        base = self.base
        self.state.share_x_row(base.fp8_layer, row)
        base.fp8_rows = (row, *base.fp8_rows[1:])
        with torch.no_grad():
            base.fp8_rows_t[0] = row

    def __call__(self, x: Tensor) -> Tensor | None:
        if self.kind == "native" or self.high_precision == "all":  # all: the format's own weight-only GEMMs
            return None
        base = self.base
        n, k = base.out_features, base.in_features
        tensors = base._tensors()
        keys = tuple(tensors)
        if self.kind == "float":
            args = self.float_spec
        elif self.kind == "blockwise":
            args = ()
        elif self.kind == "fp8_stored":
            if use_cuda_plan(x):  # eager CUDA: the base's W8A8 plan, the kernels a larger fp8 base's own linear runs
                return planned_linear(x, base._w8a8_plan())
            args = (tensors[""], tensors["_scale_inv"])
        elif self.kind == "nvfp4":
            sr = not self.cfg.no_fp4_stochastic_rounding
            seed = 0
            if torch.compiler.is_compiling():  # the step read and advanced in the graph, the seed hashed there
                if sr and torch.is_grad_enabled():
                    seed = sr_seeds_traced(self.cfg.seed, base.recipe_index_t, take_sr_step(base))[ROLE_DGRAD]
            else:
                warn_emulation_once("nvfp4_mm", x.device, "the NVFP4 recipe GEMM (no FP4 tensor cores used)")
                if sr and torch.is_grad_enabled():
                    if torch._C._current_graph_task_id() != -1:  # an activation-checkpoint recompute: no new step
                        seed = self.last_seed
                    else:
                        seed = self.last_seed = sr_seed(self.cfg.seed, self.index, take_sr_step(base), ROLE_DGRAD)
            args = (self.cfg.four_over_six, self.cfg.four_over_six_rule, sr, seed, self.cfg.fp4_weight_blocks == "1d",
                    self.high_precision == "forward")
        else:
            st = self.state
            compiling = torch.compiler.is_compiling()
            if not compiling:
                warn_emulation_once("fp8_scaled_mm", x.device, "the FP8 recipe GEMM")
            rows = base.fp8_rows_t if compiling else base.fp8_rows
            record, current = torch.is_grad_enabled(), not st.initialized
            pre = None
            if record and not compiling:
                got = input_handoff(self, x, False)
                pre = None if got is None or current else (got[0], got[2])
            args = ((st.scale, st.scale_inv, st.amax, base.fp8_dy_amax), rows, record, current,
                    self.cfg.fp8_fast_accum, pre)
        return _BaseGemmFn.apply(x, self.kind, args, base.fmt, n, k, keys, tuple(tensors.values()))
