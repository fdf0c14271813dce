// Dense decode of a frozen quantized weight W [n, k] into fp32 / bf16 / fp16: the "decode + cuBLAS" route of the
// weight-only linears (surogate::ext_dequantize, and inside surogate::ext_decoded_linear). The element math is
// decode_math.cuh's (the formats' reference decode, host-checked), then one rounding to the output dtype.
// Every element is independent, so the kernel is a flat streaming pass: one thread per 16 bytes of w (32 elements of
// a 4-bit format, 16 of FP8), one 16-byte load and 16-byte stores; a chunk that would straddle a row or a scale block
// in a way the vector path does not cover (a ragged tail, an FP8 row length that is not a multiple of 16, NF4 blocks
// that are not multiples of 32) or misaligned codes decode element by element with the same functions.
#include "../common/device.cuh"
#include "decode_math.cuh"

namespace surogate {
namespace {

using decode::Weight;

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

constexpr int kThreads = 256;
constexpr int kChunk = 16;  // bytes of w per thread

template <int FMT, typename T>
__global__ void __launch_bounds__(kThreads) decode_kernel(Weight a, int64_t bytes, T* __restrict__ out, bool vector_ok) {
  __shared__ float lv[16];
  if constexpr (FMT == 2) {
    if (threadIdx.x < 16) lv[threadIdx.x] = a.levels[threadIdx.x];
    __syncthreads();
  }
  const int64_t chunk = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const int64_t b0 = chunk * kChunk;
  if (b0 >= bytes) return;
  constexpr int kPer = FMT == 3 ? kChunk : 2 * kChunk;  // elements per chunk
  const int64_t e0 = FMT == 3 ? b0 : 2 * b0;
  const bool full = b0 + kChunk <= bytes;
  // vector path: a full chunk that sits inside one scale block (FP8: one row and one 128-column block)
  bool vec = vector_ok && full;
  if constexpr (FMT == 3) vec = vec && (a.k % kChunk == 0);
  if constexpr (FMT == 2) vec = vec && (a.block % kPer == 0);
  if (!vec) {
    const int64_t total = FMT == 3 ? bytes : 2 * bytes;
    for (int j = 0; j < kPer && e0 + j < total; ++j) out[e0 + j] = from_f32<T>(decode::element<FMT>(a, lv, e0 + j));
    return;
  }
  const uint4 raw = *reinterpret_cast<const uint4*>(a.w + b0);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(&raw);
  __align__(16) T vals[kPer];
  if constexpr (FMT == 3) {
    const float s = a.scales_f32[decode::fp8_scale_index(a, e0)];
#pragma unroll
    for (int j = 0; j < kPer; ++j) vals[j] = from_f32<T>(decode::fp8_element(codes[j], s));
  } else if constexpr (FMT == 2) {
    const float s = decode::nf4_absmax(a, e0 / a.block);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      vals[2 * j] = from_f32<T>(decode::nf4_element(lv[codes[j] >> 4], s));
      vals[2 * j + 1] = from_f32<T>(decode::nf4_element(lv[codes[j] & 0xFu], s));
    }
  } else if constexpr (FMT == 0) {
    const float g = *a.gscale;
    const float s0 = decode::e4m3_value(a.scales_u8[e0 >> 4]), s1 = decode::e4m3_value(a.scales_u8[(e0 >> 4) + 1]);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float s = j < kChunk / 2 ? s0 : s1;
      vals[2 * j] = from_f32<T>(decode::nvfp4_element(codes[j] & 0xFu, s, g));
      vals[2 * j + 1] = from_f32<T>(decode::nvfp4_element(codes[j] >> 4, s, g));
    }
  } else {
    const float s = decode::e8m0_value(a.scales_u8[e0 >> 5]);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      vals[2 * j] = from_f32<T>(decode::mxfp4_element(codes[j] & 0xFu, s));
      vals[2 * j + 1] = from_f32<T>(decode::mxfp4_element(codes[j] >> 4, s));
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(out + e0);
  const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
  for (int i = 0; i < (int)(kPer * sizeof(T) / 16); ++i) dst[i] = src[i];
}

template <int FMT>
void launch_fmt(const Weight& a, int64_t bytes, void* out, int out_dtype, bool vector_ok, cudaStream_t stream) {
  const int64_t chunks = (bytes + kChunk - 1) / kChunk;
  const unsigned grid = (unsigned)((chunks + kThreads - 1) / kThreads);
  dispatch_float(out_dtype, [&](auto t) {
    using T = decltype(t);
    decode_kernel<FMT, T><<<grid, kThreads, 0, stream>>>(a, bytes, reinterpret_cast<T*>(out), vector_ok);
  });
}

}  // namespace

// out (contiguous [n, k], dtype code 0 fp32 / 1 bf16 / 2 fp16) = the decode of w; pointers the format does not use
// may be null (nested_*: an NF4 absmax that is not double-quantized). The caller checks shapes and dtypes
// (decoded_linear.cpp: dequantize_weight).
void launch_decode_weight(int fmt, const uint8_t* w, const uint8_t* scales_u8, const float* scales_f32,
                          const float* gscale, const float* levels, const float* nested_absmax,
                          const float* nested_code, const float* nested_offset, void* out, int out_dtype, int64_t n,
                          int64_t k, int block, cudaStream_t stream) {
  const Weight a{w, scales_u8, scales_f32, gscale, levels, n, k, block, nested_absmax, nested_code, nested_offset};
  const int64_t bytes = fmt == 3 ? n * k : n * k / 2;
  if (bytes == 0) return;
  // the vector path loads 16 bytes of w and stores 16-byte pieces of out: both bases aligned (out is a fresh
  // allocation; w may be a view into a larger buffer)
  const bool vector_ok = reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  switch (fmt) {
    case 0: launch_fmt<0>(a, bytes, out, out_dtype, vector_ok, stream); break;
    case 1: launch_fmt<1>(a, bytes, out, out_dtype, vector_ok, stream); break;
    case 2: launch_fmt<2>(a, bytes, out, out_dtype, vector_ok, stream); break;
    default: launch_fmt<3>(a, bytes, out, out_dtype, vector_ok, stream); break;
  }
}

}  // namespace surogate
