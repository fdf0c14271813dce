"""FusedRMSNorm: transformers' RMSNorm in one kernel each way, handing its FP8-cast output to the linears it feeds.

Why: in an eager step the model's own glue costs as much GPU time as the GEMMs (an fp32 RMSNorm is ~6 kernels
forward and ~10 backward, each a full pass), and an FP8 linear adds a cast pass over its input. Transformer
Engine's answer is LayerNormLinear: the norm kernel writes the FP8 input of the next GEMM. This module does the
same without touching any forward method: apply_recipe swaps each recognised RMSNorm for a FusedRMSNorm that
keeps the same `weight` Parameter (same state_dict key) and the same formula (NORM_FORMULAS, tested against the
stock modules), and
  - eager CUDA: the extension's surogate::ext_rmsnorm (csrc/norm: one kernel forward, a C++ autograd node with one
    kernel backward, plus a column sum when the weight trains), followed by the extension's FP8 cast of its output
    for the hand-off; without the extension one Triton kernel forward (writing the hand-off's cast itself) and one
    backward (kernels.triton_norm);
  - CPU and under torch.compile: the stock formula in torch ops (the reference; inductor fuses it);
  - FP8 hand-off (eager, training, after the first step): the norm tags its output with itself. An FP8 recipe
    linear that receives that very tensor links to the norm once; from then on the linears fed by one norm
    share one x row of the delayed-scaling state (same tensor, same amax, same scale: q/k/v, gate/up), and the
    norm writes the FP8 cast (and its transpose, for the weight gradients) with that scale in its own kernel.
    The linears take it instead of casting: one cast pass per norm instead of one per linear, and one saved
    FP8 transpose instead of three. A tensor changed in place after the norm (version counter) is not handed
    off. On CPU the same hand-off runs with the reference cast, so its logic is what the CPU tests check.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import formats as F
from ..kernels import fp8_cast, probe

# transformers RMSNorm classes by formula. "llama": weight * to_input_dtype(x32 * rstd);
# "gemma": to_input_dtype((x32 * rstd) * (1 + weight32)). tests/recipes/test_recipes_norm.py checks each class that the
# installed transformers has against this table, bit for bit on CPU (and fails when upstream changes a formula).
NORM_FORMULAS = {
    "LlamaRMSNorm": "llama",
    "Qwen2RMSNorm": "llama",
    "Qwen3RMSNorm": "llama",
    "Qwen3MoeRMSNorm": "llama",
    "MistralRMSNorm": "llama",
    "MixtralRMSNorm": "llama",
    "Phi3RMSNorm": "llama",
    "OlmoeRMSNorm": "llama",
    "GraniteRMSNorm": "llama",
    "GemmaRMSNorm": "gemma",
    "Gemma2RMSNorm": "gemma",
    "Gemma3RMSNorm": "gemma",
}
_EPS_ATTRS = ("variance_epsilon", "eps")


def norm_formula(module: nn.Module) -> str | None:
    """The formula of a recognised RMSNorm module, or None (then it is left as it is)."""
    formula = NORM_FORMULAS.get(type(module).__name__)
    if formula is None or not isinstance(getattr(module, "weight", None), nn.Parameter) or module.weight.dim() != 1:
        return None
    if not any(isinstance(getattr(module, a, None), float) for a in _EPS_ATTRS):
        return None
    return formula


def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float, formula: str, out_dtype: torch.dtype | None) -> Tensor:
    """The transformers formulas in torch ops (what the stock modules compute), then the optional output cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if formula == "gemma":
        y = (h * (1.0 + weight.float())).type_as(x)
    else:
        y = weight * h.to(x.dtype)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def _tn():
    return probe.triton_kernels("triton_norm", "FusedRMSNorm's CUDA kernels")


_ext_op = None  # surogate::ext_rmsnorm once the extension is found loaded, False without it
EXT_MAX_COLS = 16384  # csrc/norm/rmsnorm_op.cpp's limit
# False: the Triton kernels even with the extension loaded (benchmarks/bench_e2e.py's `_triton_norms` A/B setups)
EXT_RMSNORM = True


def _ext_rmsnorm(x: Tensor, weight: Tensor, out_dtype: torch.dtype):
    """The extension's op when it takes this call (x fp32 / bf16 / fp16, weight fp32 / bf16, out x's dtype or fp32,
    rows of at most EXT_MAX_COLS), else None: the Triton path then runs, and without the extension says so once."""
    global _ext_op
    if not EXT_RMSNORM:
        return None
    if not _ext_op:
        from ..kernels import ext
        from ..ops._warn import warn_once

        if _ext_op is None or ext.loaded():
            _ext_op = torch.ops.surogate.ext_rmsnorm.default if ext.load(build=False) is not None else False
        if not _ext_op:
            warn_once("rmsnorm_ext", "surogate_hf: FusedRMSNorm runs its Triton kernels from a Python autograd "
                      "Function (several times the host time per norm of the extension's C++ op, which small models' "
                      f"step time feels); the CUDA extension is {ext.status()[1]}")
            return None
    if (x.shape[-1] > EXT_MAX_COLS or weight.dtype not in (torch.float32, torch.bfloat16)
            or out_dtype not in (x.dtype, torch.float32) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    return _ext_op


class _RMSNormFn(torch.autograd.Function):
    """Eager CUDA: Triton forward (optionally writing the FP8 hand-off into `box`) and backward."""

    @staticmethod
    def forward(ctx, x, weight, eps, gemma, out_dtype, fp8, box):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd, q, qt = _tn().rmsnorm_fwd(x2d, weight, eps, gemma, out_dtype, fp8)
        box.extend((q, qt))
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.gemma, ctx.x_shape = gemma, x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = _tn().rmsnorm_bwd(dy.reshape(x2d.shape), x2d, weight, rstd, ctx.gemma, ctx.needs_input_grad[1])
        dw = dw.to(weight.dtype) if dw is not None else None
        return dx.reshape(ctx.x_shape), dw, None, None, None, None, None


class FusedRMSNorm(nn.Module):
    """A recognised transformers RMSNorm (same `weight` Parameter, same eps attribute name, same formula).

    out_dtype: the output dtype when it must differ from the stock module's (fp32 master weights with a bf16
    model: the activations stay bf16), else None.
    """

    def __init__(self, norm: nn.Module, out_dtype: torch.dtype | None = None):
        super().__init__()
        formula = norm_formula(norm)
        if formula is None:
            raise ValueError(f"FusedRMSNorm: {type(norm).__name__} is not a recognised RMSNorm ({sorted(NORM_FORMULAS)})")
        self.weight = norm.weight
        eps_attr = next(a for a in _EPS_ATTRS if isinstance(getattr(norm, a, None), float))
        self.norm_eps = getattr(norm, eps_attr)
        setattr(self, eps_attr, self.norm_eps)  # the stock attribute name too (model code may read it)
        self.formula, self.out_dtype, self.stock_class = formula, out_dtype, type(norm).__name__
        # the FP8 hand-off, set when the first consumer links: (state, x row, write the transpose)
        self.__dict__["_fp8_group"] = None

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.norm_eps}, formula={self.formula} (fused {self.stock_class})"

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return rmsnorm_reference(x, self.weight, self.norm_eps, self.formula, self.out_dtype)
        group = self._fp8_group
        handoff = group is not None and torch.is_grad_enabled() and group[0].initialized
        if x.is_cuda:
            out_dtype = self.out_dtype or _stock_out_dtype(x, self.weight, self.formula)
            op = _ext_rmsnorm(x, self.weight, out_dtype)
            fp8 = None
            if handoff:
                st, row, transpose = group
                fp8 = (st.scale[row : row + 1], st.amax.view(torch.int32)[row : row + 1], F.E4M3, transpose)
            if op is not None:
                y = op(x, self.weight, self.norm_eps, self.formula == "gemma", out_dtype)
                if handoff:
                    # the extension's C++ norm, then its cast of y: one more read of y than the Triton kernel's fused
                    # cast (~11 us per norm at 8192 x 2048), for ~0.4 ms less host time per norm and step than that
                    # kernel's Python autograd Function (SmolLM2-135M profile, results/profile_fp8_eager_smollm2_135m.md)
                    with torch.no_grad():
                        box = fp8_cast.cast_fp8_into(y.detach().reshape(-1, y.shape[-1]), *fp8)
            else:
                box = []
                y = _RMSNormFn.apply(x, self.weight, self.norm_eps, self.formula == "gemma", out_dtype, fp8, box)
            if handoff:
                q, qt = box
                y._surogate_fp8 = (row, q, qt, st.scale_inv[row, 0], y._version)
        else:
            y = rmsnorm_reference(x, self.weight, self.norm_eps, self.formula, self.out_dtype)
            if handoff:
                from .fp8_hybrid import cast

                st, row, transpose = group
                q, qt, sinv = cast(y.detach().reshape(-1, y.shape[-1]), st.scale, st.scale_inv, st.amax, row, F.E4M3,
                                   transpose, True, False)
                y._surogate_fp8 = (row, q, qt, sinv, y._version)
        if torch.is_grad_enabled():
            y._surogate_norm = self  # lets the linears this tensor reaches link to this norm
        return y

    # ---- the FP8 hand-off (called by recipes.linear.RecipeLinear, eager only)
    def link(self, linear) -> None:
        """Make `linear` (an FP8 consumer fed by this norm's output, see input_handoff) one of this norm's consumers: it takes
        the group's x row (the first consumer's), and the norm writes the transpose if any consumer trains."""
        st = linear.scaling_state
        transpose = linear.weight.requires_grad and linear._fp8_backward
        if self._fp8_group is None:
            self.__dict__["_fp8_group"] = (st, linear.fp8_rows[0], transpose)
        elif self._fp8_group[0] is not st:
            return  # another model's state: no sharing
        else:
            st0, row, t0 = self._fp8_group
            linear._share_input_row(row)
            self.__dict__["_fp8_group"] = (st0, row, t0 or transpose)

    @staticmethod
    def handoff(x: Tensor, row: int, need_t: bool):
        """(xq 2D, xq^T or None, dequant scale) the norm wrote for `x` with `row`'s scale, or None."""
        got = getattr(x, "_surogate_fp8", None)
        if got is None or got[0] != row or got[4] != x._version or (need_t and got[2] is None):
            return None
        return got[1], got[2], got[3]


def carry_handoff(src: Tensor, view: Tensor) -> Tensor:
    """`view` (a reshape of `src`: same storage, same version counter) with src's FusedRMSNorm tags, so a layer that
    flattens its input before calling an FP8 consumer (surogate's PEFT LoRA layer) keeps the hand-off."""
    norm = getattr(src, "_surogate_norm", None)
    if norm is not None and view is not src and not torch.compiler.is_compiling():
        view._surogate_norm = norm
        fp8 = getattr(src, "_surogate_fp8", None)
        if fp8 is not None:
            view._surogate_fp8 = fp8
    return view


def input_handoff(consumer, x: Tensor, need_t: bool):
    """The FP8 cast of x a FusedRMSNorm wrote for `consumer`'s x row (linking the consumer to that norm the first
    time it receives the norm's output), or None. consumer: an FP8 RecipeLinear, or the BaseRecipeGemm of a QLoRA
    base (recipes.qlora): anything with scaling_state, fp8_rows, weight, _fp8_backward and _share_input_row."""
    norm = getattr(x, "_surogate_norm", None)
    if norm is None:
        return None
    mine = consumer.__dict__.get("_input_norm")
    if mine is not norm:
        if mine is not None:
            return None  # fed by another norm before: keep casting for ourselves
        norm.link(consumer)
        consumer.__dict__["_input_norm"] = norm
    return norm.handoff(x, consumer.fp8_rows[0], need_t)


def _stock_out_dtype(x: Tensor, weight: Tensor, formula: str) -> torch.dtype:
    return x.dtype if formula == "gemma" else torch.promote_types(weight.dtype, x.dtype)


def fuse_norms(model: nn.Module, out_dtype: torch.dtype | None) -> int:
    """Swap every recognised RMSNorm of `model` for a FusedRMSNorm (in place); returns how many."""
    swaps = [(name, m) for name, m in model.named_modules() if norm_formula(m) is not None]
    mods = dict(model.named_modules())
    for name, m in swaps:
        dt = out_dtype if out_dtype is not None and m.weight.dtype != out_dtype else None
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, FusedRMSNorm(m, dt))
    return len(swaps)
