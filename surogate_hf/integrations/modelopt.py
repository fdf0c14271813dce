"""quant_method "modelopt": transformers 5.23 has no ModelOpt support, so a ModelOpt checkpoint (NVFP4, FP8,
MIXED_PRECISION) loads through surogate_hf's pre-quantized loader once surogate_hf is imported.

Only the free name "modelopt" is registered; "fp8", "mxfp4" and "bitsandbytes" stay transformers' own unless the
caller passes SurogateConfig(). Older ModelOpt exports keep the config in hf_quant_config.json only; transformers does not read
that file, so those load with `quantization_config=SurogateConfig()`.
"""

from __future__ import annotations

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from .prequantized import PrequantizedConfig, PrequantizedHfQuantizer

QUANT_METHOD = "modelopt"


class ModelOptConfig(PrequantizedConfig):
    """A ModelOpt quantization_config from config.json (or the legacy hf_quant_config.json form)."""

    def __init__(self, checkpoint_config: dict | None = None, source: str = "config.json quantization_config", **kwargs):
        if checkpoint_config is None:
            checkpoint_config = {"quant_method": QUANT_METHOD, **kwargs}
        super().__init__(checkpoint_config, source, quant_method=QUANT_METHOD)

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        config = cls(dict(config_dict))
        return (config, kwargs) if return_unused_kwargs else config


class ModelOptHfQuantizer(PrequantizedHfQuantizer):
    """The pre-quantized loader, registered under quant_method "modelopt" (transformers 5.23 has none), so a
    ModelOpt checkpoint loads with no quantization_config passed once surogate_hf is imported."""


def register() -> None:
    """Idempotent: importing surogate_hf twice (or reloading this module) must not raise 'already registered'."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is None:
        register_quantization_config(QUANT_METHOD)(ModelOptConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is None:
        register_quantizer(QUANT_METHOD)(ModelOptHfQuantizer)


register()
