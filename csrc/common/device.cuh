// Device helpers shared by the csrc kernels: element loads as fp32, |x| as ordered bits, a NaN-keeping clamp and
// the block-wide amax reduction.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// Folds the block's max of each thread's `local` (|x| as float bits) into *amax with one atomic; blocks of at most
// 256 threads, every thread calling. NaN's bits (> 0x7f800000) order above inf, so an unsigned max propagates NaN.
__device__ __forceinline__ void block_amax_into(unsigned local, unsigned* amax) {
  __shared__ unsigned warp_max[8];
  local = __reduce_max_sync(0xffffffffu, local);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = local;
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned v = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
    v = __reduce_max_sync(0xffffffffu, v);
    if (threadIdx.x == 0) atomicMax(amax, v);
  }
}

// Calls f(T{}) with the element type of the dtype code (0 fp32, 1 bf16, 2 fp16).
template <typename F>
void dispatch_float(int dtype, F&& f) {
  if (dtype == 0) f(float{});
  else if (dtype == 1) f(__nv_bfloat16{});
  else f(__half{});
}

}  // namespace surogate
