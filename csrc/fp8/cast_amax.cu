// Per-tensor FP8 cast with the amax fused: q = sat_rne(x * scale), amax = max|x| (NaN propagates).
// Bit-exact to surogate_hf.formats.fp8.quantize_fp8_tensorwise: one fp32 multiply, a clamp that
// keeps NaN, and the hardware's saturating round-to-nearest-even conversion.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace surogate {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

__device__ __forceinline__ float clamp_keep_nan(float v, float m) {
  // comparisons with NaN are false, so NaN passes through (fminf/fmaxf would drop it)
  return v > m ? m : (v < -m ? -m : v);
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

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
  // NaN's bits (> 0x7f800000) order above inf, so an unsigned max propagates NaN
  local = __reduce_max_sync(0xffffffffu, local);
  __shared__ unsigned warp_max[8];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = local;
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned v = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
    v = __reduce_max_sync(0xffffffffu, v);
    if (threadIdx.x == 0) atomicMax(amax, v);
  }
}

// dtype codes: 0 fp32, 1 bf16, 2 fp16
void launch_cast_amax(const void* x, int dtype, const float* scale, void* q, bool e4m3, unsigned* amax, int64_t n,
                      int sms, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  int64_t want = (n + threads * 8 - 1) / (threads * 8);
  int blocks = (int)(want < (int64_t)sms * 8 ? want : (int64_t)sms * 8);
  if (blocks < 1) blocks = 1;
  const float fmax = e4m3 ? 448.0f : 57344.0f;
#define SUROGATE_LAUNCH(T)                                                                                       \
  if (e4m3)                                                                                                      \
    cast_amax_kernel<T, true><<<blocks, threads, 0, stream>>>((const T*)x, scale, (uint8_t*)q, amax, n, fmax);  \
  else                                                                                                           \
    cast_amax_kernel<T, false><<<blocks, threads, 0, stream>>>((const T*)x, scale, (uint8_t*)q, amax, n, fmax);
  if (dtype == 0) {
    SUROGATE_LAUNCH(float)
  } else if (dtype == 1) {
    SUROGATE_LAUNCH(__nv_bfloat16)
  } else {
    SUROGATE_LAUNCH(__half)
  }
#undef SUROGATE_LAUNCH
}

}  // namespace surogate
