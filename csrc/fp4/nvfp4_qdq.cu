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
//   axis 2: 16 x 16 tiles (the training weight: W and W^T quantize alike); out [R, C]; 16 lanes per tile, one row
//           each, the tile's amax and its 4/6 error summed across them by shuffles in the reference's order.
// The tensor amax that sets the global scale comes first, from amax_kernel (the same transform applied).
// The GEMM's epilogue is here as well: cast(acc * (ga * gb) + bias) of its fp32 result, in one pass.
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

__device__ __forceinline__ void store_row_block(__nv_bfloat16* __restrict__ dst, const float* q) {
  uint4 packed[2];
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(packed);
#pragma unroll
  for (int i = 0; i < kBlock; ++i) o[i] = __float2bfloat16_rn(q[i]);
  reinterpret_cast<uint4*>(dst)[0] = packed[0];
  reinterpret_cast<uint4*>(dst)[1] = packed[1];
}

template <typename T> __device__ __forceinline__ void store_f32(T* p, float v);
template <> __device__ __forceinline__ void store_f32<float>(float* p, float v) { *p = v; }
template <> __device__ __forceinline__ void store_f32<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ void store_f32<__half>(__half* p, float v) { *p = __float2half_rn(v); }

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
                                                  bool stochastic, uint32_t seed_mix,
                                                  const int64_t* __restrict__ seed_ptr) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  // a seed on the device (a compiled graph's step counter hashed there) replaces the host one; read once per thread
  if (stochastic && seed_ptr) seed_mix = nvfp4::seed_mix_of(*seed_ptr);
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
    store_row_block(out + t * kBlock, q);
  } else {
    const int64_t rb = t / C, c = t - rb * C, r0 = rb * kBlock;
    load_col_block<T>(x, r0, c, R, C, v);
    if (signs) nvfp4::rht16(v, sg);
    nvfp4::quantize_block<FOUR_SIX>(v, g, rule, stochastic, seed_mix, c * Rp + r0, q);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) out[(r0 + i) * C + c] = __float2bfloat16_rn(q[i]);
  }
}

// formats.nvfp4._block_error of a 16 x 16 tile held as one row per lane of a 16-lane group (e: this lane's row of
// error terms, overwritten): the reference sums the row-major tile's halves, i.e. rows r + 8, r + 4, r + 2, r + 1
// into row r, then row 0's halves. Every lane of the group gets the result.
__device__ __forceinline__ float tile_error(float* e, int rule, int row) {
  if (rule == nvfp4::kAbsMax) {
    unsigned m = nvfp4::max_bits16(e);
#pragma unroll
    for (int d = 8; d >= 1; d >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, d, 16));
    return nvfp4::float_of(m);
  }
#pragma unroll
  for (int d = 8; d >= 1; d >>= 1) {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const float o = __shfl_down_sync(0xffffffffu, e[j], d, 16);
      if (row < d) e[j] = nvfp4::add(e[j], o);
    }
  }
  return __shfl_sync(0xffffffffu, nvfp4::tree_sum16(e), 0, 16);
}

template <typename T, bool FOUR_SIX>
__global__ void __launch_bounds__(256) qdq_2d_kernel(const T* __restrict__ x, const unsigned* __restrict__ amax_bits,
                                                     __nv_bfloat16* __restrict__ out, float* __restrict__ g_dec_out,
                                                     int64_t C, int64_t tiles, int rule) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t tile = t >> 4;
  const int row = threadIdx.x & 15;
  const nvfp4::Globals g = nvfp4::globals_of(nvfp4::float_of(*amax_bits));
  if (t == 0) *g_dec_out = g.dec;
  const bool live = tile < tiles;  // no early return: the 16-lane groups shuffle (a group is all live or all not)
  const int64_t ct = C / kBlock, tr = live ? tile / ct : 0, tc = live ? tile - tr * ct : 0;
  const int64_t offset = (tr * kBlock + row) * C + tc * kBlock;
  float v[kBlock], q[kBlock], e[kBlock];
  if (live) {
    load_row_block<T>(x, offset, v);
  } else {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = 0.f;
  }
  unsigned m = block_max_bits(v);
#pragma unroll
  for (int d = 8; d >= 1; d >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, d, 16));
  const float blk_amax = nvfp4::float_of(m);
  const nvfp4::Scale c6 = nvfp4::candidate(blk_amax, g, false);
#pragma unroll
  for (int j = 0; j < kBlock; ++j) e[j] = nvfp4::candidate_element(v[j], c6, g, rule, &q[j]);
  if (FOUR_SIX) {
    const float err6 = tile_error(e, rule, row);
    const nvfp4::Scale c4 = nvfp4::candidate(blk_amax, g, true);
    float q4[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) e[j] = nvfp4::candidate_element(v[j], c4, g, rule, &q4[j]);
    if (tile_error(e, rule, row) < err6) {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) q[j] = q4[j];
    }
  }
  if (live) store_row_block(out + offset, q);
}

// out = cast(acc * (ga * gb) + bias, OUT): the reference's roundings (the product of the globals, the scaling, the bias
// add in fp32, one cast; no FMA). In place when OUT is fp32.
template <typename OUT, typename B>
__global__ void __launch_bounds__(256) scale_bias_cast_kernel(const float* __restrict__ acc, const float* __restrict__ ga,
                                                              const float* __restrict__ gb, const B* __restrict__ bias,
                                                              OUT* __restrict__ out, int64_t n, int64_t N) {
  const float g = nvfp4::mul(*ga, *gb);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 4;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
    float v[4];
    if (i + 4 <= n) {
      const float4 a = *reinterpret_cast<const float4*>(acc + i);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = i + j < n ? acc[i + j] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i + j >= n) break;
      float r = nvfp4::mul(v[j], g);
      if (bias) r = nvfp4::add(r, to_f32<B>(bias[(i + j) % N]));
      store_f32<OUT>(out + i + j, r);
    }
  }
}

int64_t work_items(int axis, int64_t R, int64_t C) {
  if (axis == 2) return R / kBlock * (C / kBlock) * kBlock;  // 16 lanes per tile
  return axis == 1 ? R * C / kBlock : (R + kBlock - 1) / kBlock * C;
}

}  // namespace

// x [R, C] contiguous (axis 1: C % 16 == 0 and x 16-byte aligned; axis 0: any C); amax: a zeroed uint32 that
// receives the bits of the fp32 amax.
void launch_nvfp4_amax(const void* x, int dtype, const float* signs, unsigned* amax, int64_t R, int64_t C, int axis,
                       cudaStream_t stream) {
  const int64_t work = work_items(axis == 2 ? 1 : axis, R, C);  // (the tiles' amax is the tensor's)
  if (work == 0) return;
  const unsigned blocks = (unsigned)((work + 255) / 256);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (axis != 0)
      amax_kernel<T, 1><<<blocks, 256, 0, stream>>>((const T*)x, signs, amax, R, C, work);
    else
      amax_kernel<T, 0><<<blocks, 256, 0, stream>>>((const T*)x, signs, amax, R, C, work);
  });
}

// out: bf16 [R, C] (axes 1, 2) or [Rp, C] (axis 0), 16-byte aligned; g_dec_out: one fp32 (always written). Axis 2
// (16 x 16 tiles) takes R and C multiples of 16 and neither signs nor stochastic rounding.
void launch_nvfp4_qdq(const void* x, int dtype, const float* signs, const unsigned* amax, void* out, float* g_dec_out,
                      int64_t R, int64_t C, int axis, bool four_over_six, int rule, bool stochastic, int64_t seed,
                      const int64_t* seed_ptr, cudaStream_t stream) {
  const int64_t Rp = axis == 1 ? R : (R + kBlock - 1) / kBlock * kBlock;
  const int64_t work = work_items(axis, R, C);
  const unsigned blocks = work > 0 ? (unsigned)((work + 255) / 256) : 1u;  // one block at least: g_dec is written
  const uint32_t mix = nvfp4::seed_mix_of(seed);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto axis_c, auto fos_c) {
      qdq_kernel<T, decltype(axis_c)::value, decltype(fos_c)::value><<<blocks, 256, 0, stream>>>(
          (const T*)x, signs, amax, (__nv_bfloat16*)out, g_dec_out, R, C, Rp, work, rule, stochastic, mix, seed_ptr);
    };
    using A0 = std::integral_constant<int, 0>;
    using A1 = std::integral_constant<int, 1>;
    if (axis == 2) {
      if (four_over_six)
        qdq_2d_kernel<T, true><<<blocks, 256, 0, stream>>>((const T*)x, amax, (__nv_bfloat16*)out, g_dec_out, C,
                                                          work / kBlock, rule);
      else
        qdq_2d_kernel<T, false><<<blocks, 256, 0, stream>>>((const T*)x, amax, (__nv_bfloat16*)out, g_dec_out, C,
                                                           work / kBlock, rule);
    } else if (axis == 1) {
      if (four_over_six) go(A1{}, std::true_type{}); else go(A1{}, std::false_type{});
    } else {
      if (four_over_six) go(A0{}, std::true_type{}); else go(A0{}, std::false_type{});
    }
  });
}

// acc [M, N] fp32 contiguous (16-byte aligned); out [M, N] of out_dtype (0 fp32: acc itself, 1 bf16, 2 fp16); bias [N]
// of bias_dtype (same codes) or null.
void launch_nvfp4_scale_bias_cast(const float* acc, const float* ga, const float* gb, const void* bias, int bias_dtype,
                                  void* out, int out_dtype, int64_t M, int64_t N, int sms, cudaStream_t stream) {
  const int64_t n = M * N;
  if (n == 0) return;
  int64_t want = (n / 4 + 255) / 256;
  const unsigned blocks = (unsigned)(want < (int64_t)sms * 16 ? (want > 0 ? want : 1) : (int64_t)sms * 16);
  dispatch_float(out_dtype, [&](auto otag) {
    using O = decltype(otag);
    dispatch_float(bias_dtype, [&](auto btag) {
      using B = decltype(btag);
      scale_bias_cast_kernel<O, B><<<blocks, 256, 0, stream>>>(acc, ga, gb, (const B*)bias, (O*)out, n, N);
    });
  });
}

}  // namespace surogate
