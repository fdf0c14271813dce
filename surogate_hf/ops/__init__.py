"""torch.library custom ops (namespace `surogate`): every schema and fake lives here, and the reference is each
op's default kernel; surogate_hf.kernels registers CUDA/Triton implementations under the same names. The
package root imports this package, then surogate_hf.kernels, once (no import from here into kernels)."""

from . import ext, linear, quant, recipe
from .quant import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_blocks,
    quantize_fp8_tensorwise,
    quantize_fp8_tensorwise_t,
    quantize_fp8_tiles,
    nvfp4_amax,
    nvfp4_qdq,
    quantize_mxfp4,
    quantize_nvfp4,
    rht,
)
from .recipe import delayed_scaling_update, fp8_scaled_mm, fp8_tiles_wgrad, nvfp4_mm, nvfp4_qdq_mm, take_step
from .ext import (
    ext_decoded_linear,
    ext_decoded_linear_bwd,
    ext_decoded_linear_fwd,
    ext_dequantize,
    ext_few_token_gemm,
    ext_fp8_block_gemm,
    ext_fp8_cast_amax,
    ext_fp8_cast_transpose_amax,
    ext_fp8_linear,
    ext_fp8_quantize_tiles,
    ext_fp8_scaled_mm,
    ext_mixed_input_gemm,
    ext_nvfp4_amax,
    ext_nvfp4_gemm,
    ext_nvfp4_qdq,
    ext_registered_linear_bwd,
    ext_registered_linear_fwd,
    ext_rmsnorm,
    ext_transpose_bytes,
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
