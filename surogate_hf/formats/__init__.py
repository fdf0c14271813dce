"""The reference number formats: pure PyTorch, run on CPU, the spec every kernel is tested against."""

from .e2m1 import (
    E2M1_MAX,
    decode_packed_e2m1,
    e2m1_decode,
    e2m1_encode,
    e2m1_encode_stochastic,
    e2m1_round,
    pack_e2m1,
    unpack_e2m1,
)
from .fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    FP8_WEIGHT_ONLY_MAX_PARAMS,
    cast_to_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_tiles,
    fp8_dtype,
    fp8_linear_weight_only,
    fp8_scale_from_amax,
    quantize_fp8_blocks,
    quantize_fp8_tensorwise,
    quantize_fp8_tiles,
)
from .hadamard import hadamard_matrix, inverse_rht, random_signs, rht
from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, e8m0_to_float, fake_quantize_mxfp4, quantize_mxfp4
from .nf4 import dequantize_nf4, dequantize_nf4_raw, nf4_absmax, nf4_code, quantize_nf4
from .nvfp4 import (
    NVFP4_BLOCK,
    NVFP4Quantized,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    mm_qdq,
    nvfp4_global_scales,
    nvfp4_operand,
    qdq_nvfp4,
    quantize_nvfp4,
)
from .rng import uniform_from_counter, uniform_like
