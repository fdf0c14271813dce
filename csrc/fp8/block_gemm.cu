// Kernels of the block-scaled FP8 linear (fp8 QLoRA bases): the 1x128 activation-tile quantization that feeds
// cuBLASLt's BlockWise1x128 x BlockWise128x128 scaled GEMM, and the byte transpose the dgrad GEMM needs.
//
// quantize_tiles is bit-exact to surogate_hf.formats.fp8.quantize_fp8_tiles (tile 128, e4m3):
//   amax = max|x| over the tile (NaN propagates), scale = amax > 0 ? rcp_rn(amax) * 448 : 1 (torch evaluates
//   `448 / amax` as reciprocal-then-multiply), scale_inv = rcp_rn(scale), q = sat_rne(clamp(x * scale)).
// It also writes the rows the GEMM pads M up to (zeros, scale_inv 1), exactly what quantizing zero rows gives.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/device.cuh"

namespace surogate {
namespace {

__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

// 16 lanes per 128-element tile, 8 elements (one or two 16-byte loads) per lane; two tiles per warp. Tiles
// are numbered row-major over [Mp, kb].
template <typename T, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) quantize_tiles_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                                    float* __restrict__ s_colmajor, int64_t m,
                                                                    int64_t mp, int64_t k) {
  const int lane = threadIdx.x & 15;
  const int64_t kb = k / 128;
  const int64_t tile = (int64_t)blockIdx.x * (WARPS * 2) + (threadIdx.x >> 4);
  const bool live = tile < mp * kb;  // no early return: the whole warp takes part in the shuffles
  const int64_t row = live ? tile / kb : 0, tb = live ? tile - row * kb : 0;
  const int64_t off = row * k + tb * 128 + lane * 8;
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  if (live && row < m) {
    constexpr int PER16 = 16 / sizeof(T);
#pragma unroll
    for (int h = 0; h < 8 / PER16; ++h) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + off + h * PER16);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < PER16; ++j) v[h * PER16 + j] = to_f32<T>(e[j]);
    }
  }
  // |x| bits order like the floats, NaN above inf: an unsigned max is the tile's amax with NaN propagating
  unsigned bits = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) bits = max(bits, __float_as_uint(v[j]) & 0x7fffffffu);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  if (!live) return;
  const float amax = __uint_as_float(bits);
  const float scale = amax > 0.f ? __frcp_rn(amax) * 448.0f : 1.0f;  // NaN amax fails the test: scale 1
  const float scale_inv = __frcp_rn(scale);
  float y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = clamp_keep_nan(v[j] * scale, 448.f);
  *reinterpret_cast<uint2*>(q + off) = make_uint2(fp8x4(y[0], y[1], y[2], y[3]), fp8x4(y[4], y[5], y[6], y[7]));
  if (lane == 0) s_colmajor[tb * mp + row] = scale_inv;
}

// out[c, r] = in[r, c] for bytes, through a 64x64 shared tile (rows padded against bank conflicts).
__global__ void __launch_bounds__(256) transpose_bytes_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                                                              int64_t rows, int64_t cols) {
  __shared__ uint8_t tile[64][64 + 4];
  const int64_t r0 = (int64_t)blockIdx.y * 64, c0 = (int64_t)blockIdx.x * 64;
  const int tx = threadIdx.x & 63, ty = threadIdx.x >> 6;  // 64 x 4 threads
  for (int i = ty; i < 64; i += 4) {
    const int64_t r = r0 + i, c = c0 + tx;
    if (r < rows && c < cols) tile[i][tx] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = ty; i < 64; i += 4) {
    const int64_t c = c0 + i, r = r0 + tx;
    if (c < cols && r < rows) out[c * rows + r] = tile[tx][i];
  }
}

}  // namespace

// dtype codes: 0 fp32, 1 bf16, 2 fp16. k must be a multiple of 128, x 16-byte and q 8-byte aligned.
void launch_quantize_tiles(const void* x, int dtype, void* q, float* s_colmajor, int64_t m, int64_t mp, int64_t k,
                           cudaStream_t stream) {
  constexpr int WARPS = 8;
  const int64_t tiles = mp * (k / 128);
  if (tiles == 0) return;
  const int64_t blocks = (tiles + 2 * WARPS - 1) / (2 * WARPS);
  uint8_t* qb = static_cast<uint8_t*>(q);
  if (dtype == 0) {
    quantize_tiles_kernel<float, WARPS><<<blocks, WARPS * 32, 0, stream>>>((const float*)x, qb, s_colmajor, m, mp, k);
  } else if (dtype == 1) {
    quantize_tiles_kernel<__nv_bfloat16, WARPS>
        <<<blocks, WARPS * 32, 0, stream>>>((const __nv_bfloat16*)x, qb, s_colmajor, m, mp, k);
  } else {
    quantize_tiles_kernel<__half, WARPS><<<blocks, WARPS * 32, 0, stream>>>((const __half*)x, qb, s_colmajor, m, mp, k);
  }
}

void launch_transpose_bytes(const void* in, void* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  dim3 grid((unsigned)((cols + 63) / 64), (unsigned)((rows + 63) / 64));
  transpose_bytes_kernel<<<grid, 256, 0, stream>>>((const uint8_t*)in, (uint8_t*)out, rows, cols);
}

}  // namespace surogate
