// Dispatcher bindings of the csrc kernels: argument checks and launches only, no math. The Python callers
// validate every input first (clear errors, a fallback path); the checks here (EXT_CHECK, common/check.h) guard
// against misuse.
#include <cstdlib>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

#include <ATen/ops/_scaled_mm_v2.h>
#include <torch/library.h>
#include "weight_only/mixed_input_gemm.h"
#include "common/check.h"

namespace surogate {
void launch_cast_amax(const void* x, int dtype, const float* scale, void* q, bool e4m3, unsigned* amax, int64_t n,
                      int sms, cudaStream_t stream);
void launch_cast_transpose_amax(const void* x, int dtype, const float* scale, void* q, void* qt, bool e4m3,
                                unsigned* amax, int64_t rows, int64_t cols, cudaStream_t stream);
void launch_quantize_tiles(const void* x, int dtype, void* q, float* s_colmajor, int64_t m, int64_t mp, int64_t k,
                           cudaStream_t stream);
void launch_transpose_bytes(const void* in, void* out, int64_t rows, int64_t cols, cudaStream_t stream);
void launch_nvfp4_amax(const void* x, int dtype, const float* signs, unsigned* amax, int64_t R, int64_t C, int axis,
                       cudaStream_t stream);
void launch_nvfp4_qdq(const void* x, int dtype, const float* signs, const unsigned* amax, void* out, float* g_dec_out,
                      int64_t R, int64_t C, int axis, bool four_over_six, int rule, bool stochastic, int64_t seed,
                      const int64_t* seed_ptr, cudaStream_t stream);
void launch_nvfp4_scale_bias_cast(const float* acc, const float* ga, const float* gb, const void* bias, int bias_dtype,
                                  void* out, int out_dtype, int64_t M, int64_t N, int sms, cudaStream_t stream);
cudaError_t launch_few_token_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                                  const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                                  int sms, int forced_split, cudaStream_t stream);
}

static int dtype_code(const torch::Tensor& x, const char* who) {
  switch (x.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: EXT_CHECK(false, who, ": x must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return -1;
}

// q = sat_rne(x * scale) into the preallocated fp8 tensor q; amax_bits (int32 scalar, zeroed by the caller)
// receives max|x| as float bits.
void fp8_cast_amax(const torch::Tensor& x, const torch::Tensor& scale, torch::Tensor& q, torch::Tensor& amax_bits) {
  EXT_CHECK(x.is_cuda() && x.is_contiguous(), "fp8_cast_amax: x must be a contiguous CUDA tensor");
  EXT_CHECK(q.is_contiguous() && q.numel() == x.numel(), "fp8_cast_amax: q must be contiguous with x's numel");
  EXT_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "fp8_cast_amax: scale must be one fp32 value");
  EXT_CHECK(amax_bits.scalar_type() == at::kInt && amax_bits.numel() == 1, "fp8_cast_amax: amax_bits must be int32[1]");
  const bool e4m3 = q.scalar_type() == at::kFloat8_e4m3fn;
  EXT_CHECK(e4m3 || q.scalar_type() == at::kFloat8_e5m2, "fp8_cast_amax: q must be float8_e4m3fn or float8_e5m2");
  const int dtype = dtype_code(x, "fp8_cast_amax");
  EXT_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 8 == 0,
            "fp8_cast_amax: x must be 16-byte and q 8-byte aligned");
  const at::cuda::CUDAGuard guard(x.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  surogate::launch_cast_amax(x.data_ptr(), dtype, scale.data_ptr<float>(), q.data_ptr(), e4m3,
                             reinterpret_cast<unsigned*>(amax_bits.data_ptr<int>()), x.numel(), sms,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// q = sat_rne(x * scale) and its contiguous transpose qt from one pass over the 2-D x; amax_bits as above.
void fp8_cast_transpose_amax(const torch::Tensor& x, const torch::Tensor& scale, torch::Tensor& q, torch::Tensor& qt,
                             torch::Tensor& amax_bits) {
  EXT_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "fp8_cast_transpose_amax: x must be a contiguous 2-D CUDA tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  EXT_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(0) == rows && q.size(1) == cols,
            "fp8_cast_transpose_amax: q must be contiguous with x's shape");
  EXT_CHECK(qt.is_contiguous() && qt.dim() == 2 && qt.size(0) == cols && qt.size(1) == rows,
            "fp8_cast_transpose_amax: qt must be contiguous with x's transposed shape");
  EXT_CHECK(qt.scalar_type() == q.scalar_type(), "fp8_cast_transpose_amax: q and qt must share a dtype");
  EXT_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "fp8_cast_transpose_amax: scale must be one fp32 value");
  EXT_CHECK(amax_bits.scalar_type() == at::kInt && amax_bits.numel() == 1,
            "fp8_cast_transpose_amax: amax_bits must be int32[1]");
  const bool e4m3 = q.scalar_type() == at::kFloat8_e4m3fn;
  EXT_CHECK(e4m3 || q.scalar_type() == at::kFloat8_e5m2,
            "fp8_cast_transpose_amax: q must be float8_e4m3fn or float8_e5m2");
  const int dtype = dtype_code(x, "fp8_cast_transpose_amax");
  EXT_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 8 == 0 &&
                reinterpret_cast<uintptr_t>(qt.data_ptr()) % 4 == 0,
            "fp8_cast_transpose_amax: x must be 16-byte, q 8-byte and qt 4-byte aligned");
  const at::cuda::CUDAGuard guard(x.device());
  surogate::launch_cast_transpose_amax(x.data_ptr(), dtype, scale.data_ptr<float>(), q.data_ptr(), qt.data_ptr(), e4m3,
                                       reinterpret_cast<unsigned*>(amax_bits.data_ptr<int>()), rows, cols,
                                       at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (q [Mp, K] e4m3, scale_inv [Mp, K/128] as an M-contiguous view): 1x128 tiles of x [M, K], M padded to a
// multiple of `row_multiple` with zero rows (cuBLASLt's block-scaled GEMM wants M % 16 == 0).
std::tuple<torch::Tensor, torch::Tensor> fp8_quantize_tiles(const torch::Tensor& x_in, int64_t row_multiple) {
  EXT_CHECK(x_in.is_cuda() && x_in.dim() == 2, "fp8_quantize_tiles: x must be a 2-D CUDA tensor");
  EXT_CHECK(row_multiple >= 1, "fp8_quantize_tiles: row_multiple must be >= 1");
  const int dtype = dtype_code(x_in, "fp8_quantize_tiles");
  torch::Tensor x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone();  // the kernel loads 16 bytes at a time
  const int64_t m = x.size(0), k = x.size(1);
  EXT_CHECK(k % 128 == 0, "fp8_quantize_tiles: the last dim (", k, ") must be a multiple of 128");
  const int64_t mp = (m + row_multiple - 1) / row_multiple * row_multiple;
  const at::cuda::CUDAGuard guard(x.device());
  auto q = torch::empty({mp, k}, x.options().dtype(at::kFloat8_e4m3fn));
  auto s = torch::empty({k / 128, mp}, x.options().dtype(at::kFloat));
  surogate::launch_quantize_tiles(x.data_ptr(), dtype, q.data_ptr(), s.data_ptr<float>(), m, mp, k,
                                  at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, s.t()};
}

// Contiguous transpose of a 2-D tensor of 1-byte elements (fp8 / uint8).
torch::Tensor transpose_bytes(const torch::Tensor& x_in) {
  EXT_CHECK(x_in.is_cuda() && x_in.dim() == 2 && x_in.element_size() == 1,
            "transpose_bytes: x must be a 2-D CUDA tensor of 1-byte elements");
  const torch::Tensor x = x_in.contiguous();
  const at::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({x.size(1), x.size(0)}, x.options());
  surogate::launch_transpose_bytes(x.data_ptr(), out.data_ptr(), x.size(0), x.size(1), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Block-scaled FP8 GEMM of a high-precision x against an e4m3 weight w [N, K] in 128x128 blocks:
//   transpose_w = false: y [M, N] = x [M, K] @ W^T      (forward)
//   transpose_w = true:  y [M, K] = x [M, N] @ W        (dgrad; W^T is made here in one byte pass)
// w_scales_mm holds the scales of the operand actually multiplied (W, or W^T for dgrad) as laid out by
// surogate_hf.kernels.fp8_gemm.mm_scales. x is quantized in 1x128 tiles, then cuBLASLt's BlockWise1x128 x
// BlockWise128x128 GEMM runs. One call from Python instead of four.
torch::Tensor fp8_block_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& w_scales_mm,
                             bool transpose_w, int64_t recipe_a, int64_t recipe_b) {
  EXT_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && w.dim() == 2, "fp8_block_gemm: w must be a 2-D e4m3 tensor");
  EXT_CHECK(w_scales_mm.scalar_type() == at::kFloat && w_scales_mm.dim() == 2 && w_scales_mm.is_contiguous(),
            "fp8_block_gemm: w_scales_mm must be a contiguous 2-D fp32 tensor");
  const torch::Tensor wk = transpose_w ? transpose_bytes(w) : w.contiguous();  // [N, K], K contiguous
  EXT_CHECK(x.dim() == 2 && x.size(1) == wk.size(1), "fp8_block_gemm: x [M, ", wk.size(1), "] expected, got ",
            x.sizes());
  auto [xq, xs] = fp8_quantize_tiles(x, 16);
  const int64_t m = x.size(0);
  std::vector<int64_t> ra{recipe_a}, rb{recipe_b};
  std::vector<torch::Tensor> sa{xs}, sb{w_scales_mm.t()};
  auto y = at::_scaled_mm_v2(xq, wk.t(), sa, ra, {}, sb, rb, {}, std::nullopt, x.scalar_type(), {}, false);
  return y.size(0) == m ? y : y.narrow(0, 0, m);
}

// x contiguous and 16-byte aligned (the kernels load 16 bytes at a time): x itself, or a copy. Done here rather than
// checked because compiled graphs call these ops directly, with buffers whose layout is known only at run time.
static torch::Tensor aligned_operand(const torch::Tensor& x) {
  torch::Tensor c = x.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16) c = c.clone();
  return c;
}

static void check_nvfp4_operand(const torch::Tensor& x, const c10::optional<torch::Tensor>& signs, int64_t axis,
                                const char* who) {
  EXT_CHECK(x.is_cuda() && x.dim() == 2, who, ": x must be a 2-D CUDA tensor");
  EXT_CHECK(axis >= 0 && axis <= 2, who, ": axis must be 0, 1 or 2, got ", axis);
  EXT_CHECK(axis == 0 || x.size(1) % 16 == 0, who, ": blocks along rows need the last dim (", x.size(1),
            ") to be a multiple of 16");
  EXT_CHECK(axis != 2 || (x.size(0) % 16 == 0 && !signs.has_value()), who,
            ": 16x16 tiles need rows that are a multiple of 16 and no transform");
  if (signs.has_value())
    EXT_CHECK(signs->is_cuda() && signs->scalar_type() == at::kFloat && signs->numel() == 16 && signs->is_contiguous(),
              who, ": signs must be 16 contiguous fp32 values on the GPU");
}

static const float* signs_ptr(const c10::optional<torch::Tensor>& signs) {
  return signs.has_value() ? signs->data_ptr<float>() : nullptr;
}

// fp32 amax (0-dim) of the NVFP4 operand quantize_nvfp4 would see: x's blocks along `axis`, transformed by the RHT
// with `signs` when given (axis 0: columns zero-padded to whole blocks; axis 2, 16x16 tiles: x itself).
torch::Tensor nvfp4_amax(const torch::Tensor& x_in, const c10::optional<torch::Tensor>& signs, int64_t axis) {
  check_nvfp4_operand(x_in, signs, axis, "nvfp4_amax");
  const torch::Tensor x = aligned_operand(x_in);
  const int dtype = dtype_code(x, "nvfp4_amax");
  const at::cuda::CUDAGuard guard(x.device());
  auto bits = torch::zeros({}, x.options().dtype(at::kInt));
  surogate::launch_nvfp4_amax(x.data_ptr(), dtype, signs_ptr(signs), reinterpret_cast<unsigned*>(bits.data_ptr<int>()),
                              x.size(0), x.size(1), (int)axis, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return bits.view(at::kFloat);
}

// (values bf16 [R, C] (axes 1, 2) or [ceil16(R), C] (axis 0), g_dec fp32 0-dim): NVFP4 quantization of x's blocks
// along `axis` (2: 16x16 tiles), written back as e2m1 * s_blk, the GEMM operand without its global. The global
// scale comes from amax, or when amax is None from the operand's own amax (taken here, one call for both passes).
std::tuple<torch::Tensor, torch::Tensor> nvfp4_qdq(const torch::Tensor& x_in, const c10::optional<torch::Tensor>& amax,
                                                   const c10::optional<torch::Tensor>& signs, int64_t axis,
                                                   bool four_over_six, int64_t rule, bool stochastic, int64_t seed,
                                                   const c10::optional<torch::Tensor>& seed_tensor) {
  check_nvfp4_operand(x_in, signs, axis, "nvfp4_qdq");
  const torch::Tensor x = aligned_operand(x_in);
  // a seed on the device (one int64) replaces `seed`: the kernel reads it, no host read
  const int64_t* seed_ptr = nullptr;
  if (seed_tensor.has_value()) {
    EXT_CHECK(seed_tensor->device() == x.device() && seed_tensor->scalar_type() == at::kLong &&
                  seed_tensor->numel() == 1,
              "nvfp4_qdq: seed_tensor must be one int64 value on x's device");
    seed_ptr = seed_tensor->data_ptr<int64_t>();
  }
  EXT_CHECK(axis != 2 || !stochastic, "nvfp4_qdq: 16x16 tiles take round-to-nearest only");
  EXT_CHECK(rule >= 0 && rule <= 2, "nvfp4_qdq: rule must be 0 (mse), 1 (mae) or 2 (abs_max)");
  const torch::Tensor a = amax.has_value() ? amax->contiguous() : nvfp4_amax(x, signs, axis);
  EXT_CHECK(a.is_cuda() && a.scalar_type() == at::kFloat && a.numel() == 1,
            "nvfp4_qdq: amax must be one fp32 value on the GPU");
  const int dtype = dtype_code(x, "nvfp4_qdq");
  const at::cuda::CUDAGuard guard(x.device());
  const int64_t r = x.size(0), c = x.size(1), rp = axis == 0 ? (r + 15) / 16 * 16 : r;
  auto out = torch::empty({rp, c}, x.options().dtype(at::kBFloat16));
  auto g_dec = torch::empty({}, x.options().dtype(at::kFloat));
  surogate::launch_nvfp4_qdq(x.data_ptr(), dtype, signs_ptr(signs), reinterpret_cast<const unsigned*>(a.data_ptr<float>()),
                             out.data_ptr(), g_dec.data_ptr<float>(), r, c, (int)axis, four_over_six, (int)rule,
                             stochastic, seed, seed_ptr, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, g_dec};
}

// cast((a @ b) * (ga * gb) + bias, out_dtype) for bf16 operands a [M, K], b [K, N] (any strides): cuBLAS with fp32
// output, then one epilogue pass (in place for fp32).
torch::Tensor nvfp4_gemm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& ga, const torch::Tensor& gb,
                         const c10::optional<torch::Tensor>& bias, at::ScalarType out_dtype) {
  EXT_CHECK(a.is_cuda() && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "nvfp4_gemm: a [M, K] and b [K, N] expected");
  EXT_CHECK(ga.scalar_type() == at::kFloat && ga.numel() == 1 && gb.scalar_type() == at::kFloat && gb.numel() == 1,
            "nvfp4_gemm: the globals must be one fp32 value each");
  const at::cuda::CUDAGuard guard(a.device());
  torch::Tensor acc = at::mm(a, b, at::kFloat);
  if (!acc.is_contiguous()) acc = acc.contiguous();
  const int64_t m = acc.size(0), n = acc.size(1);
  torch::Tensor out = out_dtype == at::kFloat ? acc : torch::empty({m, n}, acc.options().dtype(out_dtype));
  torch::Tensor bias_c;
  if (bias.has_value()) {
    EXT_CHECK(bias->numel() == n, "nvfp4_gemm: bias must have N = ", n, " entries");
    bias_c = bias->contiguous();
  }
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  surogate::launch_nvfp4_scale_bias_cast(acc.data_ptr<float>(), ga.contiguous().data_ptr<float>(),
                                         gb.contiguous().data_ptr<float>(), bias_c.defined() ? bias_c.data_ptr() : nullptr,
                                         bias_c.defined() ? dtype_code(bias_c, "nvfp4_gemm") : 0, out.data_ptr(),
                                         dtype_code(out, "nvfp4_gemm"), m, n, sms, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// y [M, N] = x [M, K] @ deq(W)^T for a 4-bit weight W [N, K] and few tokens (1 <= M <= 64), x bf16: fmt 0 NVFP4
// (w uint8 [N, K/2], scales E4M3 [N, K/16], gscale its decode global), 1 MXFP4 (scales E8M0 [N, K/32]), 2 NF4
// (w bitsandbytes-packed, N * K / 2 bytes; scales the fp32 absmax per nf4_block elements; levels its 16 values).
// K % 32 == 0 and NF4 blocks a power of two >= 32 (surogate_hf.kernels.paths.few_token_kernel decides; it checks these).
// A large weight at 33-64 tokens (a wide one from 17) on an SM90a build runs the mixed-input WGMMA kernel instead
// (few_token_wgmma_applies; kernels.paths.few_token_wgmma): the same sums, within the same one bf16 rounding.
// SUROGATE_HF_FEW_TOKEN_SPLIT: the few-token launches' K split forced to 1-8 CTAs a tile (at most one per K step), to
// measure their rule against the alternatives (benchmarks/probe_few_token_split.py); unset, empty or 0: the rule.
// Read per call (a getenv: well under the call's host time), so that one process can time several.
static int forced_few_token_split() {
  const char* v = std::getenv("SUROGATE_HF_FEW_TOKEN_SPLIT");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long split = std::strtol(v, &end, 10);
  EXT_CHECK(*end == '\0' && split >= 0 && split <= surogate::kMixedInputMaxSplit,
            "SUROGATE_HF_FEW_TOKEN_SPLIT must be an integer from 0 (the launch's own rule) to ",
            surogate::kMixedInputMaxSplit, ", got '", v, "'");
  return (int)split;
}

torch::Tensor few_token_gemm(const torch::Tensor& x_in, const torch::Tensor& w, const torch::Tensor& scales,
                             const c10::optional<torch::Tensor>& gscale, const c10::optional<torch::Tensor>& levels,
                             int64_t fmt, int64_t n, int64_t k, int64_t nf4_block) {
  EXT_CHECK(x_in.is_cuda() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
            "few_token_gemm: x must be a 2-D bf16 CUDA tensor");
  EXT_CHECK(fmt >= 0 && fmt <= 2, "few_token_gemm: fmt must be 0 (nvfp4), 1 (mxfp4) or 2 (nf4)");
  const int64_t m = x_in.size(0);
  EXT_CHECK(x_in.size(1) == k && k % 32 == 0 && m >= 1 && m <= 64,
            "few_token_gemm: x [M <= 64, K] with K % 32 == 0 expected, got ", x_in.sizes(), " for K = ", k);
  EXT_CHECK(w.is_cuda() && w.is_contiguous() && w.element_size() == 1 && w.numel() == n * k / 2 &&
                reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
            "few_token_gemm: w must hold N * K / 2 contiguous bytes, 16-byte aligned");
  const int64_t scale_count = fmt == 0 ? n * k / 16 : fmt == 1 ? n * k / 32 : n * k / std::max<int64_t>(nf4_block, 1);
  EXT_CHECK(scales.is_cuda() && scales.is_contiguous() && scales.numel() == scale_count &&
                scales.element_size() == (fmt == 2 ? 4 : 1),
            "few_token_gemm: scales must be ", scale_count, " contiguous ", fmt == 2 ? "fp32" : "one-byte", " values");
  EXT_CHECK(fmt != 0 || (gscale.has_value() && gscale->scalar_type() == at::kFloat && gscale->numel() == 1),
            "few_token_gemm: NVFP4 needs its fp32 decode global");
  EXT_CHECK(fmt != 2 || (nf4_block >= 32 && (nf4_block & (nf4_block - 1)) == 0 && k % nf4_block == 0 && levels.has_value() &&
                         levels->scalar_type() == at::kFloat && levels->numel() == 16 && levels->is_contiguous()),
            "few_token_gemm: NF4 needs blocks that are a power of two >= 32 dividing K, and 16 fp32 levels");
  const torch::Tensor x = aligned_operand(x_in);
  const at::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({m, n}, x.options());
  if (n == 0) return y;
  const torch::Tensor g = fmt == 0 ? gscale->to(x.device()).contiguous() : torch::Tensor();
  const int dev = x.get_device();
  const int forced_split = forced_few_token_split();
  if (surogate::few_token_wgmma_applies((int)fmt, m, n, k) && surogate::mixed_input_gemm_supported(dev)) {
    // a large weight at 33-64 tokens, a wide one from 17: the WGMMA kernel decodes each fragment once for all the tokens
    const cudaError_t err = surogate::launch_mixed_input_gemm_few_tokens(
        (int)fmt, x.data_ptr(), reinterpret_cast<const uint8_t*>(w.data_ptr()),
        reinterpret_cast<const uint8_t*>(scales.data_ptr()), fmt == 0 ? g.data_ptr<float>() : nullptr,
        fmt == 2 ? levels->data_ptr<float>() : nullptr, (int)nf4_block, y.data_ptr(), (int)m, (int)n, (int)k, dev,
        forced_split, at::cuda::getCurrentCUDAStream());
    if (err != cudaSuccess) (void)cudaGetLastError();
    EXT_CHECK(err == cudaSuccess, "few_token_gemm: WGMMA launch failed: ", cudaGetErrorString(err));
    return y;
  }
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cudaError_t err = surogate::launch_few_token_gemm(
      (int)fmt, x.data_ptr(), reinterpret_cast<const uint8_t*>(w.data_ptr()),
      fmt == 2 ? nullptr : reinterpret_cast<const uint8_t*>(scales.data_ptr()),
      fmt == 2 ? scales.data_ptr<float>() : nullptr, fmt == 2 ? levels->data_ptr<float>() : nullptr,
      fmt == 0 ? g.data_ptr<float>() : nullptr, y.data_ptr(), (int)m, (int)n, (int)k, (int)nf4_block, sms, forced_split,
      at::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) (void)cudaGetLastError();  // a failed launch must not fail the next kernel's check too
  EXT_CHECK(err == cudaSuccess, "few_token_gemm: launch failed: ", cudaGetErrorString(err));
  return y;
}

// y [M, N] = x [M, K] @ deq(W)^T for an NVFP4 / MXFP4 / NF4 weight W [N, K] and x bf16, any M (the many-token
// kernels, csrc/weight_only/mixed_input_gemm.cu; SM90a only). fmt 0 NVFP4 (w uint8 [N, K/2], scales E4M3 [N, K/16],
// gscale its decode global), 1 MXFP4 (scales E8M0 [N, K/32]), 2 NF4 (w bitsandbytes-packed; scales the fp32 absmax per
// nf4_block elements, or their one-byte codes with nested_absmax / nested_code / nested_offset; levels its 16
// values; blocks a power of two >= 32 dividing K). K % 32 == 0 (surogate_hf.kernels.paths.mixed_input_kernel decides).
torch::Tensor mixed_input_gemm(const torch::Tensor& x_in, const torch::Tensor& w, const torch::Tensor& scales,
                               const c10::optional<torch::Tensor>& gscale, const c10::optional<torch::Tensor>& levels,
                               int64_t fmt, int64_t n, int64_t k, int64_t nf4_block,
                               const c10::optional<torch::Tensor>& nested_absmax,
                               const c10::optional<torch::Tensor>& nested_code,
                               const c10::optional<torch::Tensor>& nested_offset) {
  EXT_CHECK(x_in.is_cuda() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
            "mixed_input_gemm: x must be a 2-D bf16 CUDA tensor");
  EXT_CHECK(fmt >= 0 && fmt <= 2, "mixed_input_gemm: fmt must be 0 (nvfp4), 1 (mxfp4) or 2 (nf4)");
  EXT_CHECK(x_in.size(1) == k && k % 32 == 0 && k > 0 && n >= 0 && x_in.size(0) <= INT_MAX && n <= INT_MAX &&
                k <= INT_MAX,
            "mixed_input_gemm: x [M, K] with K % 32 == 0 expected, got ", x_in.sizes(), " for K = ", k);
  EXT_CHECK(w.is_cuda() && w.is_contiguous() && w.element_size() == 1 && w.numel() == n * k / 2 &&
                reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
            "mixed_input_gemm: w must hold N * K / 2 contiguous bytes, 16-byte aligned");
  const bool nested = nested_code.has_value();
  EXT_CHECK(nested == nested_absmax.has_value() && nested == nested_offset.has_value() && (!nested || fmt == 2),
            "mixed_input_gemm: nested_absmax, nested_code and nested_offset go together, for nf4 only");
  const int64_t scale_count = fmt == 0 ? n * k / 16 : fmt == 1 ? n * k / 32 : n * k / std::max<int64_t>(nf4_block, 1);
  const int64_t scale_bytes = fmt == 2 && !nested ? 4 : 1;
  EXT_CHECK(scales.is_cuda() && scales.is_contiguous() && scales.numel() == scale_count &&
                scales.element_size() == scale_bytes,
            "mixed_input_gemm: scales must be ", scale_count, " contiguous ", scale_bytes == 4 ? "fp32" : "one-byte",
            " values");
  EXT_CHECK(fmt != 0 || (gscale.has_value() && gscale->scalar_type() == at::kFloat && gscale->numel() == 1),
            "mixed_input_gemm: NVFP4 needs its fp32 decode global");
  auto fp32_on = [&](const c10::optional<torch::Tensor>& t, int64_t count) {
    return t.has_value() && t->is_cuda() && t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == count;
  };
  EXT_CHECK(fmt != 2 || (nf4_block >= 32 && (nf4_block & (nf4_block - 1)) == 0 && k % nf4_block == 0 &&
                         fp32_on(levels, 16)),
            "mixed_input_gemm: NF4 needs blocks that are a power of two >= 32 dividing K, and 16 fp32 levels on the "
            "GPU");
  EXT_CHECK(!nested || (fp32_on(nested_absmax, (scale_count + 255) / 256) && fp32_on(nested_code, 256) &&
                        fp32_on(nested_offset, 1)),
            "mixed_input_gemm: a double-quantized NF4 absmax needs the fp32 nested absmax of each 256 blocks, the 256 "
            "fp32 nested code values and the fp32 offset, on the GPU");
  const torch::Tensor x = aligned_operand(x_in);
  const at::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  EXT_CHECK(surogate::mixed_input_gemm_supported(dev),
            "mixed_input_gemm: needs a compute capability 9.0 GPU and an extension built for sm_90a "
            "(surogate_hf.kernels.ext builds it so unless TORCH_CUDA_ARCH_LIST names other targets)");
  auto y = torch::empty({x.size(0), n}, x.options());
  if (n == 0 || x.size(0) == 0) return y;
  const torch::Tensor g = fmt == 0 ? gscale->to(x.device()).contiguous() : torch::Tensor();
  auto f32 = [](const c10::optional<torch::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; };
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cudaError_t err = surogate::launch_mixed_input_gemm(
      (int)fmt, x.data_ptr(), reinterpret_cast<const uint8_t*>(w.data_ptr()),
      reinterpret_cast<const uint8_t*>(scales.data_ptr()), fmt == 0 ? g.data_ptr<float>() : nullptr,
      fmt == 2 ? f32(levels) : nullptr, (int)nf4_block, f32(nested_absmax), f32(nested_code), f32(nested_offset),
      y.data_ptr(), (int)x.size(0), (int)n, (int)k, false, sms, dev, at::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) (void)cudaGetLastError();
  EXT_CHECK(err == cudaSuccess, "mixed_input_gemm: launch failed: ", cudaGetErrorString(err));
  return y;
}

// CUDA kernels of the surogate::ext_* ops. Their schemas, fake kernels and reference (CPU) kernels are declared in
// Python (surogate_hf/ops/ext.py), which the package imports before this library can be loaded; torch.compile
// graphs call them with no Python in between. A failed check raises a RuntimeError with its numbers (EXT_CHECK: a
// TORCH_CHECK whose message streamed a number ended the process instead, common/check.h says why).
TORCH_LIBRARY_IMPL(surogate, CUDA, m) {
  m.impl("ext_fp8_cast_amax", &fp8_cast_amax);
  m.impl("ext_fp8_cast_transpose_amax", &fp8_cast_transpose_amax);
  m.impl("ext_fp8_quantize_tiles", &fp8_quantize_tiles);
  m.impl("ext_transpose_bytes", &transpose_bytes);
  m.impl("ext_fp8_block_gemm", &fp8_block_gemm);
  m.impl("ext_nvfp4_amax", &nvfp4_amax);
  m.impl("ext_nvfp4_qdq", &nvfp4_qdq);
  m.impl("ext_nvfp4_gemm", &nvfp4_gemm);
  m.impl("ext_few_token_gemm", &few_token_gemm);
  m.impl("ext_mixed_input_gemm", &mixed_input_gemm);
}
