"""Load pre-quantized checkpoints as they are stored: fine-grained FP8, ModelOpt NVFP4/FP8/MIXED_PRECISION,
GPT-OSS MXFP4 experts.

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
transformers merges the two configs (see `_merge_quantization_configs`, the one patch of library code here).
"""

from .checkpoint import CheckpointIndex, ModulePlan, plan_modules
from .modules import FuseStoredExperts
from .quantizer import (
    PrequantizedConfig,
    PrequantizedHfQuantizer,
    _merge_quantization_configs,  # noqa: F401  (tests check the seam is installed)
    _original_merge,  # noqa: F401
    install_merge_patch,
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
    "plan_modules",
    "read_legacy_modelopt_config",
]
