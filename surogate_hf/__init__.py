"""surogate_hf: low-precision training for the Hugging Face stack.

Importing the package registers `SurogateConfig` (quant_method "surogate"), its HfQuantizer and the "modelopt"
quantizer through transformers' public registries, and changes no library object (tests/test_import_side_effects.py).
It never imports triton or a native extension. The two patches of library code have explicit entry points:
- transformers' quantization-config merge (pre-quantized checkpoints with `SurogateConfig()`): creating a
  SurogateConfig; `surogate_hf.integrations.prequantized.install_merge_patch()` / `uninstall_merge_patch()`;
- PEFT's LoRA dispatch (SurogateLoraLinear on quantized bases): `prepare_for_training`, and our quantizers when
  they load a model; `surogate_hf.integrations.peft.install_peft_dispatch()` / `uninstall_peft_dispatch()`.
One registration replaces a transformers function through its public registry, on torch < 2.13 only: SDPA's mask
function, so that a compiled model skips the causal mask as eager does (integrations/causal_mask.py):
`prepare_for_training`, `apply_recipe`, our quantizers; `install_compiled_causal_mask_skip()` / `uninstall_...()`.
"""

__version__ = "0.1.0"

from . import ops as _ops  # noqa: F401  (every surogate:: op schema; the reference kernels)
from . import kernels as _kernels  # noqa: F401  (their CUDA implementations; triton loads on the first CUDA call)
from .config import SurogateConfig
from .integrations import transformers as _transformers_integration  # noqa: F401  (registers the quantizer)
from .integrations import modelopt as _modelopt_integration  # noqa: F401  (registers quant_method "modelopt")


# Loaded on first use: the Trainer callback pulls in transformers' Trainer machinery (and with it triton),
# which plain `import surogate_hf` must not.
_LAZY = {
    "RecipeConfig": ".recipes",
    "apply_recipe": ".recipes",
    "SurogateRecipeCallback": ".integrations.trainer",
    "prepare_for_training": ".training",
    "set_lora_dtype": ".integrations.peft",
    "merge_to_dense": ".integrations.peft",
    "loftq_init": ".integrations.loftq",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'surogate_hf' has no attribute {name!r}")

__all__ = [
    "RecipeConfig",
    "SurogateConfig",
    "SurogateRecipeCallback",
    "apply_recipe",
    "loftq_init",
    "merge_to_dense",
    "prepare_for_training",
    "set_lora_dtype",
    "__version__",
]
