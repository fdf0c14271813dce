// RMSNorm forward and backward kernels of surogate::ext_rmsnorm (csrc/norm/rmsnorm_op.cpp). The math is the
// transformers formulas of surogate_hf/recipes/norm.py (the reference) and the Triton kernels of
// surogate_hf/kernels/triton_norm.py, element for element:
//   rstd = rsqrt(sum(x^2) * (1/C) + eps) over fp32 x
//   llama  y = w * to_x_dtype(x * rstd)         gemma  y = (x * rstd) * (1 + w)        (fp32, then one rounding)
//   backward: g = llama: to_x_dtype(dy * w), gemma: dy * (1 + w); dot = sum(g * x);
//             dx = g * rstd - x * (dot * rstd^3 / C);  dw = sum over rows of dy * (llama: to_x_dtype(h), gemma: h)
// They differ from torch only in the order of the row and column sums.
// Layout: one block per row at a time (blocks stride over the rows), each thread holding up to MAXCH of the row's
// columns (c = threadIdx.x + j * blockDim.x: coalesced), so a row is read once. The backward's blocks keep their
// rows' dw contributions in registers and write one partial row each; a second kernel sums the partials by column
// in a fixed order (deterministic).
#include <type_traits>

#include "../common/device.cuh"

namespace surogate {
namespace {

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and back (the reference's `.to(x.dtype)` inside the formula)
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f32<T>(from_f32<T>(v)); }

// The block-wide sum of every thread's v (any blockDim.x <= 1024, a multiple of 32), returned to all threads.
__device__ __forceinline__ float block_sum(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();  // smem may still be read by the previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float t = lane < warps ? smem[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

template <typename TX, typename TW, typename TY, int MAXCH>
__global__ void __launch_bounds__(1024) rmsnorm_fwd_kernel(const TX* __restrict__ x, const TW* __restrict__ w,
                                                           TY* __restrict__ y, float* __restrict__ rstd_out, int64_t R,
                                                           int C, float eps, bool gemma) {
  __shared__ float smem[32];
  // llama's w * h computes in the promoted dtype of w and x: x's own when both are the same 16-bit type
  constexpr bool kLlamaRound = std::is_same<TW, TX>::value && !std::is_same<TX, float>::value;
  const float inv_c = 1.0f / (float)C;
  float wv[MAXCH];
#pragma unroll
  for (int j = 0; j < MAXCH; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    wv[j] = c < C ? to_f32<TW>(w[c]) : 0.f;
  }
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const TX* xr = x + r * C;
    float xv[MAXCH];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < MAXCH; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      xv[j] = c < C ? to_f32<TX>(xr[c]) : 0.f;
      ss += xv[j] * xv[j];
    }
    const float rstd = rsqrtf(block_sum(ss, smem) * inv_c + eps);
    if (threadIdx.x == 0) rstd_out[r] = rstd;
    TY* yr = y + r * C;
#pragma unroll
    for (int j = 0; j < MAXCH; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < C) {
        const float h = xv[j] * rstd;
        // the reference's roundings: gemma to x's dtype (type_as), llama to the promoted dtype of w and x
        const float v = gemma ? round_to<TX>(h * (1.0f + wv[j])) : kLlamaRound ? round_to<TX>(wv[j] * round_to<TX>(h))
                                                                               : wv[j] * round_to<TX>(h);
        yr[c] = from_f32<TY>(v);
      }
    }
  }
}

template <typename TX, typename TW, typename TY, int MAXCH>
__global__ void __launch_bounds__(1024) rmsnorm_bwd_kernel(const TY* __restrict__ dy, const TX* __restrict__ x,
                                                           const TW* __restrict__ w, const float* __restrict__ rstd_in,
                                                           TX* __restrict__ dx, float* __restrict__ dw_part, int64_t R,
                                                           int C, bool gemma) {
  __shared__ float smem[32];
  const float inv_c = 1.0f / (float)C;
  float wv[MAXCH], acc[MAXCH];
#pragma unroll
  for (int j = 0; j < MAXCH; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    wv[j] = c < C ? to_f32<TW>(w[c]) : 0.f;
    acc[j] = 0.f;
  }
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const TX* xr = x + r * C;
    const TY* dyr = dy + r * C;
    const float rstd = rstd_in[r];
    float xv[MAXCH], gv[MAXCH];
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < MAXCH; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      float d = 0.f;
      xv[j] = 0.f;
      gv[j] = 0.f;
      if (c < C) {
        xv[j] = to_f32<TX>(xr[c]);
        d = to_f32<TY>(dyr[c]);
        gv[j] = gemma ? d * (1.0f + wv[j]) : round_to<TX>(d * wv[j]);
        const float h = xv[j] * rstd;
        acc[j] += d * (gemma ? h : round_to<TX>(h));
      }
      dot += gv[j] * xv[j];
    }
    const float coef = block_sum(dot, smem) * rstd * rstd * rstd * inv_c;
    TX* dxr = dx + r * C;
#pragma unroll
    for (int j = 0; j < MAXCH; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < C) dxr[c] = from_f32<TX>(gv[j] * rstd - xv[j] * coef);
    }
  }
  if (dw_part != nullptr) {
#pragma unroll
    for (int j = 0; j < MAXCH; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < C) dw_part[(int64_t)blockIdx.x * C + c] = acc[j];
    }
  }
}

// dw[c] = sum over p of part[p, c], in p order within each of 32 row groups, then the groups in order: 32 columns
// per block, 32 row groups (blockDim 32 x 32).
template <typename TW>
__global__ void column_sum_kernel(const float* __restrict__ part, TW* __restrict__ dw, int P, int C) {
  __shared__ float tile[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < C)
    for (int p = threadIdx.y; p < P; p += 32) s += part[(int64_t)p * C + c];
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.f;
    for (int i = 0; i < 32; ++i) t += tile[i][threadIdx.x];
    dw[c] = from_f32<TW>(t);
  }
}

template <typename F>
void dispatch_two(int dtype, F&& f) {  // fp32 or bf16 (the dtypes the op takes for the weight and the output)
  if (dtype == 0) f(float{});
  else f(__nv_bfloat16{});
}

template <typename F>
void dispatch_chunks(int maxch, F&& f) {  // 4, 8 or 16 (rmsnorm_geometry)
  if (maxch <= 4) f(std::integral_constant<int, 4>{});
  else if (maxch == 8) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 16>{});
}

// Calls f(TY{}) for the output dtype: x's own, or fp32 (y_is_f32)
template <typename TX, typename F>
void dispatch_out(bool y_is_f32, F&& f) {
  if (y_is_f32) f(float{});
  else f(TX{});
}

}  // namespace

// Threads per block and columns per thread (4, 8 or 16) for rows of C columns: about 4 columns per thread up to
// 1024 threads. The caller refuses C above kRmsnormMaxCols.
void rmsnorm_geometry(int64_t C, int* threads, int* maxch) {
  const int64_t t = ((C + 3) / 4 + 31) / 32 * 32;
  *threads = (int)(t < 32 ? 32 : (t > 1024 ? 1024 : t));
  int m = 4;
  while ((int64_t)m * *threads < C) m *= 2;
  *maxch = m;
}

// x [R, C] (dtype code 0 fp32 / 1 bf16 / 2 fp16), w [C] (0 / 1), y [R, C] in x's dtype or fp32 (y_is_f32), rstd [R]
void launch_rmsnorm_fwd(const void* x, int x_dtype, const void* w, int w_dtype, void* y, bool y_is_f32, float* rstd,
                        int64_t R, int64_t C, float eps, bool gemma, int sms, cudaStream_t stream) {
  int threads, maxch;
  rmsnorm_geometry(C, &threads, &maxch);
  const int per_sm = 2048 / threads;
  const unsigned grid = (unsigned)(R < (int64_t)sms * per_sm * 4 ? R : (int64_t)sms * per_sm * 4);
  dispatch_float(x_dtype, [&](auto tx) {
    using TX = decltype(tx);
    dispatch_two(w_dtype, [&](auto tw) {
      using TW = decltype(tw);
      dispatch_out<TX>(y_is_f32, [&](auto ty) {
        using TY = decltype(ty);
        dispatch_chunks(maxch, [&](auto ch) {
          rmsnorm_fwd_kernel<TX, TW, TY, decltype(ch)::value><<<grid, threads, 0, stream>>>(
              reinterpret_cast<const TX*>(x), reinterpret_cast<const TW*>(w), reinterpret_cast<TY*>(y), rstd, R,
              (int)C, eps, gemma);
        });
      });
    });
  });
}

// The number of partial dw rows launch_rmsnorm_bwd writes (its grid): the caller allocates part [P, C] fp32.
int64_t rmsnorm_bwd_partials(int64_t R, int64_t C, int sms) {
  int threads, maxch;
  rmsnorm_geometry(C, &threads, &maxch);
  const int64_t wave = (int64_t)sms * (2048 / threads);
  return R < wave ? R : wave;
}

// dy [R, C] (x's dtype or fp32: dy_is_f32), x [R, C], w [C], rstd [R] -> dx [R, C] (x's dtype); dw_part [P, C] fp32
// or null (no dw)
void launch_rmsnorm_bwd(const void* dy, bool dy_is_f32, const void* x, int x_dtype, const void* w, int w_dtype,
                        const float* rstd, void* dx, float* dw_part, int64_t R, int64_t C, bool gemma, int sms,
                        cudaStream_t stream) {
  int threads, maxch;
  rmsnorm_geometry(C, &threads, &maxch);
  const unsigned grid = (unsigned)rmsnorm_bwd_partials(R, C, sms);
  dispatch_float(x_dtype, [&](auto tx) {
    using TX = decltype(tx);
    dispatch_two(w_dtype, [&](auto tw) {
      using TW = decltype(tw);
      dispatch_out<TX>(dy_is_f32, [&](auto ty) {
        using TY = decltype(ty);
        dispatch_chunks(maxch, [&](auto ch) {
          rmsnorm_bwd_kernel<TX, TW, TY, decltype(ch)::value><<<grid, threads, 0, stream>>>(
              reinterpret_cast<const TY*>(dy), reinterpret_cast<const TX*>(x), reinterpret_cast<const TW*>(w), rstd,
              reinterpret_cast<TX*>(dx), dw_part, R, (int)C, gemma);
        });
      });
    });
  });
}

// dw [C] (w_dtype 0 fp32 / 1 bf16) = the column sums of part [P, C]
void launch_column_sum(const float* part, void* dw, int w_dtype, int64_t P, int64_t C, cudaStream_t stream) {
  const dim3 block(32, 32);
  const unsigned grid = (unsigned)((C + 31) / 32);
  dispatch_two(w_dtype, [&](auto tw) {
    using TW = decltype(tw);
    column_sum_kernel<TW><<<grid, block, 0, stream>>>(part, reinterpret_cast<TW*>(dw), (int)P, (int)C);
  });
}

}  // namespace surogate
