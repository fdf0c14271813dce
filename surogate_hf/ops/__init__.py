"""torch.library custom ops (namespace `surogate`): the reference is each op's default kernel;
surogate_hf.kernels registers CUDA/Triton implementations under the same names."""

from . import linear, quant, recipe
from .quant import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_blocks,
    quantize_fp8_tensorwise,
    quantize_fp8_tiles,
    quantize_mxfp4,
    quantize_nvfp4,
    rht,
)
from .linear import (
    fp8_block_linear,
    fp8_block_linear_dgrad,
    mxfp4_linear,
    mxfp4_linear_dgrad,
    nf4_linear,
    nf4_linear_dgrad,
    nvfp4_linear,
    nvfp4_linear_dgrad,
)

# CUDA implementations register under the same names (thin wrappers: triton loads on first CUDA call).
from .. import kernels as _kernels  # noqa: E402,F401
