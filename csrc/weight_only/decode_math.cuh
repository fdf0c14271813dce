// Element math of the dense decode (csrc/weight_only/decode.cu), __host__ __device__ so that a host build checks it
// bit for bit against the formats' reference decode with no GPU (tests/kernels/test_csrc_host.py). Each fp32 product
// is rounded on its own, in the reference's order (surogate_hf/ops/ext.py: decode_reference):
//   fmt 0 NVFP4: (e2m1 * float(e4m3 block scale)) * global           w [n, k/2], scales [n, k/16], even element low nibble
//   fmt 1 MXFP4: e2m1 * 2^(e8m0 - 127), 255 -> NaN                    w [n, k/2], scales [n, k/32]
//   fmt 2 NF4:   levels[code] * absmax[flat index / block]            bitsandbytes packing: even element in the HIGH nibble;
//                a double-quantized absmax is de-nested per block: nested_code[q] * nested_absmax[block / 256] + offset
//                (formats.nf4.nf4_absmax: bitsandbytes' dequantize_blockwise, then the offset; each fp32 op rounded)
//   fmt 3 FP8:   float(e4m3) * scale_inv[row / block][col / block]   w [n, k], scale_inv [ceil(n/block), ceil(k/block)]
#pragma once
#include "../fp4/nvfp4_math.cuh"

namespace surogate {
namespace decode {

using nvfp4::add;
using nvfp4::e2m1_value;
using nvfp4::e4m3_value;
using nvfp4::float_of;
using nvfp4::mul;

// E8M0 -> 2^(e - 127) (e = 0: the fp32 subnormal 2^-127), 255 -> NaN (formats.mxfp4.e8m0_to_float)
SG_HD float e8m0_value(uint8_t e) { return e == 255 ? float_of(0x7FC00000u) : float_of(e ? (uint32_t)e << 23 : 0x00400000u); }

SG_HD float nvfp4_element(uint32_t code, float scale, float global) { return mul(mul(e2m1_value(code), scale), global); }
SG_HD float mxfp4_element(uint32_t code, float scale) { return mul(e2m1_value(code), scale); }
SG_HD float nf4_element(float level, float absmax) { return mul(level, absmax); }
SG_HD float fp8_element(uint8_t code, float scale_inv) { return mul(e4m3_value(code), scale_inv); }

struct Weight {
  const uint8_t* w;
  const uint8_t* scales_u8;  // NVFP4 E4M3 / MXFP4 E8M0 scales
  const float* scales_f32;   // NF4 absmax / FP8 scale_inv
  const float* gscale;       // NVFP4 decode global
  const float* levels;       // NF4's 16 levels
  int64_t n, k;
  int block;                 // NF4 block size (elements); FP8 block edge
  // NF4 double quantization (all null otherwise): the absmax is then one-byte codes in scales_u8
  const float* nested_absmax = nullptr;  // fp32 [ceil(blocks / kNf4NestedBlock)]
  const float* nested_code = nullptr;    // fp32 [256]
  const float* offset = nullptr;         // fp32 [1]
};

// bitsandbytes' block of the nested (second-level) absmax quantization: 256 first-level absmax values per fp32 scale
constexpr int64_t kNf4NestedBlock = 256;

// the fp32 absmax of NF4 block b, de-nested where double-quantized
SG_HD float nf4_absmax(const Weight& a, int64_t b) {
  if (a.nested_code == nullptr) return a.scales_f32[b];
  return add(mul(a.nested_code[a.scales_u8[b]], a.nested_absmax[b / kNf4NestedBlock]), *a.offset);
}

// the FP8 scale_inv entry of element e (flat index into [n, k]): its block row and block column
SG_HD int64_t fp8_scale_index(const Weight& a, int64_t e) {
  const int64_t row = e / a.k, col = e - row * a.k, kb = (a.k + a.block - 1) / a.block;
  return (row / a.block) * kb + col / a.block;
}

// element e (flat index into [n, k]) of the weight, read on its own: the kernel's element-by-element path and the spec
// of its vector path
template <int FMT>
SG_HD float element(const Weight& a, const float* levels, int64_t e) {
  if (FMT == 3) return fp8_element(a.w[e], a.scales_f32[fp8_scale_index(a, e)]);
  const uint8_t byte = a.w[e >> 1];
  if (FMT == 2) return nf4_element(levels[(e & 1) ? (byte & 0xFu) : (byte >> 4)], nf4_absmax(a, e / a.block));
  const uint32_t code = (e & 1) ? (byte >> 4) : (byte & 0xFu);
  if (FMT == 0) return nvfp4_element(code, e4m3_value(a.scales_u8[e >> 4]), *a.gscale);
  return mxfp4_element(code, e8m0_value(a.scales_u8[e >> 5]));
}

}  // namespace decode
}  // namespace surogate
