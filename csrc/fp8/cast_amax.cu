// Per-tensor FP8 cast with the amax fused: q = sat_rne(x * scale), amax = max|x| (NaN propagates).
// Bit-exact to surogate_hf.formats.fp8.quantize_fp8_tensorwise: one fp32 multiply, a clamp that
// keeps NaN, and the hardware's saturating round-to-nearest-even conversion.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../common/device.cuh"

namespace surogate {

template <bool E4M3>
__device__ __forceinline__ uint16_t cvt2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <bool E4M3>
__device__ __forceinline__ uint8_t cvt1(float a) {
  return __nv_cvt_float_to_fp8(a, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2);
}

// VEC elements (16 bytes of input) per thread per step; grid-stride; tail done element-wise.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) cast_amax_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                                        uint8_t* __restrict__ q, unsigned* __restrict__ amax,
                                                        int64_t n, float fmax) {
  constexpr int VEC = 16 / sizeof(T);
  const float s = *scale;
  unsigned local = 0;
  const int64_t nvec = n / VEC;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    uint4 raw = reinterpret_cast<const uint4*>(x)[i];
    const T* v = reinterpret_cast<const T*>(&raw);
    uint8_t outb[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      float a = to_f32<T>(v[j]), b = to_f32<T>(v[j + 1]);
      local = max(local, max(abs_bits(a), abs_bits(b)));
      uint16_t p = cvt2<E4M3>(clamp_keep_nan(a * s, fmax), clamp_keep_nan(b * s, fmax));
      outb[j] = p & 0xff;
      outb[j + 1] = p >> 8;
    }
    if constexpr (VEC == 8) {
      reinterpret_cast<uint2*>(q)[i] = *reinterpret_cast<uint2*>(outb);
    } else {
      reinterpret_cast<uint32_t*>(q)[i] = *reinterpret_cast<uint32_t*>(outb);
    }
  }
  for (int64_t i = nvec * VEC + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float a = to_f32<T>(x[i]);
    local = max(local, abs_bits(a));
    q[i] = cvt1<E4M3>(clamp_keep_nan(a * s, fmax));
  }
  block_amax_into(local, amax);
}

// The same cast, also writing the contiguous transpose qt [C, R] of q [R, C] from the same pass (the operand
// the backward GEMM reads K-major): a 64 x 128 tile of x per block, its FP8 bytes staged in shared memory and
// written out a second time column-wise. Any R and C: vector loads and stores where a whole 8-element (or
// 4-byte) group is in bounds and aligned, element-wise otherwise.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) cast_transpose_amax_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                                                  uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                                                                  unsigned* __restrict__ amax, int64_t rows,
                                                                  int64_t cols, float fmax) {
  constexpr int TR = 64, TC = 128, PAD = 4;
  __shared__ __align__(16) uint8_t tile[TR][TC + PAD];
  const float s = *scale;
  const int64_t r0 = (int64_t)blockIdx.x * TR, c0 = (int64_t)blockIdx.y * TC;
  const int lane16 = threadIdx.x & 15, sub = threadIdx.x >> 4;  // 16 threads x 8 elements per 128-wide row
  const int cc = lane16 * 8;
  const bool vec_cols = (cols % 8) == 0;  // 16-byte aligned groups of 8 elements (x itself is 16-byte aligned)
  unsigned local = 0;
  for (int i = sub; i < TR; i += 16) {
    const int64_t r = r0 + i, c = c0 + cc;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = 0.f;
    const bool row_in = r < rows;
    if (row_in && vec_cols && c + 8 <= cols) {
      constexpr int PER16 = 16 / sizeof(T);
#pragma unroll
      for (int h = 0; h < 8 / PER16; ++h) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + r * cols + c + h * PER16);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < PER16; ++j) v[h * PER16 + j] = to_f32<T>(e[j]);
      }
    } else if (row_in) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (c + j < cols) v[j] = to_f32<T>(x[r * cols + c + j]);
    }
    alignas(8) uint8_t b[8];
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      local = max(local, max(abs_bits(v[j]), abs_bits(v[j + 1])));
      const uint16_t p = cvt2<E4M3>(clamp_keep_nan(v[j] * s, fmax), clamp_keep_nan(v[j + 1] * s, fmax));
      b[j] = p & 0xff;
      b[j + 1] = p >> 8;
    }
    // two 4-byte shared stores (rows are 132 bytes apart: 4-byte aligned)
    reinterpret_cast<uint32_t*>(&tile[i][cc])[0] = *reinterpret_cast<const uint32_t*>(b);
    reinterpret_cast<uint32_t*>(&tile[i][cc])[1] = *reinterpret_cast<const uint32_t*>(b + 4);
    if (row_in && vec_cols && c + 8 <= cols) {
      *reinterpret_cast<uint2*>(q + r * cols + c) = *reinterpret_cast<const uint2*>(b);
    } else if (row_in) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (c + j < cols) q[r * cols + c + j] = b[j];
    }
  }
  __syncthreads();
  // qt rows are x's columns: 128 rows of 64 bytes per tile, 4 bytes (4 consecutive x rows) per thread and step
  const bool vec_rows = (rows % 4) == 0;
  for (int w = threadIdx.x; w < TC * (TR / 4); w += blockDim.x) {
    const int ct = w / (TR / 4), rt = (w % (TR / 4)) * 4;
    const int64_t c = c0 + ct, r = r0 + rt;
    if (c >= cols) continue;
    const uint8_t b0 = tile[rt][ct], b1 = tile[rt + 1][ct], b2 = tile[rt + 2][ct], b3 = tile[rt + 3][ct];
    if (vec_rows && r + 4 <= rows) {
      *reinterpret_cast<uint32_t*>(qt + c * rows + r) =
          (uint32_t)b0 | ((uint32_t)b1 << 8) | ((uint32_t)b2 << 16) | ((uint32_t)b3 << 24);
    } else {
      const uint8_t bb[4] = {b0, b1, b2, b3};
      for (int j = 0; j < 4; ++j)
        if (r + j < rows) qt[c * rows + r + j] = bb[j];
    }
  }
  block_amax_into(local, amax);  // out-of-bounds lanes hold 0
}

// Calls f(T{}, E4M3{}) with the input element type of the dtype code (0 fp32, 1 bf16, 2 fp16) and the FP8 format
// as a std::integral_constant<bool, e4m3>: one switch for every launcher.
template <typename F>
void dispatch_cast(int dtype, bool e4m3, F&& f) {
  dispatch_float(dtype, [&](auto tag) {
    if (e4m3) f(tag, std::true_type{}); else f(tag, std::false_type{});
  });
}

void launch_cast_amax(const void* x, int dtype, const float* scale, void* q, bool e4m3, unsigned* amax, int64_t n,
                      int sms, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  int64_t want = (n + threads * 8 - 1) / (threads * 8);
  int blocks = (int)(want < (int64_t)sms * 8 ? want : (int64_t)sms * 8);
  if (blocks < 1) blocks = 1;
  const float fmax = e4m3 ? 448.0f : 57344.0f;
  dispatch_cast(dtype, e4m3, [&](auto tag, auto fmt) {
    using T = decltype(tag);
    cast_amax_kernel<T, decltype(fmt)::value><<<blocks, threads, 0, stream>>>((const T*)x, scale, (uint8_t*)q, amax,
                                                                             n, fmax);
  });
}

// x [rows, cols] contiguous and 16-byte aligned; q [rows, cols] and qt [cols, rows] contiguous, 4-byte aligned.
void launch_cast_transpose_amax(const void* x, int dtype, const float* scale, void* q, void* qt, bool e4m3,
                                unsigned* amax, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid((unsigned)((rows + 63) / 64), (unsigned)((cols + 127) / 128));
  const float fmax = e4m3 ? 448.0f : 57344.0f;
  dispatch_cast(dtype, e4m3, [&](auto tag, auto fmt) {
    using T = decltype(tag);
    cast_transpose_amax_kernel<T, decltype(fmt)::value><<<grid, 256, 0, stream>>>(
        (const T*)x, scale, (uint8_t*)q, (uint8_t*)qt, amax, rows, cols, fmax);
  });
}

}  // namespace surogate
