// Dense decode of a frozen quantized weight W [n, k] into fp32 / bf16 / fp16: the "decode + cuBLAS" route of the
// weight-only linears (surogate::ext_dequantize, and inside surogate::ext_decoded_linear). Numerics are the formats'
// reference dequantization (surogate_hf.formats), each fp32 operation rounded on its own, then one rounding to the
// output dtype:
//   fmt 0 NVFP4: (e2m1 * float(e4m3 block scale)) * global          w [n, k/2], scales [n, k/16], even element low nibble
//   fmt 1 MXFP4: e2m1 * 2^(e8m0 - 127), 255 -> NaN                   w [n, k/2], scales [n, k/32]
//   fmt 2 NF4:   levels[code] * absmax[flat index / block]           bitsandbytes packing: even element in the HIGH nibble
//   fmt 3 FP8:   float(e4m3) * scale_inv[row / 128][col / 128]      w [n, k], scale_inv [ceil(n/128), ceil(k/128)]
// Every element is independent, so the kernel is a flat streaming pass: one thread per 16 bytes of w (32 elements of
// a 4-bit format, 16 of FP8), one 16-byte load and 16-byte stores; a chunk that would straddle a row or a scale block
// in a way the vector path does not cover (a ragged tail, an FP8 row length that is not a multiple of 16, NF4 blocks
// that are not multiples of 32) decodes element by element with the same math.
#include <cuda_fp8.h>

#include "../common/device.cuh"

namespace surogate {
namespace {

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// E2M1 code (sign in bit 3) -> fp32, built from bits: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.
__device__ __forceinline__ float e2m1_value(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((c & 8u) << 28));
}

__device__ __forceinline__ float e4m3_value(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

// E8M0 -> 2^(e - 127) (e = 0: the fp32 subnormal 2^-127), 255 -> NaN
__device__ __forceinline__ float e8m0_value(uint8_t e) {
  if (e == 255) return __uint_as_float(0x7FC00000u);
  return __uint_as_float(e ? (uint32_t)e << 23 : 0x00400000u);
}

constexpr int kThreads = 256;
constexpr int kChunk = 16;  // bytes of w per thread

struct DecodeArgs {
  const uint8_t* w;
  const uint8_t* scales_u8;   // NVFP4 E4M3 / MXFP4 E8M0 scales
  const float* scales_f32;    // NF4 absmax / FP8 scale_inv
  const float* gscale;        // NVFP4 decode global (read on the device)
  const float* levels;        // NF4's 16 levels
  int64_t n, k, bytes;        // bytes of w
  int block;                  // NF4 block size (elements); FP8 block edge (128)
};

// the element `e` (flat index) decoded to fp32 from its byte and nibble: the scalar path, also the spec of the vector one
template <int FMT>
__device__ __forceinline__ float decode_one(const DecodeArgs& a, const float* lv, int64_t e) {
  if constexpr (FMT == 3) {
    const int64_t row = e / a.k, col = e - row * a.k;
    const int64_t kb = (a.k + a.block - 1) / a.block;
    return e4m3_value(a.w[e]) * a.scales_f32[(row / a.block) * kb + col / a.block];
  } else {
    const uint8_t byte = a.w[e >> 1];
    if constexpr (FMT == 2) {
      const uint32_t code = (e & 1) ? (byte & 0xFu) : (byte >> 4);
      return lv[code] * a.scales_f32[e / a.block];
    } else {
      const uint32_t code = (e & 1) ? (byte >> 4) : (byte & 0xFu);
      if constexpr (FMT == 0) return (e2m1_value(code) * e4m3_value(a.scales_u8[e >> 4])) * *a.gscale;
      else return e2m1_value(code) * e8m0_value(a.scales_u8[e >> 5]);
    }
  }
}

template <int FMT, typename T>
__global__ void __launch_bounds__(kThreads) decode_kernel(DecodeArgs a, T* __restrict__ out, bool vector_ok) {
  __shared__ float lv[16];
  if constexpr (FMT == 2) {
    if (threadIdx.x < 16) lv[threadIdx.x] = a.levels[threadIdx.x];
    __syncthreads();
  }
  const int64_t chunk = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const int64_t b0 = chunk * kChunk;
  if (b0 >= a.bytes) return;
  constexpr int kPer = FMT == 3 ? kChunk : 2 * kChunk;  // elements per chunk
  const int64_t e0 = FMT == 3 ? b0 : 2 * b0;
  const bool full = b0 + kChunk <= a.bytes;
  // vector path: a full chunk that sits inside one scale block (FP8: one row and one 128-column block)
  bool vec = vector_ok && full;
  if constexpr (FMT == 3) vec = vec && (a.k % kChunk == 0);
  if constexpr (FMT == 2) vec = vec && (a.block % kPer == 0);
  if (!vec) {
    const int64_t total = FMT == 3 ? a.bytes : 2 * a.bytes;
    for (int j = 0; j < kPer && e0 + j < total; ++j) out[e0 + j] = from_f32<T>(decode_one<FMT>(a, lv, e0 + j));
    return;
  }
  const uint4 raw = *reinterpret_cast<const uint4*>(a.w + b0);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&raw);
  __align__(16) T vals[kPer];
  if constexpr (FMT == 3) {
    const int64_t row = e0 / a.k, col = e0 - row * a.k;
    const int64_t kb = (a.k + a.block - 1) / a.block;
    const float s = a.scales_f32[(row / a.block) * kb + col / a.block];
#pragma unroll
    for (int j = 0; j < kPer; ++j) vals[j] = from_f32<T>(e4m3_value(bytes[j]) * s);
  } else if constexpr (FMT == 2) {
    const float s = a.scales_f32[e0 / a.block];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      vals[2 * j] = from_f32<T>(lv[bytes[j] >> 4] * s);
      vals[2 * j + 1] = from_f32<T>(lv[bytes[j] & 0xFu] * s);
    }
  } else if constexpr (FMT == 0) {
    const float g = *a.gscale;
    const float s0 = e4m3_value(a.scales_u8[e0 >> 4]), s1 = e4m3_value(a.scales_u8[(e0 >> 4) + 1]);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float s = j < kChunk / 2 ? s0 : s1;
      vals[2 * j] = from_f32<T>((e2m1_value(bytes[j] & 0xFu) * s) * g);
      vals[2 * j + 1] = from_f32<T>((e2m1_value(bytes[j] >> 4) * s) * g);
    }
  } else {
    const float s = e8m0_value(a.scales_u8[e0 >> 5]);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      vals[2 * j] = from_f32<T>(e2m1_value(bytes[j] & 0xFu) * s);
      vals[2 * j + 1] = from_f32<T>(e2m1_value(bytes[j] >> 4) * s);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(out + e0);
  const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
  for (int i = 0; i < (int)(kPer * sizeof(T) / 16); ++i) dst[i] = src[i];
}

template <int FMT>
void launch_fmt(const DecodeArgs& a, void* out, int out_dtype, bool vector_ok, cudaStream_t stream) {
  const int64_t chunks = (a.bytes + kChunk - 1) / kChunk;
  const unsigned grid = (unsigned)((chunks + kThreads - 1) / kThreads);
  dispatch_float(out_dtype, [&](auto t) {
    using T = decltype(t);
    decode_kernel<FMT, T><<<grid, kThreads, 0, stream>>>(a, reinterpret_cast<T*>(out), vector_ok);
  });
}

}  // namespace

// out (contiguous [n, k], dtype code 0 fp32 / 1 bf16 / 2 fp16) = the decode of w; pointers the format does not use
// may be null. The caller checks shapes and dtypes (bindings: dequantize_weight).
void launch_decode_weight(int fmt, const uint8_t* w, const uint8_t* scales_u8, const float* scales_f32,
                          const float* gscale, const float* levels, void* out, int out_dtype, int64_t n, int64_t k,
                          int block, cudaStream_t stream) {
  DecodeArgs a{w, scales_u8, scales_f32, gscale, levels, n, k, fmt == 3 ? n * k : n * k / 2, block};
  if (a.bytes == 0) return;
  // the vector path loads 16 bytes of w and stores 16-byte pieces of out: both bases aligned (out is a fresh
  // allocation; w may be a view into a larger buffer)
  const bool vector_ok = reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  switch (fmt) {
    case 0: launch_fmt<0>(a, out, out_dtype, vector_ok, stream); break;
    case 1: launch_fmt<1>(a, out, out_dtype, vector_ok, stream); break;
    case 2: launch_fmt<2>(a, out, out_dtype, vector_ok, stream); break;
    default: launch_fmt<3>(a, out, out_dtype, vector_ok, stream); break;
  }
}

}  // namespace surogate
