// NVFP4 block math of surogate_hf.formats (nvfp4, e2m1, hadamard, rng), for one block of 16 fp32 values, in the
// reference's order of fp32 operations: every product, sum and quotient is rounded on its own (the _rn intrinsics
// are never contracted into an FMA, which would move the last bit and flip 4/6 choices). The functions are
// __host__ __device__ so that a host build checks them bit for bit against the Python reference with no GPU
// (tests/kernels/test_csrc_host.py).
#pragma once
#include <cuda_fp8.h>
#include <stdint.h>
#include <math.h>
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
// E2M1 code (sign in bit 3) -> fp32, exact (formats.e2m1.E2M1_VALUES): 0, .5, 1, 1.5, 2, 3, 4, 6; code 8 is -0
SG_HD float e2m1_value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return float_of(mag | ((code & 8u) << 28));
}
// non-negative fp32 (or NaN), already clamped to <= 448 -> E4M3 byte, saturating round-to-nearest-even
SG_HD uint8_t e4m3_rne(float v) { return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

SG_HD float rint_(float v) { return rintf(v); }  // round half to even (the default rounding mode on the host)
SG_HD float floor_(float v) { return floorf(v); }
SG_HD float copysign_(float mag, float sign_of) { return float_of(abs_bits_of(mag) | (bits_of(sign_of) & 0x80000000u)); }

// The E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} has one mantissa bit: steps of 0.5 below 2, 1 below 4, 2 up to 6.
SG_HD float e2m1_step(float a) { return a < 2.f ? 0.5f : (a < 4.f ? 1.f : 2.f); }
SG_HD float e2m1_inv_step(float a) { return a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f); }

// |value| of formats.e2m1.e2m1_encode(y) for a = |y|: round to nearest with ties to the even code, which is the
// even multiple of the step (its thresholds 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
// are rint's); saturating at 6 (inf included); NaN encodes to code 0. Decoding the code is then a no-op: the
// kernels never pack codes, they write e2m1 * s_blk.
SG_HD float e2m1_round_mag(float a) {
  if (!(a == a)) return 0.f;
  const float h = mul(rint_(mul(a, e2m1_inv_step(a))), e2m1_step(a));
  return h > 6.f ? 6.f : h;
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
// |value| of formats.e2m1.e2m1_encode_stochastic(y, u) for a = |y|: the grid level below (lo) and up by one step with
// probability (a - lo) * inv_gap; the reference's inv_gap is the level's inverse step below 6 and 0 at 6 (where
// a - lo is 0 as well, so one formula serves both)
SG_HD float e2m1_sr_mag(float a_in, float u) {
  const float a = min_keep_nan(a_in, 6.f);
  if (!(a == a)) return 0.f;
  const float step = e2m1_step(a), inv = e2m1_inv_step(a);
  const float lo = mul(floor_(mul(a, inv)), step);
  return u < mul(sub(a, lo), inv) ? add(lo, step) : lo;
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

// One element under candidate c: *v = e2m1(x * enc) * s (the value the operand holds without the global); returns
// the element's term of formats.nvfp4._block_error, of its decode (v * global) against x (d * d for mse, else |d|).
SG_HD float candidate_element(float x, Scale c, Globals g, int rule, float* v) {
  const float y = mul(x, c.enc);
  *v = mul(copysign_(e2m1_round_mag(abs_of(y)), y), c.s);
  const float d = sub(mul(*v, g.dec), x);
  return rule == kMse ? mul(d, d) : abs_of(d);
}

// formats.nvfp4._tree_sum of 16 terms: halves added pairwise (e is overwritten)
SG_HD float tree_sum16(float* e) {
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = add(e[i], e[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = add(e[i], e[i + 4]);
  e[0] = add(e[0], e[2]);
  e[1] = add(e[1], e[3]);
  return add(e[0], e[1]);
}

SG_HD uint32_t max_bits16(const float* e) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) m = m > bits_of(e[i]) ? m : bits_of(e[i]);  // NaN (above inf) propagates
  return m;
}

// Candidate c over a 1D block: v[i] per candidate_element and, when `with_error`, formats.nvfp4._block_error.
SG_HD float candidate_values(const float* x, Scale c, Globals g, int rule, bool with_error, float* v) {
  float e[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) e[i] = candidate_element(x[i], c, g, rule, &v[i]);
  if (!with_error) return 0.f;
  return rule == kAbsMax ? float_of(max_bits16(e)) : tree_sum16(e);
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
  const float err6 = candidate_values(x, c, g, rule, FOUR_SIX, out);
  if (FOUR_SIX) {
    const Scale c4 = candidate(blk_amax, g, true);
    float v4[kBlock];
    if (candidate_values(x, c4, g, rule, true, v4) < err6) {
      c = c4;
#pragma unroll
      for (int i = 0; i < kBlock; ++i) out[i] = v4[i];
    }
  }
  if (stochastic) {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      const float y = mul(x[i], c.enc);
      out[i] = mul(copysign_(e2m1_sr_mag(abs_of(y), uniform(offset0 + i, seed_mix)), y), c.s);
    }
  }
}

}  // namespace nvfp4
}  // namespace surogate
