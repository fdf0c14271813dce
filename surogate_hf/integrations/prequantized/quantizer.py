"""The HfQuantizer for pre-quantized checkpoints, the config object transformers carries, and the merge seam."""

from __future__ import annotations

import json
import os
import re

import torch

from transformers.quantizers.auto import AutoHfQuantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging
from transformers.utils.quantization_config import QuantizationConfigMixin

from ...nn.formats import LAYOUTS
from .checkpoint import CheckpointIndex, ModulePlan, check_scale_values, plan_modules, raise_if_errors
from .modules import _FUSED_ATTR, _STORED_ATTR, FuseStoredExperts, _build_module, adopt_stored, export_fused, export_stored
from .scheme import CheckpointScheme, PrequantizedCheckpointError, read_config_json_quantization, read_legacy_modelopt_config

logger = logging.get_logger(__name__)

SUROGATE_METHOD = "surogate"


class PrequantizedConfig(QuantizationConfigMixin):
    """A checkpoint's own quantization_config, carried through from_pretrained.

    `to_dict()` is the stored dict, so save_pretrained writes config.json back unchanged. `quant_method`
    routes transformers to a quantizer: 'surogate' (the SurogateConfig quantizer hands it to
    PrequantizedHfQuantizer because `format` is None) or 'modelopt' (registered in surogate_hf.integrations.modelopt).
    """

    format = None  # "load the checkpoint's own format": what the surogate quantizer dispatches on

    def __init__(self, checkpoint_config: dict, source: str, quant_method: str = SUROGATE_METHOD, user_config=None):
        self.checkpoint_config = dict(checkpoint_config)
        self.source = source
        self.quant_method = quant_method
        self.user_config = user_config
        self.scheme = CheckpointScheme.from_dict(self.checkpoint_config, source)

    def to_dict(self) -> dict:
        return dict(self.scheme.raw)

    def to_diff_dict(self) -> dict:
        return self.to_dict()

    def __repr__(self):
        return f"{type(self).__name__}({json.dumps(self.to_dict(), sort_keys=True)}, source={self.source!r})"


def _is_surogate_config(cfg) -> bool:
    return getattr(cfg, "quant_method", None) == SUROGATE_METHOD and not isinstance(cfg, PrequantizedConfig)


def _checkpoint_dict(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, PrequantizedConfig):
        return cfg.checkpoint_config
    return cfg.to_dict()


# ---------------------------------------------------------------- the one patch of transformers
# transformers.quantizers.auto.get_hf_quantizer calls AutoHfQuantizer.merge_quantization_configs when config.json
# already has a known quantization_config; passing a config of another class (our SurogateConfig) raises there
# ("The model is quantized with FineGrainedFP8Config but you are passing a SurogateConfig"), before any quantizer
# hook runs, so no public hook lets SurogateConfig() load an fp8 / mxfp4 / modelopt checkpoint. The wrapper below
# acts only when the passed config is a SurogateConfig and defers to the original otherwise, so loading without
# SurogateConfig keeps transformers' behaviour.
# Entry point: not importing surogate_hf, but creating a SurogateConfig (SurogateConfig.__init__ calls
# install_merge_patch(); the merge runs before any quantizer exists, and it only acts on such a config anyway).
# tests/integrations/test_prequantized.py::test_merge_patch_still_needed fails when upstream stops raising (the patch can go)
# or stops calling this method (the patch no longer applies).
_original_merge = AutoHfQuantizer.merge_quantization_configs.__func__


def _merge_quantization_configs(cls, quantization_config, quantization_config_from_args):
    if not _is_surogate_config(quantization_config_from_args):
        return _original_merge(cls, quantization_config, quantization_config_from_args)
    stored = _checkpoint_dict(quantization_config)
    method = stored.get("quant_method")
    if getattr(quantization_config_from_args, "format", None) is not None:
        raise ValueError(
            f"this checkpoint is already quantized (config.json quantization_config has quant_method {method!r}); "
            f"SurogateConfig(format={quantization_config_from_args.format!r}) would quantize it a second time. "
            "Pass SurogateConfig() (format=None) to load it as stored, or start from a bf16 checkpoint."
        )
    if getattr(quantization_config_from_args, "modules_to_not_convert", None):
        raise ValueError(
            "SurogateConfig(modules_to_not_convert=...) has no effect on a pre-quantized checkpoint: which modules "
            f"are quantized is fixed by the checkpoint's own config (quant_method {method!r}); leave it unset"
        )
    return PrequantizedConfig(stored, "config.json quantization_config", user_config=quantization_config_from_args)


def is_merge_patch_installed() -> bool:
    return getattr(AutoHfQuantizer.merge_quantization_configs, "__func__", None) is _merge_quantization_configs


def install_merge_patch() -> None:
    """Let `from_pretrained(..., quantization_config=SurogateConfig())` load a checkpoint whose config.json already
    names a quantization (fp8, mxfp4, bitsandbytes, modelopt). Idempotent; called by SurogateConfig()."""
    if not is_merge_patch_installed():
        AutoHfQuantizer.merge_quantization_configs = classmethod(_merge_quantization_configs)


def uninstall_merge_patch() -> None:
    """Restore transformers' own merge_quantization_configs."""
    if is_merge_patch_installed():
        AutoHfQuantizer.merge_quantization_configs = classmethod(_original_merge)


# ---------------------------------------------------------------- the quantizer
class PrequantizedHfQuantizer(HfQuantizer):
    """Loads a checkpoint's stored quantized tensors into surogate_hf modules (frozen bases for LoRA)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.scheme: CheckpointScheme | None = getattr(quantization_config, "scheme", None)
        self.plans: list[ModulePlan] = []

    # transformers asks these before loading
    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("pre-quantized surogate_hf loading does not support disk offload in device_map")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # everything is stored quantized already: never re-quantize

    def get_new_dtype(self, converter, param, dtype):
        # Quantized tensors and their scales load exactly as stored (the slots were shaped and typed from the
        # checkpoint); only dense tensors follow the model dtype.
        keys = getattr(converter, "_original_source_patterns", ())
        if any(k in self._stored_keys for k in keys):
            return None
        if any(isinstance(op, FuseStoredExperts) for op in getattr(converter, "operations", ())):
            return None  # the fused slot's dtype (e.g. e4m3) is not the dtype of each stored companion
        return super().get_new_dtype(converter, param, dtype)

    @property
    def _stored_keys(self) -> set[str]:
        return getattr(self, "_stored_key_set", set())

    def _resolve_scheme(self, checkpoint_files) -> CheckpointScheme:
        if self.scheme is not None:
            return self.scheme
        directory = os.path.dirname(os.path.abspath(checkpoint_files[0])) if checkpoint_files else None
        unknown = read_config_json_quantization(directory) if directory else None
        if unknown is not None:
            # transformers drops a quantization_config whose quant_method it does not know (with a warning) and
            # hands us SurogateConfig() alone; say what the checkpoint declares instead of "no quantization_config"
            CheckpointScheme.from_dict(unknown, f"{directory}/config.json quantization_config")
        legacy = read_legacy_modelopt_config(directory) if directory else None
        if legacy is None:
            raise ValueError(
                "SurogateConfig() without format= loads a checkpoint's own quantization, but "
                f"{directory or 'the checkpoint'} has no quantization_config in config.json and no hf_quant_config.json. "
                "Pass SurogateConfig(format='fp8' | 'nvfp4' | 'mxfp4' | 'nf4') to quantize a dense checkpoint."
            )
        if getattr(self.quantization_config, "modules_to_not_convert", None):
            raise ValueError(
                "SurogateConfig(modules_to_not_convert=...) has no effect on a pre-quantized checkpoint: which modules "
                f"are quantized is fixed by {directory}/hf_quant_config.json; leave it unset"
            )
        self.scheme = CheckpointScheme.from_dict(legacy, os.path.join(directory, "hf_quant_config.json"))
        self.quantization_config = PrequantizedConfig(
            legacy, self.scheme.source, user_config=self.quantization_config
        )
        self.pre_quantized = True
        return self.scheme

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        scheme = self._resolve_scheme(checkpoint_files)
        index = CheckpointIndex(checkpoint_files)
        plans, errors = plan_modules(model, scheme, index)
        if not errors:
            errors = check_scale_values(plans, index)
        if not plans and not errors:
            errors = [f"no module of {type(model).__name__} matches a quantized tensor described by {scheme.source}"]
        raise_if_errors(errors, scheme)
        if scheme.raw.get("kv_cache_quant_algo"):
            logger.warning(
                f"{scheme.source}: kv_cache_quant_algo={scheme.raw['kv_cache_quant_algo']!r} is not applied by "
                "surogate_hf; the KV cache stays in the model dtype and its stored scales are left unused"
            )
        self.plans = plans
        self._stored_key_set = {f"{p.key}.{p.stored_names[s]}" for p in plans for s in p.slots}
        # FP8 scale aliases in use (dense linears, or per-expert components of fused experts)
        names = [p.stored_names.get("weight_scale_inv") for p in plans if p.fused is None]
        names += [v for p in plans if p.fused is not None for (_, slot), v in p.fused.suffix.items() if slot == "weight_scale_inv"]
        self._aliases = sorted({n for n in names if n and n != "weight_scale_inv"})
        for p in plans:
            parent, _, leaf = p.name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, _build_module(p, getattr(owner, leaf)))
        model.config.quantization_config = self.quantization_config
        return model

    def update_weight_conversions(self, weight_conversions, model):
        from transformers.core_model_loading import WeightRenaming

        # Scale aliases of real FP8 exports (DeepSeek-V4 `.scale`, Mistral `.qscale_weight`) load into
        # weight_scale_inv; transformers reverts the renaming when saving, so the stored name is written back.
        renames = []
        if "scale" in getattr(self, "_aliases", ()):
            renames.append(WeightRenaming(source_patterns=r"^(.+)\.scale", target_patterns=r"\1.weight_scale_inv"))
        if "qscale_weight" in getattr(self, "_aliases", ()):
            renames.append(WeightRenaming(source_patterns=r"\.qscale_weight", target_patterns=".weight_scale_inv"))
        # stored names a module attribute cannot hold onto the slots (bitsandbytes' `weight.absmax` -> `weight_absmax`)
        for kind in dict.fromkeys(p.fmt.kind for p in self.plans):
            for slot, suffix in LAYOUTS[kind].stored_names.items():
                if slot != suffix:
                    renames.append(WeightRenaming(source_patterns=re.escape("." + suffix), target_patterns="." + slot))
        return renames + self._fuse_experts_conversions(list(weight_conversions))

    def _loaded_name(self, suffix: str) -> str:
        """A stored suffix as the renamings above leave it (converters match after renamings)."""
        if suffix in getattr(self, "_aliases", ()):
            return "weight_scale_inv"
        loaded = {v: k for layout in LAYOUTS.values() for k, v in layout.stored_names.items()}
        return loaded.get(suffix, suffix)

    def _fuse_experts_conversions(self, conversions):
        """The model's per-expert merge converters (e.g. experts.*.gate_proj.weight + up_proj -> gate_up_proj) become
        one FuseStoredExperts op that also collects the stored scales."""
        from transformers.core_model_loading import WeightConverter

        fused = [p for p in self.plans if p.fused is not None]
        if not fused:
            return conversions
        out, matched = [], set()
        for conv in conversions:
            targets = getattr(conv, "_original_target_patterns", [])
            sources = getattr(conv, "_original_source_patterns", [])
            owner, _, proj = targets[0].rpartition(".") if isinstance(conv, WeightConverter) and len(targets) == 1 else ("", "", "")
            plan = next((p for p in fused if owner and (p.name == owner or p.name.endswith("." + owner))
                         and proj in p.fused.projections), None)
            if plan is None or not all(src.endswith(".weight") for src in sources):
                out.append(conv)
                continue
            lay = plan.fused
            patterns = {}
            for src in sources:
                base = src[: -len(".weight")]
                comp = base.rsplit(".", 1)[-1]
                for (c, slot), suffix in lay.suffix.items():
                    if c == comp:  # the renamings above run before converters match
                        patterns[(c, slot)] = f"{base}.{self._loaded_name(suffix)}"
            if sorted({c for c, _ in patterns}) != sorted(lay.projections[proj]):
                raise PrequantizedCheckpointError(
                    f"{plan.name}.{proj}: the model's conversion {sources} -> {targets} does not name the stored "
                    f"components {lay.projections[proj]}"
                )
            out.append(conv.copy(list(patterns.values()), targets, operations=[FuseStoredExperts(patterns)]))
            matched.update((p.name, proj) for p in fused if p.name == owner or p.name.endswith("." + owner))
        missing = [f"{p.name}.{proj}" for p in fused for proj in p.fused.projections if (p.name, proj) not in matched]
        if missing:
            raise PrequantizedCheckpointError(
                f"{missing}: stored per expert, but the model's conversion mapping has no converter merging "
                "per-expert weights into these fused experts; nothing was loaded"
            )
        return out

    def _process_model_after_weight_loading(self, model, **kwargs):
        for _, module in model.named_modules():
            if hasattr(module, _STORED_ATTR) or hasattr(module, _FUSED_ATTR):
                for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    if t.is_meta:
                        raise PrequantizedCheckpointError(f"{type(module).__name__}: a slot was not filled by the checkpoint")
                adopt_stored(module)
        from ..causal_mask import install_compiled_causal_mask_skip
        from ..peft import install_peft_dispatch  # LoRA on these bases needs surogate's LoRA layer (see peft.py)

        install_peft_dispatch()
        install_compiled_causal_mask_skip()  # whole-model compile keeps SDPA's causal kernels on torch < 2.13
        return model

    def _dequantize(self, model, dtype=None):
        from ...nn import dequantize_model

        if isinstance(dtype, str):  # transformers passes model.config.dtype, a string after save_pretrained
            dtype = getattr(torch, dtype)
        return dequantize_model(model, dtype)

    def get_state_dict_and_metadata(self, model):
        sd = model.state_dict()
        for name, module in model.named_modules():
            export = export_stored if hasattr(module, _STORED_ATTR) else export_fused if hasattr(module, _FUSED_ATTR) else None
            if export is not None:
                out, replaced = export(module, f"{name}." if name else "")
                for k in replaced:
                    sd.pop(k, None)
                sd.update(out)
        return sd, {}

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # frozen quantized bases + trainable adapters (LoRA); the base never receives gradients

    @property
    def is_compileable(self) -> bool:
        return True
