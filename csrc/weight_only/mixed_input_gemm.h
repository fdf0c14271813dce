// The mixed-input WGMMA GEMMs' entry points (mixed_input_gemm.cu), declared once for their callers: the op
// surogate::ext_mixed_input_gemm (bindings.cpp) and the decode route's forward (decoded_linear.cpp).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace surogate {

// Whether the loaded library holds the kernels' SM90a code for device dev (an attribute query, safe under capture).
bool mixed_input_gemm_supported(int dev);

// y [M, N] bf16 (+)= x [M, K] bf16 @ deq(W)^T for an NVFP4 (fmt 0), MXFP4 (1) or NF4 (2) weight; the operands and
// their requirements are stated at the definition.
cudaError_t launch_mixed_input_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                    const float* gscale, const float* levels, int nf4_block,
                                    const float* nested_absmax, const float* nested_code, const float* nested_offset,
                                    void* y, int M, int N, int K, bool accumulate, int sms, int dev,
                                    cudaStream_t stream);

}  // namespace surogate
