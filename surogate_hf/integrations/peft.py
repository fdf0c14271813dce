"""LoRA over surogate's quantized linears through stock PEFT, and the seeds' `lora_dtype`.

PEFT wraps any `nn.Linear` subclass in its plain `lora.Linear`. Its forward is right for our bases (it calls
`base_layer(x)`), but its merge does `base_layer.weight.data += delta`, which corrupts packed FP8/FP4/NF4 data,
and it casts the layer input and adapters to fp32. `SurogateLoraLinear` fixes both:

- forward: the quantized base runs its own op (no dense copy of W is kept), the adapter matmuls run in the
  activation dtype from master weights stored in `lora_dtype` (fp32 by default, bf16 allowed); the cast is part
  of the autograd graph, so gradients land on the masters and the optimizer updates them.
- merge: `dequantize(W) + sum(delta)` is kept as a dense weight next to the untouched quantized base; unmerge
  drops it, so the quantized base comes back bit for bit. `merge_and_unload()` replaces the layer by a dense
  `nn.Linear` in the dense dtype holding `dequantize(W) + delta`. We do not requantize: a LoRA delta is often
  smaller than a quantization step and would be rounded away. Pre-quantized bases export the same way.

PEFT has no persisted registry for custom layers (`LoraConfig._register_custom_module` is not saved in
adapter_config.json, so `PeftModel.from_pretrained` and `model.load_adapter` could not find it). The one hook
below, `install_peft_dispatch()`, wraps `peft.tuners.lora.model.LoraModel._create_new_module` so that our
dispatcher runs first and claims quantized bases only; every other module goes to PEFT unchanged. It is
idempotent and is called from explicit entry points only: `surogate_hf.prepare_for_training` and the
quantizer when it loads a model. tests/integrations/test_qlora_peft_hook.py fails when upstream changes what it relies on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as Fn
from torch import nn

from peft.tuners.lora import layer as lora_layer
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from ..recipes.norm import carry_handoff

__all__ = [
    "SurogateLoraLinear",
    "dispatch_surogate",
    "install_peft_dispatch",
    "uninstall_peft_dispatch",
    "is_peft_dispatch_installed",
    "set_lora_dtype",
    "lora_parameters_dtype",
    "merge_to_dense",
]

# init_lora_weights values that never read the base weight (the others decompose W, which is packed here)
_SAFE_INITS = (True, False, "gaussian")
_LORA_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def _quantized_linear_cls():
    """surogate_hf.nn.linear.QuantizedLinear (imported lazily: nn imports ops, which may pull kernels)."""
    from ..nn.linear import QuantizedLinear

    return QuantizedLinear


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, _quantized_linear_cls())


def _dense_dtype(base: nn.Module) -> torch.dtype:
    """The dtype a dense export of `base` uses: the dtype its dequantize() returns by default."""
    dt = getattr(base, "compute_dtype", None) or getattr(base, "dtype", None)
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt.itemsize >= 2:
        return dt
    if getattr(base, "bias", None) is not None:
        return base.bias.dtype
    return base.dequantize().dtype


def resolve_lora_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"lora_dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype not in _LORA_DTYPES:
        raise ValueError(f"lora_dtype must be one of {sorted(_LORA_DTYPES)}, got {dtype!r}")
    return _LORA_DTYPES[dtype]


def _adapter_linear(lin: nn.Module, h: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    if type(lin) is nn.Linear:
        return Fn.linear(h, lin.weight.to(cd), None if lin.bias is None else lin.bias.to(cd))
    # a module that owns its precision (e.g. a surogate_hf.recipes RecipeLinear swapped in by apply_recipe)
    return lin(h)


class SurogateLoraLinear(lora_layer.Linear):
    """PEFT `lora.Linear` for surogate quantized bases (and, via `set_lora_dtype`, for dense ones)."""

    # master dtype of the adapter weights; None = leave whatever PEFT created (dense bases before set_lora_dtype)
    lora_dtype: torch.dtype | None = None

    def __init__(self, base_layer, adapter_name: str, config, **kwargs):
        base = base_layer.get_base_layer() if isinstance(base_layer, BaseTunerLayer) else base_layer
        if _is_quantized(base):
            self.lora_dtype = torch.float32
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    # -------------------------------------------------------------- construction
    @property
    def _quantized_base(self) -> bool:
        return _is_quantized(self.get_base_layer())

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        if self._quantized_base:
            fmt = getattr(self.get_base_layer(), "quant_format", "quantized")
            if self.resolve_lora_variant(config=config) is not None:
                raise ValueError(
                    f"LoRA variants (use_dora, arrow, bdlora, ...) need the dense base weight; they are not "
                    f"supported on a {fmt} base ({kwargs.get('target_name', '')}). Use plain LoRA."
                )
            if config.init_lora_weights not in _SAFE_INITS:
                raise ValueError(
                    f"init_lora_weights={config.init_lora_weights!r} decomposes the base weight, which is packed "
                    f"{fmt} data here; use one of {_SAFE_INITS}."
                )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        if not self._quantized_base:
            return super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        # PEFT would cast the adapter to the base weight's dtype: float8_e4m3fn for FP8 bases. Keep lora_dtype.
        base = self.get_base_layer()
        target = device if device is not None else base.weight.device
        if target == torch.device("meta"):
            return
        for name in self.adapter_layer_names:
            layer = getattr(self, name, None)
            if isinstance(layer, (nn.ModuleDict, nn.ParameterDict)) and adapter_name in layer:
                if any(p.device.type == "meta" for p in layer[adapter_name].parameters()):
                    continue
                layer[adapter_name] = layer[adapter_name].to(target, dtype=self.lora_dtype or torch.float32)

    # -------------------------------------------------------------- forward
    def _fast_path(self, kwargs: dict) -> bool:
        if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
            return False
        return not any(a in self.lora_variant for a in self.active_adapters)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.merged and self._quantized_base and not self.disable_adapters:
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.get("adapter_names") is not None:
                raise ValueError("adapter_names (mixed-batch inference) cannot be used while adapters are merged")
            return Fn.linear(x, self._merged_weight.to(x.dtype), None if self._merged_bias is None
                             else self._merged_bias.to(x.dtype))
        if self.lora_dtype is None or not self._fast_path(kwargs):
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        for k in lora_layer.VARIANT_KWARG_KEYS:
            kwargs.pop(k, None)
        active = [name for name in self.active_adapters if name in self.lora_A]
        lead = x.shape[:-1]
        x2d = carry_handoff(x, x.reshape(-1, x.shape[-1]))  # a recipe's FP8 base still finds its norm's cast
        fused = self._decoded_fused(x2d, active, args, kwargs)
        if fused is not None:
            return fused if x.dim() == 2 else fused.view(*lead, fused.shape[-1])
        result = self.base_layer(x2d, *args, **kwargs)
        # compute in the activation dtype: masters are cast per call (differentiably), never x upcast to fp32
        cd = x.dtype
        if result.dtype == cd and all(self._fusable(name) for name in active):
            result = self._add_adapters_fused(result, x2d, active, cd)
        else:
            out_dtype = result.dtype
            for name in active:
                h = _adapter_linear(self.lora_A[name], self.lora_dropout[name](x2d), cd)
                h = _adapter_linear(self.lora_B[name], h, cd)
                result = result + h * self.scaling[name]
            result = result.to(out_dtype)
        return result if x.dim() == 2 else result.view(*lead, result.shape[-1])

    def _decoded_fused(self, x2d, active, args, kwargs):
        """The base GEMM and the one active adapter in one call of the extension's C++ op (surogate::ext_decoded_linear:
        the weight's decode, the GEMMs and the adapter's epilogue, and all of the backward, with no Python per layer
        in the backward), where the quantized base takes its decode + GEMM route for x; None otherwise. The math is
        this layer's unfused path's (same aten calls), except that the input gradient adds the adapter's term inside
        one addmm instead of the autograd engine's separate add."""
        # the direct base only (a wrapping layer's forward would be skipped): get_base_layer's unwrapping loop costs
        # a compiled model a hasattr guard per linear, which runs nn.Module.__getattr__ in Python on every call
        base = self.base_layer
        if (len(active) != 1 or args or kwargs or not _is_quantized(base) or not self._fusable(active[0])
                or base._forward_hooks or base._forward_pre_hooks or "forward" in base.__dict__):
            return None  # (hooks on the base, or accelerate's forward wrapper, would be skipped)
        route = base.decoded_route(x2d)
        if route is None:
            return None
        name = active[0]
        dropout = self.lora_dropout[name]
        x_lora = None if isinstance(dropout, nn.Identity) else dropout(x2d)
        op, w, s, g, levels, fmt, n, k, block = route
        return op(x2d, x_lora, w, s, g, levels, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                  float(self.scaling[name]), fmt, n, k, block)

    def _fusable(self, name: str) -> bool:
        a, b = self.lora_A[name], self.lora_B[name]
        return type(a) is nn.Linear and type(b) is nn.Linear and a.bias is None and b.bias is None

    def _add_adapters_fused(self, result, x2d, active, cd):
        """result + scaling * (x A^T) B^T with the scaling and the add in the epilogue of one addmm: the
        unfused form spends two full passes over the [tokens, out_features] output (mul, then add) per
        adapter, which cost more than the rank-r GEMMs themselves."""
        # in place only on a fresh (non-view) output: our bases and nn.Linear do not save their output for
        # backward, so accumulating into it skips a copy of it
        inplace = result._base is None and isinstance(self.get_base_layer(), nn.Linear)
        for name in active:
            h = Fn.linear(self.lora_dropout[name](x2d), self.lora_A[name].weight.to(cd))
            bt = self.lora_B[name].weight.to(cd).t()
            scale = self.scaling[name]
            result = result.addmm_(h, bt, alpha=scale) if inplace else torch.addmm(result, h, bt, alpha=scale)
            inplace = True  # from here on `result` is a fresh addmm output
        return result

    # -------------------------------------------------------------- merge / unmerge / unload
    _merged_weight: torch.Tensor | None = None
    _merged_bias: torch.Tensor | None = None

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        if not self._quantized_base:
            return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        # accumulate in fp32 on top of the exact dequantized base; the quantized base itself is never touched
        w = base.dequantize(torch.float32) if self._merged_weight is None else self._merged_weight.float()
        b = self._merged_bias
        if b is None and base.bias is not None:
            b = base.bias.detach().float()
        merged = []
        for name in adapter_names:
            if name not in self.lora_A:
                continue
            w = w + self.get_delta_weight(name).float()
            if self.lora_bias[name]:
                if b is None:
                    raise RuntimeError("Impossible to merge LoRA with `lora_bias=True`: the base layer has no bias.")
                b = b + self.lora_B[name].bias.float() * self.scaling[name]
            merged.append(name)
        if safe_merge and not (torch.isfinite(w).all() and (b is None or torch.isfinite(b).all())):
            raise ValueError(f"NaNs detected in the merged weights. The adapter(s) {merged} seem to be broken")
        dt = _dense_dtype(base)
        self._merged_weight = w.to(dt).detach()
        self._merged_bias = None if b is None else b.to(dt).detach()
        self.merged_adapters.extend(merged)

    def unmerge(self) -> None:
        if not self._quantized_base:
            return super().unmerge()
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        # the quantized base was never modified: dropping the dense merged copy restores it exactly
        self.merged_adapters.clear()
        self._merged_weight = self._merged_bias = None

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names: list[str] | None):
        """Called by PEFT's merge_and_unload()/unload(): a dense nn.Linear when adapters were merged into a
        quantized base (dequantize(W) + delta, in the dense dtype), else the base layer itself."""
        if merge:
            self.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        base = self.get_base_layer()
        if not (self._quantized_base and self.merged):
            return base
        dense = nn.Linear(
            base.in_features, base.out_features, bias=self._merged_bias is not None,
            device=self._merged_weight.device, dtype=self._merged_weight.dtype,
        )
        dense.weight = nn.Parameter(self._merged_weight, requires_grad=False)
        if self._merged_bias is not None:
            dense.bias = nn.Parameter(self._merged_bias, requires_grad=False)
        return dense

    def __repr__(self) -> str:
        return "surogate." + super().__repr__() + f"(lora_dtype={self.lora_dtype})"


# ------------------------------------------------------------------ dispatcher + the one PEFT hook
def dispatch_surogate(target: nn.Module, adapter_name: str, config, parameter_name: str | None = None, **kwargs):
    """PEFT dispatcher: a SurogateLoraLinear for quantized linears, None (let PEFT decide) for anything else."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if parameter_name is not None and hasattr(base, "quant_format"):
        # PEFT's ParamWrapper would parametrize the packed buffer itself: never right for a quantized module
        raise ValueError(
            f"target_parameters={parameter_name!r} points into a quantized {base.quant_format} "
            f"{type(base).__name__}; LoRA on quantized (expert) parameters is not supported. Target the "
            "attention / dense projections with target_modules instead."
        )
    if not _is_quantized(base):
        return None
    if parameter_name is not None:
        raise ValueError(
            f"target_parameters={parameter_name!r} points into a quantized {base.quant_format} module; LoRA on "
            "quantized parameters goes through target_modules (the module, not its packed tensor)."
        )
    return SurogateLoraLinear(target, adapter_name, config=config, **kwargs)


_HOOK_FLAG = "_surogate_dispatch"


def _lora_model_cls():
    from peft.tuners.lora.model import LoraModel

    return LoraModel


def is_peft_dispatch_installed() -> bool:
    return getattr(_lora_model_cls().__dict__["_create_new_module"].__func__, _HOOK_FLAG, False)


def install_peft_dispatch() -> None:
    """Put `dispatch_surogate` first in PEFT's LoRA module creation (idempotent).

    Why a hook: PEFT picks the LoRA class in the static `LoraModel._create_new_module`, and its only extension
    point (`LoraConfig._register_custom_module`) is per config object and not saved with adapters, so
    `PeftModel.from_pretrained` / `model.load_adapter` would silently build plain `lora.Linear` layers (wrong
    merges) around our quantized bases. Modules that are not surogate quantized linears are untouched.
    """
    cls = _lora_model_cls()
    raw = cls.__dict__.get("_create_new_module")
    if not isinstance(raw, staticmethod):
        raise RuntimeError(
            "peft.tuners.lora.model.LoraModel._create_new_module is no longer a staticmethod; surogate_hf's PEFT "
            "integration must be updated for this PEFT version"
        )
    original = raw.__func__
    if getattr(original, _HOOK_FLAG, False):
        return

    @functools.wraps(original)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        new_module = dispatch_surogate(target, adapter_name, lora_config, **kwargs)
        if new_module is not None:
            return new_module
        return original(lora_config, adapter_name, target, **kwargs)

    setattr(_create_new_module, _HOOK_FLAG, True)
    _create_new_module.__surogate_original__ = original
    cls._create_new_module = staticmethod(_create_new_module)


def uninstall_peft_dispatch() -> None:
    """Restore PEFT's own `_create_new_module` (tests use it to show what the hook changes)."""
    cls = _lora_model_cls()
    fn = cls.__dict__["_create_new_module"].__func__
    if getattr(fn, _HOOK_FLAG, False):
        cls._create_new_module = staticmethod(fn.__surogate_original__)


# ------------------------------------------------------------------ lora_dtype
def set_lora_dtype(model: nn.Module, dtype: str | torch.dtype = torch.float32) -> int:
    """Store every LoRA adapter's master weights in `dtype` (fp32 default, bf16 allowed); compute stays in the
    activation dtype. Call it after the adapters exist (get_peft_model / load_adapter) and before the optimizer
    is built: the Parameters are updated in place, so an optimizer built earlier still holds them, but its
    state would have the old dtype.

    Stock `lora.Linear` layers (dense bases) are switched to SurogateLoraLinear, which only changes their
    methods: PEFT offers no way to choose the class of dense LoRA layers without a global dispatcher.
    Returns the number of LoRA layers set.
    """
    dt = resolve_lora_dtype(dtype)
    n = 0
    for module in model.modules():
        if type(module) is lora_layer.Linear:
            if module.lora_variant:
                kinds = sorted({type(v).__name__ for v in module.lora_variant.values()})
                raise ValueError(
                    f"set_lora_dtype: LoRA variants ({kinds}) "
                    "keep PEFT's own compute path; leave lora_dtype to PEFT's autocast_adapter_dtype for them"
                )
            module.__class__ = SurogateLoraLinear
        if not isinstance(module, SurogateLoraLinear):
            continue
        for name in module.adapter_layer_names:
            layer = getattr(module, name, None)
            if isinstance(layer, (nn.ModuleDict, nn.ParameterDict)):
                for p in layer.parameters():
                    p.data = p.data.to(dt)
        module.lora_dtype = dt
        n += 1
    if n == 0:
        raise ValueError("set_lora_dtype: the model has no LoRA linear layers (call it after get_peft_model)")
    return n


def lora_parameters_dtype(model: nn.Module) -> set[torch.dtype]:
    """The dtypes of all LoRA adapter parameters (a check for tests and the CLI)."""
    return {p.dtype for n, p in model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------ merged export
def merge_to_dense(peft_model, dtype: torch.dtype | None = None) -> nn.Module:
    """merge_and_unload() + every remaining quantized module (layers LoRA did not target, experts) made dense +
    the quantization config removed: a plain transformers model that `save_pretrained` writes as a dense
    checkpoint any stack can read. Works for online and pre-quantized bases alike; the merged layers hold
    dequantize(W) + delta in the dense dtype (never requantized: small deltas would round away)."""
    from ..nn.convert import dequantize_model

    model = peft_model.merge_and_unload()
    model = dequantize_model(model, dtype)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model
