// NVFP4 block math of surogate_hf.formats (nvfp4, e2m1, hadamard, rng), for one block of 16 fp32 values, in the
// reference's order of fp32 operations: every product, sum and quotient is rounded on its own (the _rn intrinsics
// are never contracted into an FMA, which would move the last bit and flip 4/6 choices). The functions are
// __host__ __device__ so that a host build checks them bit for bit against the Python reference with no GPU
// (tests/kernels/test_csrc_host.py).
#pragma once
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define SG_HD __host__ __device__ __forceinline__
#else
#define SG_HD inline
#endif

namespace surogate {
namespace nvfp4 {

constexpr int kBlock = 16;
constexpr float kE4m3Max = 448.f;
constexpr float kGlobalRange = 2688.f;  // formats.nvfp4.GLOBAL_RANGE = 448 * 6
constexpr float kFltMax = 3.4028234663852886e38f;
constexpr uint32_t kGolden = 0x9E3779B9u;
enum Rule : int { kMse = 0, kMae = 1, kAbsMax = 2 };

SG_HD float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SG_HD float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SG_HD float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SG_HD float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
SG_HD uint32_t bits_of(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t b;
  memcpy(&b, &v, 4);
  return b;
#endif
}
SG_HD float float_of(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float v;
  memcpy(&v, &b, 4);
  return v;
#endif
}
// torch.clamp(max=hi): NaN stays NaN (the comparison is false)
SG_HD float min_keep_nan(float v, float hi) { return v > hi ? hi : v; }
// |v| as ordered bits: an unsigned max over them is amax with NaN (above inf) propagating
SG_HD uint32_t abs_bits_of(float v) { return bits_of(v) & 0x7fffffffu; }
SG_HD float abs_of(float v) { return float_of(abs_bits_of(v)); }

// E4M3 (fn) byte -> fp32, exact
SG_HD float e4m3_value(uint8_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7, sign = (uint32_t)(b >> 7) << 31;
  if (e == 15 && m == 7) return float_of(sign | 0x7fc00000u);
  if (e == 0) return float_of(sign | bits_of(mul((float)m, 0.001953125f)));  // m * 2^-9, exact
  return float_of(sign | ((e + 120) << 23) | (m << 20));
}
// non-negative fp32 (or NaN), already clamped to <= 448 -> E4M3 byte, saturating round-to-nearest-even
SG_HD uint8_t e4m3_rne(float v) { return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// formats.e2m1.e2m1_encode: nearest with the reference's tie thresholds, saturating; NaN -> 0 (sign kept)
SG_HD uint32_t e2m1_encode(float x) {
  const float a = abs_of(x);
  const uint32_t code = (uint32_t)(a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return code | ((bits_of(x) >> 31) << 3);
}
// E2M1 code (low 4 bits) -> fp32, by building the fp32 bits (no table: a local array would live in memory)
SG_HD float e2m1_decode(uint32_t c) {
  const uint32_t m = c & 7;
  const uint32_t mag = m >= 2 ? ((((m >> 1) + 126) << 23) | ((m & 1) << 22)) : (m == 1 ? (126u << 23) : 0u);
  return float_of(mag | ((c & 8) << 28));
}
// formats.rng.uniform_from_counter: murmur3's finalizer of (offset + seed * golden) mod 2^32, 24 bits
SG_HD float uniform(int64_t offset, uint32_t seed_mix) {
  uint32_t h = (uint32_t)((uint64_t)offset + seed_mix);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return (float)(h >> 8) * 5.9604644775390625e-08f;
}
// formats.e2m1.e2m1_encode_stochastic: up with probability (|x| - lo) / (hi - lo), by an exact multiply
SG_HD uint32_t e2m1_encode_sr(float x, float u) {
  const float a = min_keep_nan(abs_of(x), 6.f);
  const uint32_t lo = (uint32_t)(a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) + (a >= 4.0f) +
                      (a >= 6.0f);
  const float level = lo == 7 ? 6.f : e2m1_decode(lo);
  const float inv_gap = lo < 4 ? 2.f : (lo < 6 ? 1.f : (lo == 6 ? 0.5f : 0.f));
  const float p_up = mul(sub(a, level), inv_gap);
  return (lo + (uint32_t)(u < p_up)) | ((bits_of(x) >> 31) << 3);
}
// seed -> the mixing constant of formats.rng.hash32: (seed * golden) mod 2^32 (two's complement for a negative seed)
SG_HD uint32_t seed_mix_of(int64_t seed) { return (uint32_t)((uint64_t)seed * (uint64_t)kGolden); }

// one butterfly stage of stride H: (a, b) -> (a + b, a - b)
template <int H>
SG_HD void butterfly(float* v) {
#pragma unroll
  for (int g = 0; g < kBlock; g += 2 * H) {
#pragma unroll
    for (int k = 0; k < H; ++k) {
      const float a = v[g + k], b = v[g + H + k];
      v[g + k] = add(a, b);
      v[g + H + k] = sub(a, b);
    }
  }
}

// formats.hadamard.rht of one 16-chunk: x * signs, butterflies of stride 8, 4, 2, 1, times 1/4
SG_HD void rht16(float* v, const float* signs) {
#pragma unroll
  for (int i = 0; i < kBlock; ++i) v[i] = mul(v[i], signs[i]);
  butterfly<8>(v);
  butterfly<4>(v);
  butterfly<2>(v);
  butterfly<1>(v);
#pragma unroll
  for (int i = 0; i < kBlock; ++i) v[i] = mul(v[i], 0.25f);
}

struct Globals {
  float enc, dec;
};
// formats.nvfp4.nvfp4_global_scales; `S / amax` is evaluated by torch as reciprocal-then-multiply
SG_HD Globals globals_of(float amax) {
  if (amax == 0.f) return {1.f, 1.f};
  return {mul(div(1.f, amax), kGlobalRange), div(amax, kGlobalRange)};
}

struct Scale {
  float s, enc;  // the decoded E4M3 block scale, the element encode scale
};
// candidate(m) of formats.nvfp4.quantize_nvfp4, m = 6 or (four) 4
SG_HD Scale candidate(float blk_amax, Globals g, bool four) {
  const float t = four ? mul(blk_amax, 0.25f) : div(blk_amax, 6.f);
  const float s = e4m3_value(e4m3_rne(min_keep_nan(mul(t, g.enc), kE4m3Max)));
  return {s, min_keep_nan(div(1.f, mul(s, g.dec)), kFltMax)};
}

// formats.nvfp4._block_error of candidate c over the block
SG_HD float block_error(const float* x, Scale c, Globals g, int rule) {
  float e[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const float deq = mul(mul(e2m1_decode(e2m1_encode(mul(x[i], c.enc))), c.s), g.dec);
    const float d = sub(deq, x[i]);
    e[i] = rule == kMse ? mul(d, d) : abs_of(d);
  }
  if (rule == kAbsMax) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) m = m > bits_of(e[i]) ? m : bits_of(e[i]);  // NaN (above inf) propagates
    return float_of(m);
  }
  // formats.nvfp4._tree_sum: halves added pairwise
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = add(e[i], e[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = add(e[i], e[i + 4]);
  e[0] = add(e[0], e[2]);
  e[1] = add(e[1], e[3]);
  return add(e[0], e[1]);
}

// Quantize one 1D block of 16 fp32 values and write the values the NVFP4 GEMM operand holds without its global
// scale, e2m1 * s_blk (exact in bf16), into out. With `stochastic`, element i draws uniform(offset0 + i, seed_mix)
// (its row-major position in the quantized tensor). Four-Over-Six chooses on the round-to-nearest candidates.
template <bool FOUR_SIX>
SG_HD void quantize_block(const float* x, Globals g, int rule, bool stochastic, uint32_t seed_mix, int64_t offset0,
                          float* out) {
  uint32_t amax_bits = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax_bits = amax_bits > abs_bits_of(x[i]) ? amax_bits : abs_bits_of(x[i]);
  const float blk_amax = float_of(amax_bits);
  Scale c = candidate(blk_amax, g, false);
  if (FOUR_SIX) {
    const Scale c4 = candidate(blk_amax, g, true);
    if (block_error(x, c4, g, rule) < block_error(x, c, g, rule)) c = c4;
  }
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const float scaled = mul(x[i], c.enc);
    const uint32_t code = stochastic ? e2m1_encode_sr(scaled, uniform(offset0 + i, seed_mix)) : e2m1_encode(scaled);
    out[i] = mul(e2m1_decode(code), c.s);
  }
}

}  // namespace nvfp4
}  // namespace surogate
