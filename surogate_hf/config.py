"""SurogateConfig: the transformers `quantization_config` that selects a surogate_hf weight format.

    SurogateConfig(format="nvfp4")   # quantize a bf16/fp16 checkpoint while it loads
    SurogateConfig()                 # format=None: load the checkpoint's own pre-quantized format

Options (validated on creation; a bad value raises ValueError naming the option):
    format                 "fp8" | "nvfp4" | "mxfp4" | "nf4" | None
    block_size             fp8 weight block (rows, cols), default (128, 128); None or "tensor" = one
                           per-tensor scale. Each side a power of two in [16, 512] (GPU kernels tile in
                           powers of two; DeepSeek-V3 checkpoints use 128x128).
    ue8m0                  fp8: power-of-two (UE8M0) block scales, default False
    four_over_six          nvfp4: Four-Over-Six block scale choice, default True
    four_over_six_rule     nvfp4: "mse" | "mae" | "abs_max", default "mse"
    nf4_block_size         nf4: 64 | 128, default 64
    nf4_double_quant       nf4: quantize the absmaxes too, default True
    nf4_scale_search       nf4: each block's scale is the lowest-error share (0.70-1.0) of its absmax, default True
                           (0.5 dB less weight error on real weights; False = bitsandbytes' quantize_4bit bit for bit)
    modules_to_not_convert module-name patterns kept in the model dtype (transformers' matching rules:
                           prefix up to a module boundary, regex, or suffix)
    skip_quant_first_layers / skip_quant_last_layers   number of decoder layers kept in the model dtype

The options of one format must stay at their defaults under another format (and under format=None, where
the checkpoint fixes everything): a value there would be ignored, so it is an error naming the option.
Each format's options are its home's `Options` dataclass (surogate_hf/nn/formats/<format>.py): it validates
them, and its CONFIG_FIELDS says which field here sets which option (nf4_block_size -> NF4Options.block_size).
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers.quantizers.auto import register_quantization_config
from transformers.utils.quantization_config import QuantizationConfigMixin

from .formats.nf4 import NF4_BLOCK_SIZES  # noqa: F401  (re-exported: the option values, named where they live)
from .formats.nvfp4 import FOUR_OVER_SIX_RULES  # noqa: F401
from .nn.formats import FORMAT_CLASSES, FORMATS  # noqa: F401  (FORMATS re-exported)
from .nn.formats.fp8 import FP8_BLOCK_SIDES  # noqa: F401

QUANT_METHOD = "surogate"

# Options that only mean something for one format (each format's Options.CONFIG_FIELDS, nn/formats/); a
# non-default value under another format is an error.
_FORMAT_OPTIONS = {field: name for name, cls in FORMAT_CLASSES.items() for field in cls.options_class.CONFIG_FIELDS}

_FIELDS = (
    "format",
    "block_size",
    "ue8m0",
    "four_over_six",
    "four_over_six_rule",
    "nf4_block_size",
    "nf4_double_quant",
    "nf4_scale_search",
    "modules_to_not_convert",
    "skip_quant_first_layers",
    "skip_quant_last_layers",
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@register_quantization_config(QUANT_METHOD)
class SurogateConfig(QuantizationConfigMixin):
    def __init__(
        self,
        format: str | None = None,
        block_size: tuple[int, int] | str | None = (128, 128),
        ue8m0: bool = False,
        four_over_six: bool = True,
        four_over_six_rule: str = "mse",
        nf4_block_size: int = 64,
        nf4_double_quant: bool = True,
        nf4_scale_search: bool = True,
        modules_to_not_convert: list[str] | None = None,
        skip_quant_first_layers: int = 0,
        skip_quant_last_layers: int = 0,
        **kwargs,
    ):
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"SurogateConfig: quant_method must be {QUANT_METHOD!r}, got {method!r}")
        if kwargs:
            raise ValueError(f"SurogateConfig: unknown option(s) {sorted(kwargs)}; known options are {list(_FIELDS)}")
        self.quant_method = QUANT_METHOD
        self.format = format
        self.block_size = block_size
        self.ue8m0 = ue8m0
        self.four_over_six = four_over_six
        self.four_over_six_rule = four_over_six_rule
        self.nf4_block_size = nf4_block_size
        self.nf4_double_quant = nf4_double_quant
        self.nf4_scale_search = nf4_scale_search
        self.modules_to_not_convert = modules_to_not_convert
        self.skip_quant_first_layers = skip_quant_first_layers
        self.skip_quant_last_layers = skip_quant_last_layers
        self.post_init()
        # The entry point of the one transformers patch (see integrations/prequantized/quantizer.py): creating a
        # SurogateConfig, not importing surogate_hf. from_pretrained merges a checkpoint's quantization_config with
        # this object before any quantizer hook runs, so the quantizer itself would be too late.
        from .integrations.prequantized import install_merge_patch

        install_merge_patch()

    def post_init(self):
        """Validate and normalise every option; raise ValueError naming the offending one."""
        fmt = self.format
        if fmt is not None:
            if not isinstance(fmt, str) or fmt.lower() not in FORMAT_CLASSES:  # the registry: every format's home
                known = tuple(FORMAT_CLASSES)
                raise ValueError(f"SurogateConfig: unknown format {fmt!r}; expected one of {known} or None")
            self.format = fmt.lower()

        # Every format's options are validated (also those of other formats, which must stay at their defaults):
        # each home's Options dataclass checks and normalises them and names the SurogateConfig field.
        for cls in FORMAT_CLASSES.values():
            fields = cls.options_class.CONFIG_FIELDS
            opts = cls.options_class.from_config({f: getattr(self, f) for f in fields})
            for field, option in fields.items():
                setattr(self, field, getattr(opts, option))

        for name, owner in _FORMAT_OPTIONS.items():
            if self.format != owner and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(
                    f"SurogateConfig: {name}={getattr(self, name)!r} is an option of format={owner!r} and would be "
                    f"ignored with format={self.format!r}; drop {name} or use format={owner!r}"
                )

        mtc = self.modules_to_not_convert
        if mtc is not None:
            if isinstance(mtc, str) or not all(isinstance(m, str) and m for m in mtc):
                raise ValueError(
                    f"SurogateConfig: modules_to_not_convert must be a list of non-empty strings, got {mtc!r}"
                )
            self.modules_to_not_convert = list(mtc)
        for name in ("skip_quant_first_layers", "skip_quant_last_layers"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"SurogateConfig: {name} must be a non-negative int, got {v!r}")

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = {"quant_method": QUANT_METHOD}
        for name in _FIELDS:
            v = getattr(self, name)
            d[name] = list(v) if isinstance(v, tuple) else (list(v) if isinstance(v, list) else v)
        return d

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        config = cls(**config_dict)
        unused = {}
        for k, v in kwargs.items():
            if k in _FIELDS:
                setattr(config, k, v)
            else:
                unused[k] = v
        config.post_init()
        return (config, unused) if return_unused_kwargs else config

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __eq__(self, other):
        return isinstance(other, SurogateConfig) and self.to_dict() == other.to_dict()

    __hash__ = None

    # ------------------------------------------------------------ helpers
    def format_options(self) -> dict[str, Any]:
        """Constructor keywords of the quantized module class for `self.format` (the format's Options fields)."""
        if self.format is None:
            return {}
        fields = FORMAT_CLASSES[self.format].options_class.CONFIG_FIELDS
        return {option: getattr(self, field) for field, option in fields.items()}


_DEFAULTS = {name: inspect.signature(SurogateConfig.__init__).parameters[name].default for name in _FORMAT_OPTIONS}
