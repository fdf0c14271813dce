"""Triton quantize / dequantize kernels, bit-exact to surogate_hf.formats, one module per format.

Imported lazily (first CUDA call of a surogate:: op), never when surogate_hf is imported.

    _common    constants, fp32 / FP8 device helpers (NaN-keeping clamp, |x| bits, the FP8 cast), amax, autotune tiles
    e2m1       E2M1 (FP4) element codes: encode (RNE, stochastic), decode, nibble packing
    fp8        per-tensor casts (+ transpose), delayed-scaling update, block / tile scaling, block dequantize,
               the byte transpose
    nvfp4      NVFP4 quantize / dequantize
    mxfp4      MXFP4 quantize / dequantize
    hadamard   the randomized Hadamard transform

Every kernel repeats the reference's order of fp32 operations (see _common). This package re-exports the
names its callers use (surogate_hf.kernels.registry, triton_gemm, triton_norm, triton_recipe, fp8_gemm,
the tests and benchmarks), so `from surogate_hf.kernels import triton_quant as TQ` keeps working.
"""

from ._common import (  # noqa: F401
    _EXACT,
    _FLT_MAX,
    _GOLDEN,
    _INTERPRET,
    _TL_FP8,
    AUTOTUNE,
    _abs_bits,
    _amax_kernel,
    _clamp_nan,
    _e4m3_bits_sw,
    _tile_configs,
    _to_fp8,
    amax,
)
from .e2m1 import _e2m1_decode, _e2m1_encode, _e2m1_encode_sr, _hash_uniform, _nibbles, _pack_pairs  # noqa: F401
from .fp8 import (  # noqa: F401
    _block_scale,
    _delayed_update_kernel,
    _fp8_blocks_dequant_kernel,
    _fp8_blocks_kernel,
    _fp8_tensorwise_kernel,
    _fp8_tensorwise_t_kernel,
    _fp8_tiles_kernel,
    _transpose_bytes_kernel,
    delayed_scaling_update,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    quantize_fp8_tiles,
    transpose_2d,
)
from .hadamard import _rht_kernel, rht  # noqa: F401
from .mxfp4 import _e8m0_to_f32, _mxfp4_dequant_kernel, _mxfp4_quant_kernel, _mxfp4_tuned, dequantize_mxfp4, quantize_mxfp4  # noqa: F401
from .nvfp4 import (  # noqa: F401
    _NVFP4_KEYS,
    _RULES,
    _block_err,
    _nvfp4_1d,
    _nvfp4_2d,
    _nvfp4_candidate,
    _nvfp4_dequant_kernel,
    _nvfp4_quant_kernel,
    _tree16,
    dequantize_nvfp4,
    quantize_nvfp4,
)
