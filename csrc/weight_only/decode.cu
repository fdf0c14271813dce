// Dense decode of a frozen quantized weight W [n, k] into fp32 / bf16 / fp16: the "decode + cuBLAS" route of the
// weight-only linears (surogate::ext_dequantize, and inside surogate::ext_decoded_linear). The element math is
// decode_math.cuh's (the formats' reference decode, host-checked), then one rounding to the output dtype.
// Every element is independent, so the kernels are flat streaming passes:
//   - into bf16 / fp16 (the route's case: decode_units_kernel): a lane's unit is 8 codes (one 32-bit word of 4-bit
//     codes, or 8 FP8 bytes of one row) and one 16-byte store, so each warp instruction reads 128 / 256 and writes
//     512 contiguous bytes, with 8 units in flight per thread. E2M1 goes through the few-token kernel's byte permutes
//     (exact: the bf16 bits of the e2m1 value) and E4M3 through the hardware's conversion to fp16 (exact), then the
//     reference's fp32 products and one rounding.
//   - everything else (fp32 output, misaligned codes, FP8 rows not a multiple of 8, block sizes that are not a power
//     of two >= 8: decode_kernel): one thread per 16 bytes of w (32 elements of a 4-bit format, 16 of FP8); a chunk
//     that would straddle a row or a scale block in a way its vector path does not cover decodes element by element
//     with the same functions.
#include "../common/device.cuh"
#include "../fp4/e2m1_decode.cuh"
#include "decode_math.cuh"

#include <algorithm>
#include <type_traits>

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

// Two fp32 values rounded to nearest even into one 16-bit pair (the low half is `lo`), as from_f32 rounds each.
template <typename T> __device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}
template <> __device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half2 p = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ uint32_t ld_stream_u32(const uint32_t* p) {
  // read once per call: keep it out of L1
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream_u64(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// FP8's block scale of a unit (8 codes of one row): the unit's row and column from its index by a multiply-high
// (cutlass' FastDivmod: exact for indices < 2^31) instead of a 64-bit division per unit.
struct Fp8Units {
  uint32_t per_row;         // k / 8 units a row
  uint32_t mul, shr;        // u / per_row = umulhi(u, mul) >> shr (per_row > 1)
  uint32_t block_shift;     // log2 of the square scale block's edge
  uint32_t blocks_per_row;  // ceil(k / block)

  __host__ static Fp8Units of(int64_t k, int block) {
    Fp8Units f{(uint32_t)(k / 8), 0u, 0u, (uint32_t)__builtin_ctz((unsigned)block),
               (uint32_t)((k + block - 1) / block)};
    if (f.per_row > 1) {
      uint32_t log2 = 31 - __builtin_clz(f.per_row);
      log2 += (f.per_row & (f.per_row - 1)) != 0;  // ceil(log2(per_row))
      const uint32_t p = 31 + log2;
      f.mul = (uint32_t)(((1ull << p) + f.per_row - 1) / f.per_row);
      f.shr = p - 32;
    }
    return f;
  }

  // index into scale_inv [ceil(n / block), ceil(k / block)] of unit u
  __device__ __forceinline__ int64_t scale_index(uint32_t u) const {
    const uint32_t row = per_row == 1 ? u : __umulhi(u, mul) >> shr;
    const uint32_t col = (u - row * per_row) * 8;
    return (int64_t)(row >> block_shift) * blocks_per_row + (col >> block_shift);
  }
};

// Units of codes a thread loads before it decodes the first. Measured on the H200 (benchmarks/bench_decode.py, 4-bit
// words): 8 units, all loaded before any is decoded, against 4-unit groups with the next group's loads issued before
// the current one is decoded: equal on Llama-3.1-8B's MLP weights (43-44 us), 8-10% faster on 4096x1024 and 2048x2048
// (4.4-4.7 against 5.0-5.1 us). The 16-byte-chunk kernel kept one 16-byte load in flight per thread and reached ~2
// TB/s.
constexpr int kUnitsInFlight = 8;

// A unit of 8 codes and its block scale decoded into 8 elements of T, stored as one 16-byte piece at `dst`.
//   NVFP4: e2m1 x the E4M3 scale in bf16, exact (<= 5 significant bits, well inside bf16's normal range, so equal to
//          the reference's fp32 product), then x global in fp32 and one rounding, the reference's order.
//   MXFP4: e2m1 x 2^(e - 127) in fp32 (the product may be an fp32 subnormal), then one rounding.
//   NF4:   level x absmax in fp32, then one rounding; bitsandbytes packs the even element in the high nibble. The 16
//          levels are read through L1 (__ldg), not staged in shared memory.
//   FP8:   e4m3 (by the hardware's conversion to fp16, exact) x scale_inv in fp32, then one rounding.
// `scale` holds the E4M3 byte (NVFP4) or the fp32 bits of the E8M0 value (MXFP4), the absmax (NF4) or the block's
// scale_inv (FP8).
template <int FMT> using UnitCodes = std::conditional_t<FMT == 3, uint2, uint32_t>;  // 8 codes

template <int FMT, typename T>
__device__ __forceinline__ void decode_unit(UnitCodes<FMT> codes, uint32_t scale, float global,
                                            const float* __restrict__ lv, const wdec::E2M1Tables& tables, T* dst) {
  uint32_t o[4];
  const float s = __uint_as_float(scale);
  if constexpr (FMT == 3) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // E4M3 -> fp16 -> fp32 by hardware, exact for every finite code (and -0)
      const uint32_t two = ((j < 2 ? codes.x : codes.y) >> (16 * (j & 1))) & 0xFFFFu;
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
      const float2 f = __half22float2(__half2(h));
      o[j] = pack_pair<T>(decode::mul(f.x, s), decode::mul(f.y, s));
    }
  } else if constexpr (FMT == 2) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (codes >> (8 * b)) & 0xFFu;
      o[b] = pack_pair<T>(decode::nf4_element(__ldg(lv + (byte >> 4)), s),
                          decode::nf4_element(__ldg(lv + (byte & 0xFu)), s));
    }
  } else {
    uint32_t e2m1[4];  // bf16 bits of elements (2j, 2j + 1): exactly e2m1_value of each code, -0 included
    wdec::e2m1x8_to_bf16(codes, tables, e2m1);
    uint32_t s2 = 0;
    if constexpr (FMT == 0) s2 = wdec::prmt(wdec::e4m3x2_to_bf16x2(scale), 0u, 0x1010u);  // (s, s) in bf16, exact
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (FMT == 0) {
        const uint32_t p = wdec::bf16x2_mul(e2m1[j], s2);  // exact
        o[j] = pack_pair<T>(decode::mul(__uint_as_float(p << 16), global),
                            decode::mul(__uint_as_float(p & 0xFFFF0000u), global));
      } else {
        o[j] = pack_pair<T>(decode::mul(__uint_as_float(e2m1[j] << 16), s),
                            decode::mul(__uint_as_float(e2m1[j] & 0xFFFF0000u), s));
      }
    }
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
}

// kUnitsInFlight units of one thread, kThreads apart from `first`, and their scales; with CHECKED only those < end.
template <int FMT>
struct UnitGroup {
  UnitCodes<FMT> codes[kUnitsInFlight];
  uint32_t scale[kUnitsInFlight];

  template <bool CHECKED>
  __device__ __forceinline__ void load(const Weight& a, int64_t first, int64_t end, int nf4_shift,
                                       const Fp8Units& fp8) {
#pragma unroll
    for (int i = 0; i < kUnitsInFlight; ++i) {
      const int64_t u = first + i * kThreads;
      if (CHECKED && u >= end) break;
      if constexpr (FMT == 3) codes[i] = ld_stream_u64(reinterpret_cast<const uint2*>(a.w) + u);
      else codes[i] = ld_stream_u32(reinterpret_cast<const uint32_t*>(a.w) + u);
      if constexpr (FMT == 3) scale[i] = __float_as_uint(a.scales_f32[fp8.scale_index((uint32_t)u)]);
      else if constexpr (FMT == 0) scale[i] = a.scales_u8[u >> 1];  // 16-element blocks
      else if constexpr (FMT == 1) scale[i] = __float_as_uint(decode::e8m0_value(a.scales_u8[u >> 2]));  // 32
      else scale[i] = __float_as_uint(decode::nf4_absmax(a, (u << 3) >> nf4_shift));
    }
  }

  template <bool CHECKED, typename T>
  __device__ __forceinline__ void decode(int64_t first, int64_t end, float global, const float* __restrict__ lv,
                                         const wdec::E2M1Tables& tables, T* __restrict__ out) const {
#pragma unroll
    for (int i = 0; i < kUnitsInFlight; ++i) {
      const int64_t u = first + i * kThreads;
      if (CHECKED && u >= end) break;
      decode_unit<FMT, T>(codes[i], scale[i], global, lv, tables, out + 8 * u);
    }
  }
};

// NVFP4, MXFP4, NF4 or FP8 codes into bf16 / fp16, 8 elements per unit (a 32-bit word of 4-bit codes, 8 FP8 bytes);
// each warp instruction reads 128 (256) and writes 512 contiguous bytes. Each CTA takes `per_cta` consecutive units
// (a multiple of kThreads; the grid is at most one wave, so no CTA waits for a second) in groups of kUnitsInFlight
// units per thread. Needs whole units (NVFP4's and MXFP4's K, a multiple of 16 or 32, makes them, as do NF4's whole
// blocks of a power of two >= 8 elements; FP8 needs K % 8 == 0 and a power-of-two block), codes aligned to a unit and
// out to 16 bytes: a unit then never straddles a scale block.
// `zero` is 0 at run time; it keeps the E2M1 tables in per-thread registers (e2m1_decode.cuh: E2M1Tables).
template <int FMT, typename T>
__global__ void __launch_bounds__(kThreads) decode_units_kernel(Weight a, int64_t units, int64_t per_cta,
                                                                int nf4_shift, Fp8Units fp8, uint32_t zero,
                                                                T* __restrict__ out) {
  const float global = FMT == 0 ? *a.gscale : 1.f;
  const float* __restrict__ lv = a.levels;
  const wdec::E2M1Tables tables(zero);
  const int64_t begin = (int64_t)blockIdx.x * per_cta, end = begin + per_cta < units ? begin + per_cta : units;
  constexpr int kGroup = kUnitsInFlight * kThreads;
  UnitGroup<FMT> g;
  int64_t first = begin + threadIdx.x;
  for (; first - threadIdx.x + kGroup <= end; first += kGroup) {
    g.template load<false>(a, first, end, nf4_shift, fp8);
    g.template decode<false>(first, end, global, lv, tables, out);
  }
  if (first < end) {
    g.template load<true>(a, first, end, nf4_shift, fp8);
    g.template decode<true>(first, end, global, lv, tables, out);
  }
}

template <int FMT>
void launch_fmt(const Weight& a, int64_t bytes, void* out, int out_dtype, bool vector_ok, int sms,
                cudaStream_t stream) {
  // the unit kernel, into a 16-bit dtype: 4-bit codes in whole 4-byte words (NF4 blocks a power of two of >= 8
  // elements); FP8 rows of whole 8-code units (K % 8 == 0), square blocks a power of two of >= 8, < 2^31 units (the
  // fast division's range); codes and out aligned to their loads and stores
  const bool pow2_block = a.block >= 8 && (a.block & (a.block - 1)) == 0;
  const int unit_bytes = FMT == 3 ? 8 : 4;
  const bool units_ok = FMT == 3 ? a.k % 8 == 0 && bytes / 8 < (1ll << 31) : bytes % 4 == 0;
  if (out_dtype != 0 && units_ok && reinterpret_cast<uintptr_t>(a.w) % unit_bytes == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0 && (FMT < 2 || pow2_block)) {
    const int64_t units = bytes / unit_bytes, rows = (units + kThreads - 1) / kThreads;
    const int nf4_shift = FMT == 2 ? __builtin_ctz((unsigned)a.block) : 0;
    const Fp8Units fp8 = FMT == 3 ? Fp8Units::of(a.k, a.block) : Fp8Units{};
    const uint32_t zero = (uint32_t)(bytes >> 62);  // bytes < 2^62
    dispatch_float(out_dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (!std::is_same<T, float>::value) {
        // one wave of CTAs at most, each a balanced range of whole kThreads-unit rows (the occupancy is queried once
        // per process: a wrong count on a second GPU architecture would only resize the grid)
        static const int ctas_per_sm = [] {
          int n = 0;
          return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_units_kernel<FMT, T>, kThreads, 0) ==
                             cudaSuccess && n > 0 ? n : 1;
        }();
        const int64_t ctas = std::min<int64_t>(rows, (int64_t)sms * ctas_per_sm);
        const int64_t per_cta = (rows + ctas - 1) / ctas * kThreads;
        const unsigned grid = (unsigned)((units + per_cta - 1) / per_cta);
        decode_units_kernel<FMT, T>
            <<<grid, kThreads, 0, stream>>>(a, units, per_cta, nf4_shift, fp8, zero, reinterpret_cast<T*>(out));
      }
    });
    return;
  }
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
// (decoded_linear.cpp: dequantize_weight); sms is the device's SM count (the unit kernel runs at most one wave).
void launch_decode_weight(int fmt, const uint8_t* w, const uint8_t* scales_u8, const float* scales_f32,
                          const float* gscale, const float* levels, const float* nested_absmax,
                          const float* nested_code, const float* nested_offset, void* out, int out_dtype, int64_t n,
                          int64_t k, int block, int sms, cudaStream_t stream) {
  const Weight a{w, scales_u8, scales_f32, gscale, levels, n, k, block, nested_absmax, nested_code, nested_offset};
  const int64_t bytes = fmt == 3 ? n * k : n * k / 2;
  if (bytes == 0) return;
  // the vector path loads 16 bytes of w and stores 16-byte pieces of out: both bases aligned (out is a fresh
  // allocation; w may be a view into a larger buffer)
  const bool vector_ok = reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  switch (fmt) {
    case 0: launch_fmt<0>(a, bytes, out, out_dtype, vector_ok, sms, stream); break;
    case 1: launch_fmt<1>(a, bytes, out, out_dtype, vector_ok, sms, stream); break;
    case 2: launch_fmt<2>(a, bytes, out, out_dtype, vector_ok, sms, stream); break;
    default: launch_fmt<3>(a, bytes, out, out_dtype, vector_ok, sms, stream); break;
  }
}

}  // namespace surogate
