"""One home per weight format: fp8, nvfp4, mxfp4, nf4 (docs/adding_a_format.md).

Each module holds its format's options (a validated dataclass), its `Format` (packed slots, quantize and
dequantize through surogate_hf.formats and the surogate:: ops, forward / dgrad, the GEMM plan) and its checkpoint
layouts (HF fine-grained FP8 and ModelOpt FP8, ModelOpt NVFP4, GPT-OSS MXFP4, bitsandbytes NF4), and registers
them. `FORMAT_CLASSES` / `LAYOUTS` are what the module swap, save_pretrained and the pre-quantized loader loop over.
"""

from .base import FORMAT_CLASSES, LAYOUTS, Format, Layout, OptionError, Options, make_format, register
from .fp8 import FP8Format, FP8Options
from .nvfp4 import NVFP4Format, NVFP4Options
from .mxfp4 import MXFP4Format, MXFP4Options
from .nf4 import NF4Format, NF4Options

FORMATS = tuple(FORMAT_CLASSES)  # ("fp8", "nvfp4", "mxfp4", "nf4"): registration order

__all__ = [
    "FORMATS",
    "FORMAT_CLASSES",
    "LAYOUTS",
    "FP8Format",
    "FP8Options",
    "Format",
    "Layout",
    "MXFP4Format",
    "MXFP4Options",
    "NF4Format",
    "NF4Options",
    "NVFP4Format",
    "NVFP4Options",
    "OptionError",
    "Options",
    "make_format",
    "register",
]
