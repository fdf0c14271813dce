// One pass per operand for the nvfp4 recipe on GPUs without FP4 tensor cores: quantize to NVFP4 (1x16 blocks,
// Four-Over-Six, optional stochastic rounding and random Hadamard transform) and write the values the FP4 GEMM
// operand holds without its global scale, e2m1 * s_blk, as bf16 (exact). A bf16 tensor-core GEMM with fp32
// accumulation over two such operands, scaled by the product of the globals, is the NVFP4 GEMM up to summation
// order (surogate::nvfp4_mm's contract). The math is nvfp4_math.cuh; the reference is surogate::nvfp4_qdq
// (surogate_hf/ops/quant.py).
//
// Blocks run along one axis of a 2-D x [R, C]:
//   axis 1: 16 consecutive elements of a row (the forward's x, the dgrad's dy); out [R, C]; element (r, c) is
//           offset r * C + c of the quantized tensor;
//   axis 0: 16 consecutive rows of a column (the wgrad's dy and x, whose GEMM reduces over tokens); the rows are
//           zero-padded to Rp = ceil(R / 16) * 16 inside the kernel; out [Rp, C] in x's layout, so the GEMM reads
//           it transposed with no copy; element (r, c) is offset c * Rp + r of the quantized tensor (x^T, padded).
// The tensor amax that sets the global scale comes first, from amax_*_kernel (the same transform applied).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../common/device.cuh"
#include "nvfp4_math.cuh"

namespace surogate {
namespace {

using nvfp4::kBlock;

// 16 elements of a row from x + offset (16-byte aligned: offset is a multiple of 16 and x is aligned)
template <typename T>
__device__ __forceinline__ void load_row_block(const T* __restrict__ x, int64_t offset, float* v) {
  constexpr int PER16 = 16 / sizeof(T);
#pragma unroll
  for (int h = 0; h < kBlock / PER16; ++h) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + offset + h * PER16);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < PER16; ++j) v[h * PER16 + j] = to_f32<T>(e[j]);
  }
}

// column c of rows r0 .. r0 + 15 (zeros past R); a warp reads 32 adjacent columns of each row
template <typename T>
__device__ __forceinline__ void load_col_block(const T* __restrict__ x, int64_t r0, int64_t c, int64_t R, int64_t C,
                                               float* v) {
#pragma unroll
  for (int i = 0; i < kBlock; ++i) v[i] = r0 + i < R ? to_f32<T>(x[(r0 + i) * C + c]) : 0.f;
}

__device__ __forceinline__ void load_signs(const float* __restrict__ signs, float* sg) {
#pragma unroll
  for (int i = 0; i < kBlock; ++i) sg[i] = signs[i];
}

__device__ __forceinline__ unsigned block_max_bits(const float* v) {
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) m = max(m, nvfp4::abs_bits_of(v[i]));
  return m;
}

// amax of x (axis 1) or of its column blocks (axis 0), after the transform when signs is given; one thread per
// 16-block
template <typename T, int AXIS>
__global__ void __launch_bounds__(256) amax_kernel(const T* __restrict__ x, const float* __restrict__ signs,
                                                   unsigned* __restrict__ amax, int64_t R, int64_t C, int64_t work) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned local = 0;
  if (t < work) {
    float sg[kBlock];
    if (signs) load_signs(signs, sg);
    float v[kBlock];
    if (AXIS == 1) {
      load_row_block<T>(x, t * kBlock, v);
      if (signs) nvfp4::rht16(v, sg);
      local = block_max_bits(v);
    } else {
      const int64_t rb = t / C, c = t - rb * C;
      load_col_block<T>(x, rb * kBlock, c, R, C, v);
      if (signs) nvfp4::rht16(v, sg);
      local = block_max_bits(v);
    }
  }
  block_amax_into(local, amax);
}

template <typename T, int AXIS, bool FOUR_SIX>
__global__ void __launch_bounds__(256) qdq_kernel(const T* __restrict__ x, const float* __restrict__ signs,
                                                  const unsigned* __restrict__ amax_bits,
                                                  __nv_bfloat16* __restrict__ out, float* __restrict__ g_dec_out,
                                                  int64_t R, int64_t C, int64_t Rp, int64_t work, int rule,
                                                  bool stochastic, uint32_t seed_mix) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const nvfp4::Globals g = nvfp4::globals_of(nvfp4::float_of(*amax_bits));
  if (t == 0) *g_dec_out = g.dec;
  if (t >= work) return;
  float sg[kBlock];
  if (signs) load_signs(signs, sg);
  float v[kBlock], q[kBlock];
  if (AXIS == 1) {
    load_row_block<T>(x, t * kBlock, v);
    if (signs) nvfp4::rht16(v, sg);
    nvfp4::quantize_block<FOUR_SIX>(v, g, rule, stochastic, seed_mix, t * kBlock, q);
    uint4 packed[2];
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(packed);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) o[i] = __float2bfloat16_rn(q[i]);
    uint4* dst = reinterpret_cast<uint4*>(out + t * kBlock);
    dst[0] = packed[0];
    dst[1] = packed[1];
  } else {
    const int64_t rb = t / C, c = t - rb * C, r0 = rb * kBlock;
    load_col_block<T>(x, r0, c, R, C, v);
    if (signs) nvfp4::rht16(v, sg);
    nvfp4::quantize_block<FOUR_SIX>(v, g, rule, stochastic, seed_mix, c * Rp + r0, q);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) out[(r0 + i) * C + c] = __float2bfloat16_rn(q[i]);
  }
}

int64_t work_items(int axis, int64_t R, int64_t C) {
  return axis == 1 ? R * C / kBlock : (R + kBlock - 1) / kBlock * C;
}

}  // namespace

// x [R, C] contiguous (axis 1: C % 16 == 0 and x 16-byte aligned; axis 0: any C); amax: a zeroed uint32 that
// receives the bits of the fp32 amax.
void launch_nvfp4_amax(const void* x, int dtype, const float* signs, unsigned* amax, int64_t R, int64_t C, int axis,
                       cudaStream_t stream) {
  const int64_t work = work_items(axis, R, C);
  if (work == 0) return;
  const unsigned blocks = (unsigned)((work + 255) / 256);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (axis == 1)
      amax_kernel<T, 1><<<blocks, 256, 0, stream>>>((const T*)x, signs, amax, R, C, work);
    else
      amax_kernel<T, 0><<<blocks, 256, 0, stream>>>((const T*)x, signs, amax, R, C, work);
  });
}

// out: bf16 [R, C] (axis 1) or [Rp, C] (axis 0), 16-byte aligned; g_dec_out: one fp32 (always written).
void launch_nvfp4_qdq(const void* x, int dtype, const float* signs, const unsigned* amax, void* out, float* g_dec_out,
                      int64_t R, int64_t C, int axis, bool four_over_six, int rule, bool stochastic, int64_t seed,
                      cudaStream_t stream) {
  const int64_t Rp = axis == 1 ? R : (R + kBlock - 1) / kBlock * kBlock;
  const int64_t work = work_items(axis, R, C);
  const unsigned blocks = work > 0 ? (unsigned)((work + 255) / 256) : 1u;  // one block at least: g_dec is written
  const uint32_t mix = nvfp4::seed_mix_of(seed);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto axis_c, auto fos_c) {
      qdq_kernel<T, decltype(axis_c)::value, decltype(fos_c)::value><<<blocks, 256, 0, stream>>>(
          (const T*)x, signs, amax, (__nv_bfloat16*)out, g_dec_out, R, C, Rp, work, rule, stochastic, mix);
    };
    using A0 = std::integral_constant<int, 0>;
    using A1 = std::integral_constant<int, 1>;
    if (axis == 1) {
      if (four_over_six) go(A1{}, std::true_type{}); else go(A1{}, std::false_type{});
    } else {
      if (four_over_six) go(A0{}, std::true_type{}); else go(A0{}, std::false_type{});
    }
  });
}

}  // namespace surogate
