"""Load pre-quantized checkpoints as they are stored: fine-grained FP8, ModelOpt NVFP4/FP8/MIXED_PRECISION,
MXFP4 (GPT-OSS experts `{P}_blocks`/`{P}_scales`, dense linears `weight` + `weight_scale` E8M0) and bitsandbytes
4-bit NF4 (`weight`, `weight.absmax`, ... `weight.quant_state.bitsandbytes__nf4`), the layouts surogate_hf's own
save_pretrained writes included. MoE experts stored per expert (`experts.{e}.gate_proj.weight`, ...) are fused
into surogate_hf's QuantizedExperts on load and split back on save.

Only "modelopt" is taken over globally; "fp8", "mxfp4" and "bitsandbytes" checkpoints come here only when
from_pretrained gets `quantization_config=SurogateConfig()`, else transformers' own quantizers load them.

Flow (`PrequantizedHfQuantizer`, hooks in transformers' call order):
1. `_process_model_before_weight_loading` (model on meta) reads the checkpoint's quantization config
   (`CheckpointScheme`) and the safetensors headers plus every scale tensor (`CheckpointIndex`), plans each
   module (`plan_modules`) and validates the whole checkpoint before anything loads: one error naming every bad
   tensor or key, nothing half-loaded. Then quantized modules replace the dense ones, with slots shaped and
   typed exactly as the checkpoint stores them, so transformers' loader copies the bytes in unchanged.
2. `_process_model_after_weight_loading` turns stored encodings into the modules' working ones where they differ
   (e.g. ue8m0 bytes -> fp32 block scales, ModelOpt's scalar FP8 scale -> a 1x1 block scale) and freezes the base.
3. `get_state_dict_and_metadata` writes the stored layout back (same names, dtypes and shapes), and the model's
   config keeps the checkpoint's own quantization_config, so stock transformers / vLLM read the result.

Combining a pre-quantized checkpoint with an online `SurogateConfig(format=...)` is an error, raised where
transformers merges the two configs (see `_merge_quantization_configs`, the one patch of library code here,
installed when a SurogateConfig is created, never by importing surogate_hf).
"""

from .checkpoint import CheckpointIndex, ModulePlan, plan_modules
from .modules import FuseStoredExperts
from .quantizer import (
    PrequantizedConfig,
    PrequantizedHfQuantizer,
    _merge_quantization_configs,  # noqa: F401  (tests check the seam is installed)
    _original_merge,  # noqa: F401
    install_merge_patch,
    is_merge_patch_installed,
    uninstall_merge_patch,
)
from .scheme import CheckpointScheme, LayerFormat, PrequantizedCheckpointError, read_legacy_modelopt_config

__all__ = [
    "CheckpointIndex",
    "CheckpointScheme",
    "FuseStoredExperts",
    "LayerFormat",
    "ModulePlan",
    "PrequantizedCheckpointError",
    "PrequantizedConfig",
    "PrequantizedHfQuantizer",
    "install_merge_patch",
    "is_merge_patch_installed",
    "plan_modules",
    "read_legacy_modelopt_config",
    "uninstall_merge_patch",
]
