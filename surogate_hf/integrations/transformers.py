"""`SurogateHfQuantizer`: online quantization of a bf16/fp16 checkpoint through transformers' loader,
and `save_pretrained` in the standard layouts.

Loading (transformers 5 core_model_loading): `_process_model_before_weight_loading` swaps the model's
linears and fused experts for quantized modules on meta (nn/convert.py). The loader then streams the
checkpoint one tensor at a time (sync loading for on-the-fly quantization); for every tensor that
`param_needs_quantization` claims it calls `SurogateQuantize.convert`, which quantizes that one
tensor into the module's packed slots. Peak memory ~ quantized model + one dense tensor (+ the
reference quantizer's fp32 work space for that tensor).

Saving writes layouts other tools read (the config.json `quantization_config` says which):
    fp8    quant_method "fp8" (fine-grained): `weight` e4m3 + `weight_scale_inv` fp32, `weight_block_size`
           (null for per-tensor), `modules_to_not_convert` listing every linear/experts kept dense.
           Stock transformers reads it (on CPU it dequantizes to the model dtype). ue8m0 scales are
           written as fp32 powers of two (identical values). Partial edge blocks (a dim > block and not a
           multiple of it) follow DeepSeek-V3's ceil layout, which vLLM reads but stock transformers'
           dequantize does not: such layers are named in a warning.
    nvfp4  quant_method "modelopt", quant_algo "NVFP4", group_size 16, `exclude_modules`/`ignore`:
           `weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16], `weight_scale_2` fp32 []. Weight-only:
           no `input_scale` is written (there is no activation calibration).
    mxfp4  quant_method "mxfp4": linears `weight` uint8 [N, K/2] + `weight_scale` uint8 E8M0 [N, K/32];
           experts stored fused (GPT-OSS) as `{P}_blocks` [E, N, K/32, 16] + `{P}_scales` [E, N, K/32].
    nf4    quant_method "bitsandbytes" (load_in_4bit, nf4): bitsandbytes' keys `weight`, `weight.absmax`,
           `weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`,
           `weight.quant_state.bitsandbytes__nf4`; stock transformers + bitsandbytes read it.
Fused experts that the model's conversion mapping stores per expert on disk (Qwen3-MoE:
`experts.{e}.gate_proj.weight` ...) are split into those per-expert tensors, each written like a linear
of the format; natively fused experts (GPT-OSS) keep `{P}` + the format's suffixes.
After `save_pretrained`, `model.config.quantization_config` is the dict describing the written layout
(the quantizer keeps the SurogateConfig): config.json is written from it and there is no hook after
the write to restore it.
"""

from __future__ import annotations

import warnings

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from ..config import QUANT_METHOD, SurogateConfig
from ..nn.convert import (
    SurogateWarning,
    dequantize_model,
    quantized_modules,
    replace_with_quantized_modules,
    unmatched_patterns,
)
from ..nn.experts import QuantizedExperts, is_experts_module
from ..nn import slots as S
from ..nn.linear import QuantizedLinear, make_format
from .checkpoint_files import open_safetensors

_FLOAT_SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16"}


# ============================================================================ loading
class SurogateQuantize(ConversionOps):
    """Quantize one dense checkpoint tensor into the packed slots of its quantized module."""

    def __init__(self, hf_quantizer: "SurogateHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
        out = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, name = get_module_from_name(model, key)
            prefix = key[: -len(name)]
            if not tensor.is_floating_point():
                raise TypeError(f"surogate_hf: checkpoint tensor {key!r} has dtype {tensor.dtype}; only floating tensors can be quantized")
            if isinstance(module, QuantizedLinear) and name == "weight":
                q = module.quantize_weight(tensor)
            elif isinstance(module, QuantizedExperts) and name in module.projections:
                q = module.quantize_weight(name, tensor)
            else:
                raise KeyError(f"surogate_hf: {key!r} is not a quantized weight slot")
            # storage form (frozen integer-view Parameters, nn/slots.py): the loader sets them as they are
            out.update({prefix + n: S.to_storage(t, S.slot_specs(module)[n][2]) for n, t in q.items()})
        return out


def _checkpoint_dtype_check(model, checkpoint_files, quantized_names: list[str]) -> None:
    """Raise on a non-floating checkpoint tensor that would be quantized.

    The loader casts every tensor to the model dtype before the quantize op sees it (an int8 tensor
    would silently become a float one), so the check reads the safetensors headers instead."""
    if not checkpoint_files or not quantized_names:
        return
    prefixes = tuple(n + "." for n in quantized_names)
    base = getattr(model, "base_model_prefix", "")
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            continue
        with open_safetensors(path) as f:
            for key in f.keys():
                if key.endswith(".bias"):
                    continue
                names = (key, f"{base}.{key}" if base else key, key.removeprefix(f"{base}.") if base else key)
                if not any(n.startswith(prefixes) for n in names):
                    continue
                dt = f.get_slice(key).get_dtype()
                if dt not in _FLOAT_SAFETENSORS_DTYPES:
                    raise TypeError(
                        f"surogate_hf: checkpoint tensor {key!r} in {path} has dtype {dt}; online quantization "
                        "needs a floating (bf16/fp16/fp32) checkpoint. Is this checkpoint already quantized?"
                    )


@register_quantizer(QUANT_METHOD)
class SurogateHfQuantizer(HfQuantizer):
    requires_calibration = False
    quantization_config: SurogateConfig

    def __new__(cls, quantization_config=None, **kwargs):
        # Seam for pre-quantized checkpoints: SurogateConfig(format=None) loads the checkpoint's own format.
        if quantization_config is not None and getattr(quantization_config, "format", None) is None:
            try:
                from .prequantized import PrequantizedHfQuantizer
            except ModuleNotFoundError as exc:
                if exc.name != f"{__package__}.prequantized":
                    raise
                raise ImportError(
                    "SurogateConfig(format=None) loads a checkpoint's own pre-quantized format, which needs "
                    "surogate_hf.integrations.prequantized (missing from this installation). To quantize a "
                    "bf16/fp16 checkpoint, pass format='fp8', 'nvfp4', 'mxfp4' or 'nf4'."
                ) from exc
            return PrequantizedHfQuantizer(quantization_config, **kwargs)
        return super().__new__(cls)

    def __init__(self, quantization_config: SurogateConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.fmt = make_format(quantization_config.format, **quantization_config.format_options())
        self.report = None

    # ---------------------------------------------------------------- environment
    def validate_environment(self, *args, **kwargs):
        if self.pre_quantized:
            raise ValueError(
                f"SurogateConfig(format={self.quantization_config.format!r}) quantizes a bf16/fp16 checkpoint "
                "while loading, but this checkpoint is already quantized (its config.json has a "
                "quantization_config). Pass SurogateConfig() to load it in its own format."
            )
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("surogate_hf: online quantization cannot offload to disk; drop 'disk' from device_map")

    @property
    def quantized_element_size(self) -> float:
        return self.fmt.bytes_per_param()

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, name = get_module_from_name(model, param_name)
        if isinstance(module, QuantizedLinear):
            return name == "weight"
        if isinstance(module, QuantizedExperts):
            return name in module.projections
        return False

    # ---------------------------------------------------------------- model surgery
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        for pattern in unmatched_patterns(model, cfg.modules_to_not_convert):
            warnings.warn(
                f"surogate_hf: modules_to_not_convert pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; it has no effect",
                SurogateWarning,
                stacklevel=2,
            )
        skip = self.get_modules_to_not_convert(
            model, cfg.modules_to_not_convert, getattr(model, "_keep_in_fp32_modules", None), add_default_skips=True
        )
        self.modules_to_not_convert = skip
        self.report = replace_with_quantized_modules(
            model,
            cfg.format,
            cfg.format_options(),
            skip=skip,
            skip_first_layers=cfg.skip_quant_first_layers,
            skip_last_layers=cfg.skip_quant_last_layers,
        )
        if not self.report.quantized:
            warnings.warn(
                f"surogate_hf: no module of {type(model).__name__} was quantized to {cfg.format}", SurogateWarning, stacklevel=2
            )
        _checkpoint_dtype_check(model, checkpoint_files, self.report.quantized)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, m in quantized_modules(model):
            for p in m.parameters(recurse=False):  # biases: the loader makes float params trainable
                p.requires_grad_(False)
            on_meta = [n for n, b in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)] if b.is_meta]
            if on_meta:
                raise RuntimeError(f"surogate_hf: {name} slots {on_meta} were not loaded (missing checkpoint tensors?)")
            S.finalize_slots(m)
        model._surogate_report = self.report
        # LoRA on these modules must go through surogate's LoRA layer (a stock lora.Linear would merge into
        # packed data), also for load_adapter() straight after from_pretrained().
        from .causal_mask import install_compiled_causal_mask_skip
        from .peft import install_peft_dispatch

        install_peft_dispatch()
        install_compiled_causal_mask_skip()  # whole-model compile keeps SDPA's causal kernels on torch < 2.13
        return model

    def get_quantize_ops(self):
        return SurogateQuantize(self)

    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):  # transformers passes model.config.dtype, a string after save_pretrained
            dtype = getattr(torch, dtype)
        return dequantize_model(model, dtype)

    # ---------------------------------------------------------------- flags
    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return False

    # ---------------------------------------------------------------- saving
    def get_state_dict_and_metadata(self, model):
        if getattr(model, "_hf_peft_config_loaded", False):
            return None, {}  # adapter-only save: transformers keeps the adapter tensors
        state_dict, qconfig = export_state_dict(model, self.quantization_config)
        model.config.quantization_config = qconfig
        return state_dict, {}


# ============================================================================ saving
def _per_expert_keys(model, name: str, m: QuantizedExperts, p: str):
    """Map the fused parameter `{name}.{p}` to its on-disk tensors through the model's conversion
    mapping: [(key, expert, first_row, last_row)], or None when it is stored fused (unchanged)."""
    from transformers.core_model_loading import revert_weight_conversion

    n, _, _ = m.projections[p]
    e = m.num_experts
    idx = torch.arange(e * n, dtype=torch.int64).reshape(e, n, 1)
    if m.is_transposed:
        idx = idx.transpose(1, 2).contiguous()
    full = f"{name}.{p}"
    try:
        out = revert_weight_conversion(model, {full: idx})
    except Exception as exc:  # the mapping's reverse ops cannot split this tensor
        raise RuntimeError(f"surogate_hf: cannot map {full} to its checkpoint tensors for saving: {exc}") from exc
    if list(out) == [full] or (len(out) == 1 and not next(iter(out)).endswith(".weight")):
        return None, next(iter(out))
    entries = []
    for key, v in out.items():
        flat = v.reshape(-1)
        experts = set((flat // n).tolist())
        rows = flat % n
        r0, r1 = int(rows.min()), int(rows.max()) + 1
        if len(experts) != 1 or not key.endswith(".weight") or not torch.equal(rows, torch.arange(r0, r1)):
            raise RuntimeError(
                f"surogate_hf: the conversion mapping stores {full} as {key} in a layout other than one "
                "expert's contiguous rows; cannot save it quantized"
            )
        entries.append((key, experts.pop(), r0, r1))
    return entries, None


def _expert_slice(m: QuantizedExperts, p: str, e: int, r0: int, r1: int) -> tuple[dict, int, int]:
    """The unit tensors covering rows [r0, r1) of expert e's projection p, and their (n, k)."""
    u, rows, k = m.units(p)
    fmt = m.fmt
    if fmt.per_component:
        if r0 % rows or r1 - r0 != rows:
            raise RuntimeError(
                f"surogate_hf: rows {r0}:{r1} of {p} do not form one quantized unit of {rows} rows; cannot save"
            )
        return m.unit_tensors(p, e, r0 // rows), rows, k
    return fmt.expert_rows(m.unit_tensors(p, e, 0), r0, r1), r1 - r0, k


def export_state_dict(model, config: SurogateConfig):
    """(state_dict in the standard layout of config.format, quantization_config dict for config.json).

    Format-agnostic: each format's home (nn/formats/) writes its units (`Format.to_checkpoint`), names its
    natively fused expert tensors and describes the layout (`Format.checkpoint_config`)."""
    fmt = make_format(config.format, **config.format_options())
    sd = dict(model.state_dict())
    dense_names = []
    linears = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear or is_experts_module(module):
            dense_names.append(name)
    for name, m in quantized_modules(model):
        prefix = f"{name}." if name else ""
        for slot in m.slot_names():
            sd.pop(prefix + slot, None)
        if isinstance(m, QuantizedLinear):
            # the slots' logical dtypes and shapes, as the checkpoint layouts store them
            sd.update(m.fmt.to_checkpoint(m._tensors(), m.out_features, m.in_features, prefix, m.dtype))
            linears[name] = (m.out_features, m.in_features)
            continue
        for p in m.projections:
            entries, native_key = _per_expert_keys(model, name, m, p)
            if entries is None:
                disk_prefix = native_key[: -len(p)]
                for s in m.fmt.slots(*m.units(p)[1:], expert=True):
                    sd[disk_prefix + m.fmt.expert_checkpoint_name(p, s)] = S.get_slot(m, p + s)
                continue
            for key, e, r0, r1 in entries:
                t, n, k = _expert_slice(m, p, e, r0, r1)
                # clone: safetensors refuses tensors sharing storage (slices of one expert buffer)
                t = {s: v.clone() for s, v in t.items()}
                sd.update(m.fmt.to_checkpoint(t, n, k, key[: -len("weight")], m.dtype))
    caveat = fmt.save_caveats(linears)
    if caveat:
        warnings.warn(caveat, SurogateWarning, stacklevel=3)
    return sd, fmt.checkpoint_config(dense_names)
