"""Quantized modules (frozen packed weights, forward through surogate:: ops) and the model swap."""

from .convert import (
    ConversionReport,
    SurogateWarning,
    decoder_layer_names,
    dequantize_model,
    quantized_modules,
    replace_with_quantized_modules,
)
from .experts import QuantizedExperts, is_experts_module
from .linear import (
    LINEAR_CLASSES,
    FP8Linear,
    Format,
    MXFP4Linear,
    NF4Linear,
    NVFP4Linear,
    QuantizedLinear,
    linear_class,
    make_format,
)
