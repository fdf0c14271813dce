"""surogate_hf: low-precision training for the Hugging Face stack.

Importing the package registers `SurogateConfig` (quant_method "surogate") and its HfQuantizer with
transformers. It never imports triton or a native extension.
"""

__version__ = "0.1.0"

from .config import SurogateConfig
from .integrations import transformers as _transformers_integration  # noqa: F401  (registers the quantizer)
from .integrations import modelopt as _modelopt_integration  # noqa: F401  (quant_method "modelopt" + the SurogateConfig() seam for pre-quantized checkpoints)

__all__ = ["SurogateConfig", "__version__"]
