"""RecipeLinear: an nn.Linear whose three GEMMs run in the recipe's formats, and apply_recipe().

RecipeLinear keeps nn.Linear's `weight` / `bias` Parameters (same objects, same state_dict keys).
FP8 layers keep their delayed-scaling state in the model's one flat Fp8ScalingState
(`surogate_fp8_state` on the model apply_recipe converted; `fp8_state` on a layer built on its
own); nvfp4 layers hold `fp4_sr_step`. The fp8 linear is fp8_hybrid.Fp8LinearFn, the bf16 one
_FloatLinearFn (both take only tensors and constants, so dynamo traces them whole), nvfp4 an autograd
Function over nvfp4.NVFP4Engine; the output and the input gradient are in the input's dtype, the weight
gradient in the weight's (master) dtype.

Master / work weights: when the weight's dtype (master_dtype) differs from model_dtype, the GEMMs
use a work copy in model_dtype (fp8: the FP8 cast of the master, no bf16 copy in between), cached
and rebuilt after each optimizer step (scaling.current_generation, moved by torch.optim's global
step hook, so fused optimizers that do not bump version counters are seen too) or when the master
changes otherwise (its version counter or storage); the gradient still lands on the fp32 master.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from .. import formats as F
from ..ops import recipe as _recipe_ops  # noqa: F401  (registers surogate::fp8_scaled_mm, nvfp4_mm)
from .bf16 import FloatBackward, FloatEngine, float_mm
from .config import (
    CONFIG_ATTR,
    FP8_SMALL_LINEAR,
    RECIPES,
    TORCH_DTYPES,
    RecipeConfig,
    check_device,
    dtype_name,
    resolve_recipe,
)
from ..nn.convert import decoder_layer_names, module_plan
from . import fp8_blockwise
from .fp8_hybrid import Fp8LinearFn, RowViews, cast, native_linear, native_linear_ok, warn_emulation_once
from ..nn.linear import QuantizedLinear
from .norm import FusedRMSNorm, fuse_norms, input_handoff
from .qlora import BaseRecipeGemm, base_gemm_kind
from .nvfp4 import ROLE_DGRAD, ROLE_WGRAD, NVFP4Engine, Nvfp4LinearFn, sr_seed, sr_seeds_traced, take_sr_step
from .scaling import Fp8ScalingState, current_generation, install_step_hook


FP8_STATE_NAME = "surogate_fp8_state"


class _FloatLinearFn(torch.autograd.Function):
    """The bf16 recipe's linear (bf16.FloatEngine numerics) with only tensors and constants crossing it, so dynamo
    traces it whole: spec = (matmul dtype, gradient dtype)."""

    @staticmethod
    def forward(ctx, x, weight, bias, work, spec):
        w = weight if work is None else work
        x2d = x.reshape(-1, x.shape[-1])
        y2d = float_mm(x2d, w, spec[0], x.dtype, bias)
        ctx.save_for_backward(x2d, w)
        ctx.grad_dtype, ctx.x_shape, ctx.w_dtype = spec[1], x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y2d.reshape(*x.shape[:-1], y2d.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2d, w = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw = FloatBackward(ctx.grad_dtype).backward(dy2d, x2d, w, need_dx, need_dw)
        dx = dx.reshape(ctx.x_shape) if dx is not None else None
        dw = dw.to(ctx.w_dtype) if dw is not None else None
        db = dy2d.float().sum(0).to(ctx.b_dtype) if need_db else None
        return dx, dw, db, None, None


class RecipeLinear(nn.Linear):
    """nn.Linear with recipe GEMMs. `quantize=False` runs the plain model-dtype GEMM (layers the
    recipe leaves in the model dtype but that still need work weights from fp32 masters)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: RecipeConfig,
        quantize: bool = True,
        recipe_index: int = 0,
        device=None,
        dtype=None,
        state_device=None,
        fp8_state: Fp8ScalingState | None = None,
        fp8_layer: int = 0,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        model_dtype = config.resolved_model_dtype()
        self.config, self.quantize, self.recipe_index = config, quantize, recipe_index
        self.compute_dtype = TORCH_DTYPES[model_dtype]
        state_device = device if state_device is None else state_device
        self._work, self._work_key, self._checked_devices = None, None, set()
        install_step_hook()  # weight caches are keyed on the optimizer-step generation
        self.fwd_sr_step = -1  # nvfp4, eager: the step of the last training forward (a recompute reuses it)
        self.fp4_high_precision = None  # nvfp4: the GEMMs a precision switch moved to model_dtype (recipes.switch)
        self._has_sr_step = quantize and config.recipe == "nvfp4"
        self._blockwise = False
        if not quantize:
            self.engine = FloatEngine(model_dtype, model_dtype)
        elif config.recipe == "nvfp4":
            for dim, n in (("in_features", in_features), ("out_features", out_features)):
                if n % F.NVFP4_BLOCK:
                    raise ValueError(f"recipe='nvfp4' needs {dim} to be a multiple of 16 (2D 16x16 weight blocks), got {n}")
            self.engine = NVFP4Engine(config)
            self.register_buffer("fp4_sr_step", torch.zeros((), dtype=torch.int64, device=state_device))
            self.register_buffer("rht_signs", F.random_signs(config.seed, device=state_device), persistent=False)
            # the layer's index as a tensor: compiled graphs hash it into the seeds, so one graph serves every layer
            self.register_buffer("recipe_index_t", torch.tensor(recipe_index, device=state_device), persistent=False)
        elif config.uses_fp8() and config.fp8_scaling == "blockwise":
            self.engine, self._blockwise = None, True
            self._grad_fmt = fp8_blockwise.gradient_format(config)
            self._fp8_w, self._fp8_w_key = None, None
        elif config.uses_fp8():
            self.engine = None
            grad = config.resolved_gradient_dtype()
            self._fp8_backward = grad == "e5m2"
            self._bwd_fmt = F.E5M2 if self._fp8_backward else grad
            if fp8_state is None:  # a layer on its own owns a one-layer state (registered: state_dict, .to())
                self.fp8_state = fp8_state = Fp8ScalingState(
                    1, config.amax_history_len, config.amax_compute_algo, config.margin, config.reduce_amax,
                    device=state_device,
                )
                fp8_state.attach(self)
                fp8_layer = 0
            else:  # shared with the model's other layers, registered once on the model (not here)
                self.__dict__["_shared_fp8_state"] = fp8_state
            self.fp8_layer = fp8_layer
            self.fp8_rows = fp8_state.rows(fp8_layer)
            # the same rows as a tensor: traced graphs index with it, so one graph serves every layer
            self.register_buffer("fp8_rows_t", torch.tensor(self.fp8_rows, device=state_device), persistent=False)
            self.register_buffer("fp8_dy_amax", torch.zeros(1, device=state_device), persistent=False)
            fp8_state.register_layer(fp8_layer, self)
            self._fp8_w, self._fp8_w_key = None, None
        else:
            self.engine = FloatEngine(config.resolved_matmul_dtype(), config.resolved_gradient_dtype())

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: RecipeConfig, quantize: bool = True, recipe_index: int = 0,
                    fp8_state: Fp8ScalingState | None = None, fp8_layer: int = 0):
        """Wrap `linear`'s own Parameters (no copy, no reallocation: built on meta, then re-pointed)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            config=config,
            quantize=quantize,
            recipe_index=recipe_index,
            device="meta",
            state_device=linear.weight.device,
            fp8_state=fp8_state,
            fp8_layer=fp8_layer,
        )
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    @property
    def scaling_state(self) -> Fp8ScalingState | None:
        """The delayed-scaling state this FP8 layer casts with (None for non-FP8 layers)."""
        own = self._modules.get("fp8_state")
        return own if own is not None else self.__dict__.get("_shared_fp8_state")

    def fp8_history(self) -> Tensor:
        """[3, H] amax histories of this layer's (x, W, dy) rows, newest first (a copy)."""
        return self.scaling_state.amax_history[list(self.fp8_rows)]

    def fp8_scale(self) -> Tensor:
        """[3] scales the next casts of (x, W, dy) use (a copy)."""
        return self.scaling_state.scale[list(self.fp8_rows)]

    def extra_repr(self) -> str:
        mode = f"recipe={self.config.recipe}" if self.quantize else "model dtype (not quantized)"
        engine = ("fp8 blockwise" if self._blockwise else "fp8") if self.engine is None else self.engine.name
        switched = f", {self.fp4_high_precision} GEMMs switched to model dtype" if self.fp4_high_precision else ""
        return f"{super().extra_repr()}, {mode}, engine={engine}{switched}"

    def _weight_key(self, *extra):
        w = self.weight
        return (current_generation(), w._version, w.data_ptr(), w.device, *extra)

    def _work_weight(self):
        w = self.weight
        if w.dtype == self.compute_dtype:
            return None
        if torch.compiler.is_compiling():
            return w.to(self.compute_dtype)  # traced: inductor fuses the cast into its consumer
        key = self._weight_key()
        if key != self._work_key:
            with torch.no_grad():
                self._work = w.detach().to(self.compute_dtype)
            self._work_key = key
        return self._work

    def _fp8_weight(self, st: Fp8ScalingState, record: bool, current: bool, need_t: bool):
        """(wq, wq^T or None, dequant scale) of the weight: cast once per optimizer step in eager mode (reused
        by micro-batches and recomputes), in the graph under torch.compile (fused with the master's read)."""
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return cast(self.weight.detach(), st.scale, st.scale_inv, st.amax, self.fp8_rows_t[1], F.E4M3, need_t,
                            record, current)
        row_w = self.fp8_rows[1]
        key = self._weight_key(record, current)
        cached = self._fp8_w
        if key != self._fp8_w_key or (need_t and cached[1] is None):
            with torch.no_grad():
                cached = cast(self.weight.detach(), st.scale, st.scale_inv, st.amax, row_w, F.E4M3, need_t, record,
                              current)
            self._fp8_w, self._fp8_w_key = cached, key
        return cached

    def _row_views(self, st: Fp8ScalingState):
        """(x, W, dy) as fp8_hybrid.RowViews, rebuilt only when the rows or the state's storage change."""
        key = (self.fp8_rows, st.scale.data_ptr(), st.scale_inv.data_ptr(), st.amax.data_ptr(),
               self.fp8_dy_amax.data_ptr())
        if self.__dict__.get("_views_key") != key:
            bits = st.amax.view(torch.int32)
            rx, rw, rdy = self.fp8_rows
            self.__dict__["_views"] = (RowViews.of(rx, st.scale, st.scale_inv, bits[rx : rx + 1]),
                                       RowViews.of(rw, st.scale, st.scale_inv, bits[rw : rw + 1]),
                                       RowViews.of(rdy, st.scale, st.scale_inv, self.fp8_dy_amax.view(torch.int32)))
            self.__dict__["_views_key"] = key
        return self.__dict__["_views"]

    def _fp8_block_forward(self, x: Tensor) -> Tensor:
        """fp8_scaling='blockwise': the weight's 128x128 cast once per optimizer step (eager), in the graph when traced."""
        if torch.compiler.is_compiling():
            wq, ws = fp8_blockwise.quantize_weight(self.weight.detach())
        else:
            warn_emulation_once("fp8_block_linear", x.device, "the fine-grained FP8 recipe GEMM")
            key = self._weight_key()
            if key != self._fp8_w_key:
                with torch.no_grad():
                    self._fp8_w = fp8_blockwise.quantize_weight(self.weight.detach())
                self._fp8_w_key = key
            wq, ws = self._fp8_w
        return fp8_blockwise.Fp8BlockwiseLinearFn.apply(x, self.weight, self.bias, wq, ws, self._grad_fmt)

    def _share_input_row(self, row: int) -> None:
        """Cast the input with state row `row` (a FusedRMSNorm's consumer group: the same tensor as its siblings)."""
        self.scaling_state.share_x_row(self.fp8_layer, row)
        self.fp8_rows = (row, *self.fp8_rows[1:])
        with torch.no_grad():
            self.fp8_rows_t[0] = row

    def _fp8_forward(self, x: Tensor) -> Tensor:
        st = self.scaling_state
        grad = torch.is_grad_enabled()
        record, current = grad, not st.initialized
        need_t = grad and x.requires_grad and self._fp8_backward
        pre = (None, None, None)
        if not torch.compiler.is_compiling():
            warn_emulation_once("fp8_scaled_mm", x.device, "the FP8 recipe GEMM")
            if record:
                got = input_handoff(self, x, self._fp8_backward and self.weight.requires_grad)
                pre = pre if got is None or current else got
        wq, wqt, w_sinv = self._fp8_weight(st, record, current, need_t)
        if torch.compiler.is_compiling():
            rows = self.fp8_rows_t
        elif x.is_cuda:
            rows = self._row_views(st)
        else:
            rows = self.fp8_rows
        if x.is_cuda and record and not current and self._fp8_backward and not torch.compiler.is_compiling():
            op = native_linear()
            rx, _, rdy = rows
            x_sinv = rx[3] if pre[0] is None else pre[2]
            if op is not None and native_linear_ok(x, wq, wqt, (x_sinv, w_sinv, rdy[3])):
                return op(x, self.weight, self.bias, wq, wqt, w_sinv, pre[0], pre[1], x_sinv, rx[1], rx[2], rdy[1],
                          rdy[2], rdy[3], self._bwd_fmt == torch.float8_e5m2, self.config.fp8_fast_accum)
        spec = (F.E4M3, self._bwd_fmt, self._fp8_backward, record, current, self.config.fp8_fast_accum)
        return Fp8LinearFn.apply(x, self.weight, self.bias, wq, wqt, w_sinv, st.scale, st.scale_inv, st.amax,
                                 self.fp8_dy_amax, rows, spec, *pre)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling() and x.device not in self._checked_devices:  # (a set a graph would guard on)
            check_device(self.config, x.device)
            self._checked_devices.add(x.device)
        if self.engine is None:
            return self._fp8_block_forward(x) if self._blockwise else self._fp8_forward(x)
        if isinstance(self.engine, FloatEngine):
            return self._float_forward(x, (self.engine.dtype, self.engine.bwd.dtype))
        if self.fp4_high_precision == "all":
            return self._float_forward(x, (self.compute_dtype, self.compute_dtype))
        return self._nvfp4_forward(x)

    def _float_forward(self, x: Tensor, spec: tuple) -> Tensor:
        w = self.weight
        if spec[0] == spec[1] == w.dtype == x.dtype and (self.bias is None or self.bias.dtype == w.dtype):
            # every GEMM in the layer's own dtype: that is nn.Linear (its C++ autograd, no Python Function per call)
            return torch.nn.functional.linear(x, w, self.bias)
        return _FloatLinearFn.apply(x, w, self.bias, self._work_weight(), spec)

    def _nvfp4_forward(self, x: Tensor) -> Tensor:
        """Nvfp4LinearFn with this layer's weight operands (eager: cached per optimizer step) and stochastic-rounding
        seeds: one step per training forward (fp4_sr_step); an eager activation-checkpoint recompute reuses the
        original forward's step. Traced, the step is read and advanced in the graph and the seeds hashed there."""
        eng = self.engine
        spec = eng.spec(x.device)
        grad = torch.is_grad_enabled()
        signs = self.rht_signs if eng.rht else None
        work = self._work_weight()
        high_forward = self.fp4_high_precision == "forward"
        if torch.compiler.is_compiling():
            seeds = (0, 0)
            if grad:
                step = take_sr_step(self)
                if eng.sr:
                    seeds = sr_seeds_traced(eng.seed, self.recipe_index_t, step)
            return Nvfp4LinearFn.apply(x, self.weight, self.bias, work, None, signs, seeds, spec, high_forward)
        warn_emulation_once("nvfp4_mm", x.device, "the NVFP4 recipe GEMM (no FP4 tensor cores used)")
        mode = _pass_mode()
        if mode == "train" or (mode == "replay" and self.fwd_sr_step < 0):
            self.fwd_sr_step = take_sr_step(self)
        elif mode == "eval":
            self.fwd_sr_step = -1
        step = self.fwd_sr_step
        seeds = (sr_seed(eng.seed, self.recipe_index, step, ROLE_DGRAD),
                 sr_seed(eng.seed, self.recipe_index, step, ROLE_WGRAD)) if eng.sr and step >= 0 else (0, 0)
        w_ops = eng.weight_ops(self, self.weight if work is None else work, grad and x.requires_grad, spec[4],
                               need_fwd=not high_forward)
        return Nvfp4LinearFn.apply(x, self.weight, self.bias, work, w_ops, signs, seeds, spec, high_forward)


def _pass_mode() -> str:
    """Return "train", "eval" (no grad) or "replay": a forward run while the autograd engine executes a
    backward is an activation-checkpointing recompute (the test FSDP2 and torch's ModuleTracker use;
    tests/recipes/test_recipes_training.py::test_gradient_checkpointing_replays_the_forward pins it)."""
    if not torch.is_grad_enabled():
        return "eval"
    return "replay" if torch._C._current_graph_task_id() != -1 else "train"


# ---------------------------------------------------------------------------- model conversion
def _is_quantized_base(m: nn.Module) -> bool:
    return hasattr(m, "quant_format")


_LORA_ADAPTERS = ("lora_A", "lora_B")


def _is_lora_adapter(fqn: str) -> bool:
    """A PEFT LoRA adapter linear (`...q_proj.lora_A.default`): left in its own dtype unless quantize_lora_adapters."""
    return any(part in _LORA_ADAPTERS for part in fqn.split("."))


def _infer_model_dtype(model: nn.Module) -> str:
    for name, m in model.named_modules():
        if _is_quantized_base(m):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and "lora_" not in f"{name}.{pname}":
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(
                        f"model_dtype: the model's parameters are {p.dtype} ({name}.{pname}); the recipes compute in "
                        "fp32 or bf16, pass model_dtype='bf16' or 'fp32'"
                    )
                return dtype_name(p.dtype, "model_dtype")
    raise ValueError("model_dtype: the model has no floating-point parameters to read it from; pass model_dtype")


def _cast_output(dtype):
    def hook(_module, _inputs, out):
        if isinstance(out, Tensor) and out.is_floating_point() and out.dtype != dtype:
            return out.to(dtype)
        return out

    return hook


def _apply_lora_dtype(model, cfg):
    try:
        from ..integrations.peft import set_lora_dtype
    except ImportError as e:
        raise RuntimeError(
            f"lora_dtype={cfg.lora_dtype!r} is applied by surogate_hf.integrations.peft.set_lora_dtype, "
            f"which is not available ({e}); leave lora_dtype unset"
        ) from None
    set_lora_dtype(model, TORCH_DTYPES[cfg.lora_dtype])


def small_fp8_linears_advice(shapes: list[tuple[int, int]], min_width: int = 512) -> str | None:
    """The warning for a real model (some linear at least min_width wide) whose FP8 linears are mostly too small
    for FP8 GEMMs to pay (FP8_SMALL_LINEAR), else None. shapes: (in_features, out_features) of the FP8 linears."""
    if not shapes or max(max(s) for s in shapes) < min_width:
        return None
    small = sum(i <= FP8_SMALL_LINEAR[0] and o <= FP8_SMALL_LINEAR[1] for i, o in shapes)
    if 2 * small < len(shapes):
        return None
    return (f"{small} of {len(shapes)} FP8 linears have in_features <= {FP8_SMALL_LINEAR[0]} and out_features <= "
            f"{FP8_SMALL_LINEAR[1]}, where FP8 GEMMs save less GPU time than each FP8 linear costs in casts and host "
            "time: on an H100 a 576-wide model (SmolLM2-135M shape) trained at 1.01x the bf16 step eager and 0.65x "
            "compiled with every linear in FP8, and at 1.17x / 0.91x with fp8_skip_small_linears=True "
            "(benchmarks/results/profile_fp8_eager_smollm2_135m.md). "
            "Pass fp8_skip_small_linears=True to keep those linears in model_dtype")


def apply_recipe(model: nn.Module, recipe=None, *, module_filter_fn=None, **knobs) -> nn.Module:
    """Convert `model` in place to the precision recipe and return it.

    recipe: "bf16" | "fp8-hybrid" | "nvfp4" | RecipeConfig | None. None takes the recipe the launcher
    (`surogate-hf launch`) started this process with, else the one recorded in `model.config`
    (`surogate_recipe`, written here, so it is saved with every checkpoint and a reloaded model
    finds it); an explicit argument always wins. Call it before the optimizer is built and before
    accelerator.prepare. module_filter_fn(module, fqn) -> bool can keep more linears in model_dtype (the
    same hook, and the same module selection, as SurogateConfig's quantizer: nn.convert.module_plan).

    Plain nn.Linear layers inside the transformer blocks get the recipe; embeddings, the attention core and lm_head
    (and `modules_to_not_convert`, and the first / last `skip_quant_*_layers` blocks; nvfp4 by default keeps ~16% of
    the blocks, config.NVFP4_BF16_ENDS) stay in model_dtype. With
    fused_norms (default) recognised transformers RMSNorms become recipes.norm.FusedRMSNorm (same weight and key,
    same formula, fused kernels, FP8 hand-off). Quantized QLoRA bases (nn.linear.QuantizedLinear) keep their
    storage; their GEMMs follow the recipe (recipes.qlora: `base.recipe_gemm`). The LoRA adapter linears of a PEFT
    model keep computing in their own dtype (PEFT's, or lora_dtype) unless quantize_lora_adapters=True makes them
    RecipeLinears too.
    """
    cfg = resolve_recipe(model, recipe, **knobs)
    if cfg is None:
        raise ValueError(
            f"no recipe: pass recipe= one of {RECIPES}, start the process with `surogate-hf launch --recipe ...`, or "
            f"load a model whose config records one (model.config.{CONFIG_ATTR})"
        )
    if getattr(model, "surogate_recipe", None) is not None:
        raise ValueError(f"a recipe ({model.surogate_recipe.recipe}) is already applied to this model")
    has_lora = any(isinstance(getattr(m, "lora_A", None), nn.ModuleDict) for m in model.modules())
    if cfg.lora_dtype is not None:
        if not has_lora:
            raise ValueError(f"lora_dtype={cfg.lora_dtype!r} given but the model has no LoRA adapters")
        _apply_lora_dtype(model, cfg)
    if cfg.model_dtype is None:
        cfg = cfg.with_model_dtype(_infer_model_dtype(model))
    model_dt, master_dt = TORCH_DTYPES[cfg.resolved_model_dtype()], TORCH_DTYPES[cfg.resolved_master_dtype()]
    first = next((p for p in model.parameters()), None)
    if first is not None:
        check_device(cfg, first.device)

    # 1. parameter dtypes: trainable -> master, frozen -> model; quantized bases and LoRA
    #    adapter parameters are owned by others.
    quant_prefixes = [n for n, m in model.named_modules() if _is_quantized_base(m)]
    for name, p in model.named_parameters():
        if any(name.startswith(q + ".") for q in quant_prefixes) or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            continue
        if "lora_" in name:
            continue  # adapter masters: PEFT's / set_lora_dtype's (the lora_dtype knob)
        want = master_dt if p.requires_grad else model_dt
        if p.dtype != want:
            p.data = p.data.to(want)

    # 2. which linears get the recipe: nn.convert.module_plan, the quantizer's own selection (same knobs, same
    #    modules), restricted to the decoder layers; the output embeddings always stay
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, m in model.named_modules():
        if isinstance(m, RecipeLinear):
            raise ValueError(f"{name} is already a RecipeLinear")
    skip_first, skip_last = cfg.resolved_skip_layers(len(decoder_layer_names(model)))
    plan = module_plan(
        model, lambda m: type(m) is nn.Linear, skip=cfg.modules_to_not_convert,
        skip_first_layers=skip_first, skip_last_layers=skip_last,
        module_filter=module_filter_fn, only_in_layers=True,
    )
    small = (lambda m: m.in_features <= FP8_SMALL_LINEAR[0] and m.out_features <= FP8_SMALL_LINEAR[1]) \
        if cfg.fp8_skip_small_linears and cfg.uses_fp8() else (lambda m: False)
    targets = [(name, m, why is None and m is not out_emb and not small(m)) for name, m, why in plan
               if cfg.quantize_lora_adapters or not _is_lora_adapter(name)]
    if cfg.uses_fp8() and not cfg.fp8_skip_small_linears:
        advice = small_fp8_linears_advice([(m.in_features, m.out_features) for _, m, q in targets if q])
        if advice:
            warnings.warn(f"apply_recipe: {advice}", RuntimeWarning, stacklevel=2)
    others = [name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not _is_quantized_base(m)]
    if others:
        warnings.warn(
            f"apply_recipe: left {len(others)} nn.Linear subclass(es) as they are (not plain nn.Linear, "
            f"unknown storage): {others[:5]}{' ...' if len(others) > 5 else ''}",
            RuntimeWarning,
            stacklevel=2,
        )
    if cfg.recipe == "nvfp4":
        bad = [f"{n} ({m.out_features}x{m.in_features})" for n, m, q in targets if q and (m.in_features % 16 or m.out_features % 16)]
        if bad:
            raise ValueError(
                f"recipe='nvfp4' needs in/out features that are multiples of 16 (2D 16x16 weight blocks); "
                f"these are not: {bad}. Add them to modules_to_not_convert to keep them in model_dtype"
            )

    # quantized QLoRA bases (surogate_hf's QuantizedLinear) get the recipe's GEMMs through recipes.qlora: their
    # storage stays the format's, the compute precision becomes the recipe's (same module selection)
    bases = [(name, m) for name, m, why in module_plan(
        model, lambda m: isinstance(m, QuantizedLinear), skip=cfg.modules_to_not_convert,
        skip_first_layers=skip_first, skip_last_layers=skip_last,
        module_filter=module_filter_fn, only_in_layers=True) if why is None]

    # 3. swap; FP8 layers (and FP8 bases) share one flat delayed-scaling state, registered once on the model
    n_quant = sum(q for _, _, q in targets)
    delayed = cfg.uses_fp8() and cfg.fp8_scaling == "delayed"
    base_kinds = [base_gemm_kind(m, cfg) for _, m in bases]
    n_fp8_bases = base_kinds.count("fp8")  # the bases that cast with rows of the state
    state = None
    if delayed and n_quant + n_fp8_bases:
        fp8_mods = [m for _, m, q in targets if q] + [m for (_, m), k in zip(bases, base_kinds) if k == "fp8"]
        device = next(p.device for m in fp8_mods for p in m.parameters())
        state = Fp8ScalingState(n_quant + n_fp8_bases, cfg.amax_history_len, cfg.amax_compute_algo, cfg.margin,
                                cfg.reduce_amax, device=device)
        model.add_module(FP8_STATE_NAME, state)
        state.attach(model)
    index = 0
    mods = dict(model.named_modules())
    for name, m, quantize in targets:
        if not quantize and m.weight.dtype == model_dt:
            continue  # stays a plain nn.Linear in model dtype
        new = RecipeLinear.from_linear(m, cfg, quantize=quantize, recipe_index=index,
                                       fp8_state=state if quantize else None, fp8_layer=index)
        index += int(quantize)
        parent_name, _, child = name.rpartition(".")
        setattr(mods[parent_name] if parent_name else model, child, new)
    fp8_row = n_quant
    for i, ((name, base), kind) in enumerate(zip(bases, base_kinds)):
        layer = fp8_row if kind == "fp8" else None
        fp8_row += kind == "fp8"
        base.__dict__["recipe_gemm"] = BaseRecipeGemm(base, cfg, n_quant + i, state if kind == "fp8" else None, layer,
                                                      name=name)

    # 4. recognised RMSNorms -> FusedRMSNorm (its own output cast to model dtype when its weight is an fp32 master)
    if cfg.fused_norms:
        fuse_norms(model, model_dt if master_dt != model_dt else None)

    # 5. other non-matmul modules holding fp32 masters still hand model-dtype activations on
    if master_dt != model_dt:
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) or _is_quantized_base(m) or isinstance(m, FusedRMSNorm):
                continue
            if any(p.dtype != model_dt and p.is_floating_point() for p in m.parameters(recurse=False)):
                m.register_forward_hook(_cast_output(model_dt))
    _keep_recipe_state_out_of_ddp(model)
    model.surogate_recipe = cfg
    if cfg.resolved_high_precision_tail():
        from .switch import expect_schedule

        expect_schedule(model)  # warns at the first optimizer step if nothing schedules the precision switch
    hf_config = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_dict"):  # a transformers config: saved as config.json
        setattr(hf_config, CONFIG_ATTR, cfg.to_dict())
        from ..integrations.causal_mask import install_compiled_causal_mask_skip

        install_compiled_causal_mask_skip()  # a compiled transformers model keeps SDPA's causal kernels (torch < 2.13)
    return model


_RECIPE_BUFFERS = ("fp8_dy_amax", "fp8_rows_t", "fp4_sr_step", "rht_signs", "recipe_index_t")


def _keep_recipe_state_out_of_ddp(model: nn.Module) -> None:
    """DDP (broadcast_buffers=True, the Trainer's default) copies rank 0's buffers over every rank before each
    forward: it would overwrite the other ranks' running amaxes between micro-batches (their maxima would never
    reach the step's all_reduce) and move the state every step. The state agrees across ranks without it (the
    update all-reduces the amaxes; step counters advance alike), so DDP is told to leave it alone, through the
    hook DDP documents for this (`_set_params_and_buffers_to_ignore_for_model`)."""
    names = [
        f"{mod_name}.{buf_name}" if mod_name else buf_name
        for mod_name, mod in model.named_modules()
        for buf_name, _ in mod.named_buffers(recurse=False)
        if isinstance(mod, Fp8ScalingState) or buf_name in _RECIPE_BUFFERS
    ]
    if names:
        from torch.nn.parallel import DistributedDataParallel

        known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, known + [n for n in names if n not in known])


def recipe_state(model: nn.Module) -> dict:
    """The recipe buffers of `model` (amax histories, scales, SR step counters) by state_dict key."""
    keys = ("fp8_state.amax_history", "fp8_state.scale", "fp4_sr_step")
    return {k: v for k, v in model.state_dict().items() if k.endswith(keys)}
