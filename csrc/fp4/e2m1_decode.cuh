// E2M1 / NF4 codes -> bf16 tensor-core operands, shared by the weight-only GEMM kernels (few_token_gemm.cu: straight
// into mma fragments, on large weights at 1-8 tokens in the split order of e2m1x8_to_bf16_split;
// weight_only/mixed_input_gemm.cu: into WGMMA register operands; weight_only/decode.cu's unit kernel takes
// e2m1x8_to_bf16 per 32-bit word of codes for the dense decode). A lane's unit is 32 codes of one weight row (16
// bytes) and their scale(s); the decoded words are the elements in order, word i = elements (2i, 2i + 1) (the split
// order pairs (j, j + 4) of each 8). Exact: e2m1 times a block scale has at most 5 significant bits, so the bf16
// product equals the reference's fp32 product; NVFP4's decode global is left to the caller (it multiplies the fp32
// sum once).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace surogate {
namespace wdec {

enum : int { kNVFP4 = 0, kMXFP4 = 1, kNF4 = 2 };

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  // PTX prmt in its default mode: a selector nibble with its top bit set replicates the selected byte's sign bit
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The bf16 bit patterns of the 8 E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000 0x3F00 0x3F80 0x3FC0 0x4000
// 0x4040 0x4080 0x40C0), split into low and high bytes, as prmt tables (byte i of the pair = magnitude i).
constexpr uint32_t kLow03 = 0xC0800000u, kLow47 = 0xC0804000u;
constexpr uint32_t kHigh03 = 0x3F3F3F00u, kHigh47 = 0x40404040u;

// The two table words prmt needs in a register (the other two are its immediate), held in per-thread registers: as
// constants the compiler kept them in uniform registers and copied one into a register before every prmt (one extra
// instruction per 4 codes, ~10% of the main loop). `zero` is 0 at run time (a thread index times M <= 64, shifted
// by 31) but not provably so, which keeps the words in per-thread registers.
struct E2M1Tables {
  uint32_t low03, high03;
  __device__ __forceinline__ explicit E2M1Tables(uint32_t zero) : low03(kLow03 + zero), high03(kHigh03 + zero) {}
};

// 8 E2M1 codes (code i in bits 4i..4i+3, element order) -> 4 bf16x2 words, word j = elements (2j, 2j + 1).
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t w, const E2M1Tables& t, uint32_t* out) {
  const uint32_t mag_lo = w & 0x7777u, mag_hi = (w >> 16) & 0x7777u;
  // sign bytes: byte j = 0xFF where code j is negative. The sign of code 2i is bit 7 of byte i of (w << 4),
  // that of code 2i + 1 bit 7 of byte i of w; prmt replicates it (selector nibbles with bit 3 set).
  const uint32_t w4 = w << 4;
  const uint32_t sign_lo = prmt(w4, w, 0xD9C8u), sign_hi = prmt(w4, w, 0xFBEAu);
  const uint32_t lo_a = prmt(t.low03, kLow47, mag_lo), lo_b = prmt(t.low03, kLow47, mag_hi);
  uint32_t hi_a = prmt(t.high03, kHigh47, mag_lo), hi_b = prmt(t.high03, kHigh47, mag_hi);
  hi_a |= sign_lo & 0x80808080u;
  hi_b |= sign_hi & 0x80808080u;
  out[0] = prmt(lo_a, hi_a, 0x5140u);
  out[1] = prmt(lo_a, hi_a, 0x7362u);
  out[2] = prmt(lo_b, hi_b, 0x5140u);
  out[3] = prmt(lo_b, hi_b, 0x7362u);
}

// 8 E2M1 codes (code i in bits 4i..4i+3) -> 4 bf16x2 words in split order, word j = elements (j, j + 4), each the
// element's value times 2^-126: the code's magnitude bits (e1 e0 m) go to bits 8..6 of its half (the two low
// exponent bits and the top mantissa bit, so e1 e0 = 0 is a bf16 subnormal: code 1, 0.5, is 2^-127) and its sign to
// bit 15. Codes j and j + 4 lie 16 bits apart, as a word's two halves do, so each word is two shifts of w and two
// masks: 8 ALU-pipe instructions per 8 codes (the shifts go to IMAD.SHL / IMAD.HI, on the FMA pipe) against
// e2m1x8_to_bf16's 15 byte permutes and masks, as many instructions in all. The caller's scale multiply removes the
// 2^-126 (the multiplier carries 2^126, or part of it, the rest going to the fp32 sum), and x is staged in the same
// split order.
__device__ __forceinline__ void e2m1x8_to_bf16_split(uint32_t w, uint32_t* out) {
  // codes (j, j + 4) magnitudes at bits 6..8, 22..24; the right shifts as high multiplies, off the ALU pipe (as
  // shifts ptxas made them SHF, an ALU instruction each)
  uint32_t w_2, w_6;
  asm("mul.hi.u32 %0, %1, 0x40000000;" : "=r"(w_2) : "r"(w));
  asm("mul.hi.u32 %0, %1, 0x04000000;" : "=r"(w_6) : "r"(w));
  const uint32_t mag[4] = {w << 6, w << 2, w_2, w_6};
  const uint32_t sign[4] = {w << 12, w << 8, w << 4, w};  // their signs at bits 15, 31
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = (mag[j] & 0x01C001C0u) | (sign[j] & 0x80008000u);
}

// x's 16-byte chunk of 8 bf16 elements (words (0, 1), (2, 3), (4, 5), (6, 7)) in the split order of
// e2m1x8_to_bf16_split: words (0, 4), (1, 5), (2, 6), (3, 7)
__device__ __forceinline__ uint4 split_order(uint4 v) {
  return make_uint4(prmt(v.x, v.z, 0x5410u), prmt(v.x, v.z, 0x7632u), prmt(v.y, v.w, 0x5410u),
                    prmt(v.y, v.w, 0x7632u));
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t bf16_pair(uint32_t bits16) { return bits16 | (bits16 << 16); }

// Two E4M3 bytes -> a bf16x2 (exact: 3 mantissa bits, exponents 2^-9 .. 2^8), one conversion for both
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two_bytes & 0xFFFFu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// E8M0 byte -> bf16 bits of 2^(byte - 127) (bf16 keeps fp32's exponent field; 0 -> 2^-127, 255 -> NaN)
__device__ __forceinline__ uint32_t e8m0_to_bf16_bits(uint32_t byte) {
  return byte == 255u ? 0x7FC0u : (byte == 0u ? 0x0040u : byte << 7);
}

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  // the weight is read once per call: keep it out of L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// NF4: a bf16 pair of levels[code] * absmax (each product in fp32 and rounded once, as the reference decode) for the
// two codes of byte b of a word of codes (bitsandbytes-packed: the even column in the high nibble). hi4 / lo4 hold
// each byte's high / low nibble times 4, i.e. the byte offsets of their levels in the table: one prmt picks a code's
// offset (two shifts, two masks a word; before, a shift and a mask a code: NF4's stage loop 211 -> 195 instructions,
// H200 session 33 +2% geomean at 40-2048 tokens, +5% at 40-64 tokens on the 8B MLP weights; in the few-token mma
// kernel's decode_lane, session 34: +2-6% at 1-16 tokens on Llama-3.1-8B and Qwen3-1.7B, level on SmolLM2-135M).
__device__ __forceinline__ float nf4_level_at(const float* levels, uint32_t byte_offset) {
  return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(levels) + byte_offset);
}
__device__ __forceinline__ uint32_t nf4_pair(uint32_t hi4, uint32_t lo4, int b, const float* levels, float absmax) {
  const uint32_t sel = 0x4440u | (uint32_t)b;  // byte b, then zeros
  const __nv_bfloat162 v = __floats2bfloat162_rn(nf4_level_at(levels, __byte_perm(hi4, 0u, sel)) * absmax,
                                                 nf4_level_at(levels, __byte_perm(lo4, 0u, sel)) * absmax);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// What one lane loads per step for one weight row: 32 codes and their scale(s).
struct LaneWeights {
  uint4 codes;
  uint32_t scale;  // NVFP4: two E4M3 bytes (blocks k0/16, k0/16 + 1); MXFP4: one E8M0 byte; NF4: fp32 absmax bits
};

// The lane's 32 codes as 16 bf16x2 words, word i = elements (2i, 2i + 1) of its 32-column range.
template <int FMT>
__device__ __forceinline__ void decode_lane(const LaneWeights& lw, const float* levels, const E2M1Tables& tables,
                                            uint32_t* out) {
  const uint32_t words[4] = {lw.codes.x, lw.codes.y, lw.codes.z, lw.codes.w};
  if (FMT == kNF4) {
    const float am = __uint_as_float(lw.scale);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t hi4 = (words[i] >> 2) & 0x3C3C3C3Cu, lo4 = (words[i] << 2) & 0x3C3C3C3Cu;
#pragma unroll
      for (int b = 0; b < 4; ++b) out[4 * i + b] = nf4_pair(hi4, lo4, b, levels, am);  // (the even element high)
    }
  } else {
    uint32_t s0, s1;
    if (FMT == kNVFP4) {
      const uint32_t both = e4m3x2_to_bf16x2(lw.scale);  // (block k0/16, block k0/16 + 1)
      s0 = prmt(both, both, 0x1010u);
      s1 = prmt(both, both, 0x3232u);
    } else {
      s0 = s1 = bf16_pair(e8m0_to_bf16_bits(lw.scale));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      e2m1x8_to_bf16(words[i], tables, out + 4 * i);
      const uint32_t s = i < 2 ? s0 : s1;  // NVFP4: words 0-1 are block k0/16, words 2-3 the next one
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * i + j] = bf16x2_mul(out[4 * i + j], s);  // exact: <= 5 significant bits
    }
  }
}

// NVFP4's split-order words carry 2^-kNvfp4SplitLog2 (the multiplier, 2^126 times an E4M3 scale of up to 448,
// would pass bf16's 2^128; 2^118 times it does not), which the fp32 sum gets back by one exact multiply
constexpr int kNvfp4SplitLog2 = 8;
constexpr uint32_t kBf16x2Pow118 = 0x7A807A80u;  // 2^(126 - kNvfp4SplitLog2), both halves

// decode_lane in split order (NVFP4, MXFP4): word 4i + j = elements (8i + j, 8i + j + 4) of the lane's 32, NVFP4's
// times 2^-kNvfp4SplitLog2, MXFP4's as they are. One multiply per word takes e2m1x8_to_bf16_split's 2^-126 off and
// applies the scale; each product is exact, as in decode_lane (<= 5 significant bits, bf16 normal or subnormal).
template <int FMT>
__device__ __forceinline__ void decode_lane_split(const LaneWeights& lw, uint32_t* out) {
  static_assert(FMT == kNVFP4 || FMT == kMXFP4, "NF4 has no split decode");
  const uint32_t words[4] = {lw.codes.x, lw.codes.y, lw.codes.z, lw.codes.w};
  uint32_t s0, s1;
  if (FMT == kNVFP4) {
    const uint32_t both = bf16x2_mul(e4m3x2_to_bf16x2(lw.scale), kBf16x2Pow118);  // exact: a power of two
    s0 = prmt(both, both, 0x1010u);
    s1 = prmt(both, both, 0x3232u);
  } else {
    // 2^(e - 127) x 2^126 = 2^(e - 1): a bf16 exponent field of e + 126, in range up to e = 128 (a scale of 2)
    s0 = s1 = bf16_pair((min(lw.scale, 128u) + 126u) << 7);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    e2m1x8_to_bf16_split(words[i], out + 4 * i);
    const uint32_t s = i < 2 ? s0 : s1;  // NVFP4: words 0-1 are block k0/16, words 2-3 the next one
#pragma unroll
    for (int j = 0; j < 4; ++j) out[4 * i + j] = bf16x2_mul(out[4 * i + j], s);
  }
  if (FMT == kMXFP4 && __any_sync(0xFFFFFFFFu, lw.scale > 128u)) {
    // scales of 4 and up (and 255, NaN): the first multiply took 2^127, the rest, 2^(e - 128), is a second one
    // (exact: v x 2 times a power of two); rare in real weights, so a branch the whole warp skips otherwise
    const uint32_t rest = bf16_pair(lw.scale <= 128u ? 0x3F80u : lw.scale == 255u ? 0x7FC0u : (lw.scale - 1u) << 7);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = bf16x2_mul(out[i], rest);
  }
}

}  // namespace wdec
}  // namespace surogate
