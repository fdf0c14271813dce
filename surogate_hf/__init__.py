"""surogate_hf: low-precision training for the Hugging Face stack.

Importing the package registers `SurogateConfig` (quant_method "surogate") and its HfQuantizer with
transformers. It never imports triton or a native extension.
"""

__version__ = "0.1.0"

from .config import SurogateConfig
from .integrations import transformers as _transformers_integration  # noqa: F401  (registers the quantizer)
from .integrations import modelopt as _modelopt_integration  # noqa: F401  (quant_method "modelopt" + the SurogateConfig() seam for pre-quantized checkpoints)


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
