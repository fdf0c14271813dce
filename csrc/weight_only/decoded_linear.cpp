// The decode + cuBLAS route of a frozen quantized linear as dispatcher ops with their autograd in C++:
//
//   surogate::ext_dequantize(w, scales, gscale?, levels?, fmt, n, k, block, dtype) -> W [n, k]
//   surogate::ext_decoded_linear(x, x_lora?, w, scales, gscale?, levels?, bias?, lora_a?, lora_b?, scaling, fmt, n, k,
//                                block) -> y = x deq(W)^T (+ bias) (+ scaling * (x_lora A^T) B^T)
//   surogate::ext_decoded_linear_fwd / ext_decoded_linear_bwd: the same forward (returning the adapter's h too) and
//                                backward as two plain ops, for torch.compile graphs (see below)
//   surogate::ext_registered_linear_fwd / _bwd(x, ..., w, ..., n, k): the same two ops taking the codes alone, the rest
//                                of the weight's operands registered for them once (ext_decode_registry_set / _release)
//
// Why C++: at a small model's widths a layer's GEMMs take a few microseconds, so the step is bound by the host work per
// layer. As a Python autograd.Function with a Triton decode, one frozen quantized linear (plus its LoRA adapter) cost
// several times the host time of PEFT's bf16 lora.Linear per forward + backward. Here one dispatcher call does the
// decode, the GEMMs and the adapter in the forward, and the backward runs without Python (or the GIL) at all.
// The weight is decoded again for the input gradient, never kept: QLoRA's memory stays the packed weight.
// Math (the Python reference, surogate_hf/ops/ext.py, states it too):
//   forward   y = addmm(bias, x, W^T) (mm without a bias); with an adapter h = mm(x_lora, A^T),
//             y = addmm(bias, h, B^T, alpha=scaling) (beta 0 without a bias), then y = addmm(y, x, W^T)
//   backward  dh = scaling * mm(dy, B); dx = mm(dy, W), or with x_lora being x dx = addmm(mm(dh, A), dy, W);
//             dA = mm(dh^T, x_lora); dB = scaling * mm(dy^T, h), each cast to its parameter's dtype
// (scaling is the GEMM's alpha and the bias its epilogue: one kernel each, no separate pass over the output)
// A and B are cast to x's dtype (the adapters' masters may be fp32), as the Python LoRA path does.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <algorithm>
#include <climits>
#include <mutex>
#include <unordered_map>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/torch.h>
#include "mixed_input_gemm.h"
#include "../common/check.h"

namespace surogate {
void launch_decode_weight(int fmt, const uint8_t* w, const uint8_t* scales_u8, const float* scales_f32,
                          const float* gscale, const float* levels, const float* nested_absmax,
                          const float* nested_code, const float* nested_offset, void* out, int out_dtype, int64_t n,
                          int64_t k, int block, int sms, cudaStream_t stream);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int out_dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: EXT_CHECK(false, "ext_dequantize: dtype must be fp32, bf16 or fp16, got ", t);
  }
  return -1;
}

// NF4 double quantization's operands (all three or none): the fp32 second-level absmax [ceil(blocks / 256)], its 256
// fp32 code values and the fp32 offset; the first-level absmax (`scales`) is then one-byte codes. A compiled graph and
// the eager plan hand them over as the module stores them: the decode de-nests per block, so no graph kernel de-nests
// the absmax per call and no fp32 copy is kept.
struct Nested {
  at::Tensor absmax, code, offset;
  bool defined() const { return absmax.defined(); }
};

const at::Tensor& or_undef(const c10::optional<at::Tensor>& t);

Nested nested_of(const c10::optional<at::Tensor>& absmax, const c10::optional<at::Tensor>& code,
                 const c10::optional<at::Tensor>& offset) {
  EXT_CHECK(absmax.has_value() == code.has_value() && code.has_value() == offset.has_value(),
            "ext_decoded_linear: nested_absmax, nested_code and nested_offset go together");
  return {or_undef(absmax), or_undef(code), or_undef(offset)};
}

// The caller (surogate_hf.nn.linear, building a layer's plan) validated the operands once; these checks guard misuse,
// for the dense decode and the mixed-input GEMM alike.
void check_weight_operands(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                           const c10::optional<at::Tensor>& levels, int64_t fmt, int64_t n, int64_t k, int64_t block,
                           const Nested& nested) {
  EXT_CHECK(fmt >= 0 && fmt <= 3, "ext_dequantize: fmt must be 0 (nvfp4), 1 (mxfp4), 2 (nf4) or 3 (fp8)");
  EXT_CHECK(w.is_cuda() && w.is_contiguous() && w.element_size() == 1 &&
                w.numel() == (fmt == 3 ? n * k : n * k / 2),
            "ext_dequantize: w must be contiguous one-byte CUDA data of the weight's size");
  const bool nested_nf4 = nested.defined();
  EXT_CHECK(!nested_nf4 || fmt == 2, "ext_dequantize: nested absmax operands are NF4's only");
  EXT_CHECK(scales.is_cuda() && scales.is_contiguous() &&
                scales.element_size() == (fmt >= 2 && !nested_nf4 ? 4 : 1),
            "ext_dequantize: scales must be contiguous (fp32 for nf4 / fp8, one byte for nvfp4 / mxfp4 and a "
            "double-quantized nf4 absmax)");
  // one scale per block, as kernels.registry.decode_operands counts them (a short tensor would be read past its end)
  const int64_t bl = std::max<int64_t>(block, 1);
  const int64_t scale_count =
      fmt == 0 ? n * k / 16 : fmt == 1 ? n * k / 32 : fmt == 2 ? n * k / bl : ((n + bl - 1) / bl) * ((k + bl - 1) / bl);
  EXT_CHECK(scales.numel() == scale_count, "ext_dequantize: scales must hold ", scale_count,
            " values for a [", n, ", ", k, "] weight in this format, got ", scales.numel());
  // fp32 operands may come as their int32 bytes (a quantized module's slot as stored: surogate_hf/nn/slots.py)
  auto fp32_bytes = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kInt; };
  EXT_CHECK(!nested_nf4 || (block >= 1 && nested.absmax.is_cuda() &&
                            nested.absmax.is_contiguous() && fp32_bytes(nested.absmax) &&
                            nested.absmax.numel() == (scales.numel() + 255) / 256 && nested.code.is_cuda() &&
                            nested.code.is_contiguous() && fp32_bytes(nested.code) && nested.code.numel() == 256 &&
                            nested.offset.is_cuda() && fp32_bytes(nested.offset) && nested.offset.numel() == 1),
            "ext_dequantize: a double-quantized nf4 absmax needs one code byte per block, the fp32 nested absmax of "
            "each 256 blocks, the 256 fp32 nested code values and the fp32 offset, on the GPU");
  EXT_CHECK(fmt != 0 || (gscale.has_value() && gscale->is_cuda() && fp32_bytes(*gscale) && gscale->numel() == 1),
            "ext_dequantize: nvfp4 needs its fp32 decode global on the GPU");
  EXT_CHECK(fmt != 2 || (levels.has_value() && levels->is_cuda() && levels->is_contiguous() && fp32_bytes(*levels) &&
                         levels->numel() == 16 && block >= 1),
            "ext_dequantize: nf4 needs its 16 fp32 levels and a block size");
}

at::Tensor dequantize_weight(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                             const c10::optional<at::Tensor>& levels, int64_t fmt, int64_t n, int64_t k, int64_t block,
                             at::ScalarType dtype, const Nested& nested = {}) {
  check_weight_operands(w, scales, gscale, levels, fmt, n, k, block, nested);
  const bool nested_nf4 = nested.defined();
  const int code = out_dtype_code(dtype);
  const at::cuda::CUDAGuard guard(w.device());
  auto out = at::empty({n, k}, w.options().dtype(dtype));
  const bool u8_scales = fmt <= 1 || nested_nf4;
  auto f32 = [&](const at::Tensor& t) { return nested_nf4 ? static_cast<const float*>(t.const_data_ptr()) : nullptr; };
  surogate::launch_decode_weight(
      (int)fmt, reinterpret_cast<const uint8_t*>(w.data_ptr()),
      u8_scales ? reinterpret_cast<const uint8_t*>(scales.data_ptr()) : nullptr,
      u8_scales ? nullptr : reinterpret_cast<const float*>(scales.data_ptr()),
      fmt == 0 ? static_cast<const float*>(gscale->const_data_ptr()) : nullptr,
      fmt == 2 ? static_cast<const float*>(levels->const_data_ptr()) : nullptr, f32(nested.absmax),
      f32(nested.code), f32(nested.offset), out.data_ptr(), code, n, k, (int)block,
      at::cuda::getCurrentDeviceProperties()->multiProcessorCount, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ext_dequantize (no nested operands: its callers pass an NF4 absmax de-nested)
at::Tensor dequantize_op(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                         const c10::optional<at::Tensor>& levels, int64_t fmt, int64_t n, int64_t k, int64_t block,
                         at::ScalarType dtype) {
  return dequantize_weight(w, scales, gscale, levels, fmt, n, k, block, dtype);
}

c10::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; }

struct Operands {
  at::Tensor w, scales, gscale, levels;
  int64_t fmt, n, k, block;
  Nested nested = {};
  at::Tensor decode(at::ScalarType dtype) const {
    return dequantize_weight(w, scales, opt(gscale), opt(levels), fmt, n, k, block, dtype, nested);
  }
  void check() const { check_weight_operands(w, scales, opt(gscale), opt(levels), fmt, n, k, block, nested); }
};

// How ATen hands a row-major [R, C] operand to column-major cuBLAS (prepare_matrix_for_cublas): a contiguous one is
// its own transpose there ('n', ld = stride(0)), a transposed view is itself ('t', ld = stride(1)). ok is false for any
// other layout (the caller then goes through aten).
struct BlasOperand {
  char trans;
  int64_t ld;
  bool ok;
};

// That operand for a 2-D view with these sizes and strides (is_contiguous as ATen computes it: size-1 dims skipped)
BlasOperand blas_layout(int64_t size0, int64_t size1, int64_t stride0, int64_t stride1) {
  const bool contiguous = size0 == 0 || size1 == 0 ||
                          ((size1 == 1 || stride1 == 1) && (size0 == 1 || stride0 == (size1 == 1 ? 1 : size1)));
  if (contiguous) return {'n', stride0, stride0 >= 1};
  if (stride0 == 1 && stride1 >= std::max<int64_t>(1, size0)) return {'t', stride1, true};
  if (stride1 == 1 && stride0 >= std::max<int64_t>(1, size1)) return {'n', stride0, true};
  return {'n', 0, false};
}

// A logical 2-D GEMM operand: a tensor's [r0, c0] view with strides (s0, s1), or its transpose (flipped), described
// without ATen view ops. The route's ops made ~10 views and no-op casts per forward and ~15 per backward; without them
// (and with one cuBLAS handle per call) an op call takes 6-10% less host time against PEFT's calls, which is what a
// small model's step is bound by (results/host/compiled_host_and_op_args_2c10e45_h100.md). blas() is blas_layout of
// the view it stands for, so cuBLAS gets the arguments the view would have given it; only the aten fallback builds the
// view (tensor()).
struct Mat {
  at::Tensor src;
  int64_t r0 = 0, c0 = 0, s0 = 0, s1 = 0;  // the view as made, before any t()
  bool flipped = false;                    // t() applied (an odd number of times)
  int64_t rows() const { return flipped ? c0 : r0; }
  int64_t cols() const { return flipped ? r0 : c0; }
  Mat t() const { return {src, r0, c0, s0, s1, !flipped}; }
  BlasOperand blas() const {
    if (src.is_conj() || src.is_neg()) return {'n', 0, false};
    return flipped ? blas_layout(c0, r0, s1, s0) : blas_layout(r0, c0, s0, s1);
  }
  at::Tensor tensor() const {  // the view itself (the aten fallback's operand)
    const bool as_made = src.dim() == 2 && src.size(0) == r0 && src.size(1) == c0 && src.stride(0) == s0 &&
                         src.stride(1) == s1;
    const at::Tensor v = as_made ? src : src.as_strided({r0, c0}, {s0, s1});
    return flipped ? v.t() : v;
  }
};

// A 2-D tensor as it is
Mat mat(const at::Tensor& t) {
  EXT_CHECK(t.dim() == 2, "ext_decoded_linear: a GEMM operand must be 2-D, got ", t.sizes());
  return {t, t.size(0), t.size(1), t.stride(0), t.stride(1), false};
}

// A tensor of any rank as [numel / cols, cols], as t.reshape({-1, cols}) views it (x [..., k] as the GEMM's [M, k]):
// a contiguous one without the view op
Mat rows_of(const at::Tensor& t, int64_t cols) {
  if (t.dim() == 2 && t.size(1) == cols) return mat(t);
  if (cols > 0 && t.is_contiguous()) return {t, t.numel() / cols, cols, cols, 1, false};
  return mat(t.reshape({-1, cols}));
}

// t itself when it already has dtype dt (no dispatcher call for the no-op cast), else t.to(dt)
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dt) { return t.scalar_type() == dt ? t : t.to(dt); }

// The option's value "reduced-precision reductions allowed": a bool in older torch, CuBLASReductionOption's first value
// (AllowReducedPrecisionWithSplitK, torch's default) in newer.
template <typename Option>
bool reduced_precision_allowed(Option v) {
  if constexpr (std::is_same_v<Option, bool>) return v;
  else return static_cast<int>(v) == 0;
}

// Whether ATen's GEMM of this dtype is the plain cuBLAS call below: cuBLAS (not cuBLASLt) preferred, and the default
// reduction setting (cublasGemmEx under CUBLAS_DEFAULT_MATH; the other settings add math flags this does not copy).
// Not covered: TunableOp (torch.cuda.tunable), whose tuned GEMM ATen would take instead; these GEMMs keep cuBLAS's.
bool cublas_gemm_matches_aten(at::ScalarType dt) {
  auto& ctx = at::globalContext();
  // (under deterministic algorithms the aten call runs: it checks CUBLAS_WORKSPACE_CONFIG, and raises without it)
  if (ctx.blasPreferredBackend() != at::BlasBackend::Cublas || ctx.deterministicAlgorithms()) return false;
  if (dt == at::kBFloat16) return reduced_precision_allowed(ctx.allowBF16ReductionCuBLAS());
  if (dt == at::kHalf) return reduced_precision_allowed(ctx.allowFP16ReductionCuBLAS());
  return false;
}

// One op call's GEMM context: whether its dtype's GEMMs are the direct cuBLAS call, and then the handle, fetched once
// (at::cuda::getCurrentCUDABlasHandle binds the current stream and torch's workspace to it on every call; an op's
// GEMMs all run on one stream). The math mode is set per GEMM: an aten fallback in between may change it.
struct Blas {
  at::ScalarType dt;
  bool direct;
  cublasHandle_t handle;
  explicit Blas(at::ScalarType dtype)
      : dt(dtype), direct(cublas_gemm_matches_aten(dtype)),
        handle(direct ? at::cuda::getCurrentCUDABlasHandle() : nullptr) {}
};

// out (contiguous, holding [M, N]) = alpha * a [M, K] @ b [K, N] + beta * out, as at::addmm_out(out, out, a, b, beta,
// alpha) computes it, minus its dispatch: the cublasGemmEx call ATen makes for a bf16 / fp16 GEMM (at::cuda::blas::gemm
// is not exported), with the same arguments: row-major out is column-major out^T = b^T a^T, fp32 compute, the default
// tensor-op algorithm, leading dimensions adjusted as ATen's _cublasAdjustLdLevel3 does. So the same kernel and bits
// (the GPU tests compare against torch.addmm bit for bit). At a small model's widths a GEMM takes a few microseconds of
// GPU time and its aten call as many of host time, and this route makes eight per LoRA linear per step. Other
// layouts, dtypes or settings go through aten (beta 0: out is never read).
void gemm_into(const at::Tensor& out, const Mat& a, const Mat& b, double alpha, double beta, const Blas& blas) {
  // (aten checks these itself; cuBLAS would read out of bounds)
  EXT_CHECK(a.cols() == b.rows() && out.numel() == a.rows() * b.cols(),
            "ext_decoded_linear: GEMM operands of mismatched shapes [", a.rows(), ", ", a.cols(), "] @ [", b.rows(),
            ", ", b.cols(), "] -> ", out.sizes(), " (an adapter or input whose width is not the layer's?)");
  const int64_t m = b.cols(), n = a.rows(), k = a.cols();  // of the column-major product out^T [N, M]
  const auto dt = out.scalar_type();
  const BlasOperand ab = a.blas(), bb = b.blas();
  const bool direct = blas.direct && blas.dt == dt && ab.ok && bb.ok && m > 0 && n > 0 && k > 0 &&
                      out.is_contiguous() && a.src.scalar_type() == dt && b.src.scalar_type() == dt &&
                      m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && ab.ld <= INT_MAX && bb.ld <= INT_MAX;
  if (!direct) {
    at::Tensor o = out.dim() == 2 ? out : out.view({a.rows(), b.cols()});
    at::addmm_out(o, o, a.tensor(), b.tensor(), beta, alpha);
    return;
  }
  int64_t lda = bb.ld, ldb = ab.ld, ldc = m;
  const bool ta = bb.trans == 't', tb = ab.trans == 't';
  if (n <= 1) ldc = std::max<int64_t>(m, 1);
  if (ta ? m <= 1 : k <= 1) lda = std::max<int64_t>(ta ? k : m, 1);
  if (tb ? k <= 1 : n <= 1) ldb = std::max<int64_t>(tb ? n : k, 1);
  const cudaDataType_t type = dt == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float falpha = static_cast<float>(alpha), fbeta = static_cast<float>(beta);
  EXT_CUBLAS_CHECK(cublasSetMathMode(blas.handle, CUBLAS_DEFAULT_MATH));
  EXT_CUBLAS_CHECK(cublasGemmEx(blas.handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                (int)m, (int)n, (int)k, &falpha, b.src.const_data_ptr(), type, (int)lda,
                                a.src.const_data_ptr(), type, (int)ldb, &fbeta, out.mutable_data_ptr(), type,
                                (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
}

// alpha * (a @ b) as one GEMM into a fresh [M, N] (beta 0: the uninitialised output is never read); `shape`: the
// output's sizes when not [M, N] (a caller's [..., N])
at::Tensor scaled_mm(const Mat& a, const Mat& b, double alpha, const Blas& blas, at::IntArrayRef shape = {}) {
  const std::array<int64_t, 2> mn{a.rows(), b.cols()};
  at::Tensor out = at::empty(shape.empty() ? at::IntArrayRef(mn) : shape, a.src.options().dtype(blas.dt));
  gemm_into(out, a, b, alpha, 0.0, blas);
  return out;
}

at::Tensor gemm(const Mat& a, const Mat& b, const Blas& blas, at::IntArrayRef shape = {}) {
  return scaled_mm(a, b, 1.0, blas, shape);
}

// The forward's base GEMM as the mixed-input kernel (csrc/weight_only/mixed_input_gemm.cu: the weight decoded inside
// the GEMM, no dense pass) rather than decode + cuBLAS. Where it can run (NVFP4 / MXFP4 / NF4 with blocks a power of
// two >= 32 dividing K, bf16 x of at least kMixedInputMinTokens rows (this route's 4-bit calls all have >= 512:
// kernels.paths.DENSE_MIN_TOKENS), K % 32 == 0, 16-byte aligned operands, an SM90a build on a cc 9.0 GPU), it is
// - the default for NVFP4 / MXFP4 weights of at least kMixedInputDefaultMinElements (kMixedInputWholeKMinElements
//   where its tiles split no K) at up to kMixedInputDefaultMaxTokens rows where its 256-token tiles fill the GPU well
//   enough to be the faster. On the large weights of the Llama-3.1-8B and Qwen3-1.7B shapes it ran at
//   kMixedInputSpeed x bf16 cuBLAS's speed at full waves, and decode + cuBLAS took bf16's time x (1 +
//   kRouteDecodeTokens / rows) (its decode 0.43x a 512-row GEMM's time, 0.11x a 2048-row one's); so it is taken
//   where kMixedInputSpeed x its fill (mixed_input_fill: CTAs over whole waves) x (1 + kRouteDecodeTokens / rows) >=
//   1. Measured there: 0.97-1.35x decode + cuBLAS's speed
//   (Llama-3.1-8B q / o / gate / up / down, Qwen3-1.7B gate / up / down at 512-2048 tokens; H200;
//   benchmarks/results/decode/large_m_default_s28_h200.md, large_m_rs_split_first_form_h200.md). The fill leaves out
//   the one loss among those rows, the 1.7B gate / up at 1024 tokens (0.93x: 192 CTAs, a fill of 0.73). It also
//   runs where each CTA has at least kMixedInputLongSteps stages and the fill is at least kMixedInputLongFill: long
//   runs amortize a tile's pipeline fill and epilogue, and the fill model undersold them. Qwen2.5-7B q / down at
//   1024-2048 tokens (a fill of 0.85, 56 / 296 stages) measured 1.01-1.15x decode + cuBLAS's speed where the model
//   said 0.91-1.0; every measured row of shorter runs at such fills (Qwen2.5-1.5B and Gemma-2-2B gate / up at 2048
//   tokens: 24 / 36 stages) was 0.89-0.97x (H200, large_m_default_rule_models_h200.md);
// - off elsewhere, where it measured 0.43-1.18x (smaller weights, 4096 and more rows, NF4), unless
//   SUROGATE_HF_MIXED_INPUT=1 opts every call that can run it in; SUROGATE_HF_MIXED_INPUT=0 turns it off everywhere.
//   Host-bound steps gain nothing from it either: taking it by default for every call of <= 2^33 multiply-adds outside
//   CUDA-graph capture (1c62d8f) read 107k tok/s against decode + cuBLAS's 114k on a compiled SmolLM2-135M step without
//   CUDA graphs, medians of five interleaved rounds in one process (PEFT 110k; H200, session 40,
//   benchmarks/results/host/host_bound_default_ab_s40.md), so it was reverted.
// The speed test and its constants are mixed_input_fast_enough in mixed_input_gemm.h.
// surogate_hf.kernels.paths.mixed_input_kernel states the same rule. (The variable is read per call, as the Python
// rule reads it.)
constexpr int64_t kMixedInputMinTokens = 512;
constexpr int64_t kMixedInputDefaultMaxTokens = 2048;
constexpr int64_t kMixedInputDefaultMinElements = 12 << 20;
// Smaller weights whose launch splits no K (session 33: the Qwen3-1.7B q projection at 2048 tokens, 1.06-1.08x decode
// + cuBLAS's speed; at 512-1024 tokens such weights took K-split or 128-token tiles and lost 0.68-0.93x)
constexpr int64_t kMixedInputWholeKMinElements = 4 << 20;

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// (the operands' sizes and dtypes are check_weight_operands', which the mixed-input path runs too: this is the rule)
// x: the GEMM's input of m rows (any rank, [..., k])
bool mixed_input_applies(const at::Tensor& x, int64_t m, const Operands& op) {
  const char* opt = std::getenv("SUROGATE_HF_MIXED_INPUT");
  const std::string choice = opt != nullptr ? std::string(opt) : std::string();
  EXT_CHECK(choice.empty() || choice == "0" || choice == "1", "SUROGATE_HF_MIXED_INPUT=", choice,
            ": expected 1 (the mixed-input kernel wherever it can run), 0 (never: decode + cuBLAS) or unset (the "
            "default rule, surogate_hf.kernels.paths.mixed_input_kernel)");
  // (the size and speed tests last: they read the cached device properties)
  auto sms = [] { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; };
  auto whole_k = [&] {
    return surogate::mixed_input_tiles(m, op.n, op.k, sms(), [](int, long long) { return true; }).split == 1;
  };
  const bool by_default = op.fmt <= 1 && m >= kMixedInputMinTokens && m <= kMixedInputDefaultMaxTokens &&
                          (op.n * op.k >= kMixedInputDefaultMinElements ||
                           (op.n * op.k >= kMixedInputWholeKMinElements && whole_k())) &&
                          surogate::mixed_input_fast_enough(m, op.n, op.k, sms());
  const bool enabled = choice == "1" || (choice != "0" && by_default);
  const bool nf4_blocks_ok = op.block >= 32 && (op.block & (op.block - 1)) == 0 && op.k % op.block == 0;
  return enabled && (op.fmt <= 1 || (op.fmt == 2 && nf4_blocks_ok)) && x.scalar_type() == at::kBFloat16 &&
         m >= kMixedInputMinTokens &&
         m <= INT_MAX && op.n <= INT_MAX && op.k % 32 == 0 && x.is_contiguous() && aligned16(x) &&
         aligned16(op.w) && surogate::mixed_input_gemm_supported(x.get_device());
}

// y (contiguous, [M, n] as rows) (+)= x [M, k] (contiguous, any rank) @ deq(W)^T by the mixed-input kernel
// (accumulate: one rounding of y + the fp32 sum, as cuBLAS's beta = 1)
void mixed_input_into(at::Tensor& y, const at::Tensor& x, int64_t m, const Operands& op, bool accumulate) {
  EXT_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.numel() == m * op.n,
            "ext_decoded_linear: the mixed-input GEMM's output must be a contiguous bf16 [M, n]");
  const int dev = x.get_device();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // (fp32 operands may be their int32 bytes: the kernels read the bits)
  auto f32 = [](const at::Tensor& t) { return t.defined() ? static_cast<const float*>(t.const_data_ptr()) : nullptr; };
  const bool nf4 = op.fmt == 2;
  const cudaError_t err = surogate::launch_mixed_input_gemm(
      (int)op.fmt, x.const_data_ptr(), reinterpret_cast<const uint8_t*>(op.w.const_data_ptr()),
      reinterpret_cast<const uint8_t*>(op.scales.const_data_ptr()), op.fmt == 0 ? f32(op.gscale) : nullptr,
      nf4 ? f32(op.levels) : nullptr, (int)op.block, nf4 ? f32(op.nested.absmax) : nullptr,
      nf4 ? f32(op.nested.code) : nullptr, nf4 ? f32(op.nested.offset) : nullptr, y.mutable_data_ptr(), (int)m,
      (int)op.n, (int)op.k, accumulate, sms, dev, at::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) (void)cudaGetLastError();
  EXT_CHECK(err == cudaSuccess, "ext_decoded_linear: mixed-input GEMM launch failed: ", cudaGetErrorString(err));
}

// y [M, n] for x2 [M, k]; h (the adapter's [M, r] intermediate, needed by the backward) is set when lora_a is defined.
// With an adapter its GEMM runs first and the base GEMM last, accumulating (beta 1) onto the adapter's output: the
// rank-r GEMM is bound by the bytes of its [M, n] output, so it should only write it; the base GEMM, bound by its
// math, reads it in the epilogue at little cost. (The other order made the rank-r GEMM read and write y: a profiled
// compiled Qwen3-1.7B step spent ~16 ms of its 168 ms in those accumulating GEMMs.)
// The adapter's share of the forward, (+ bias) + scaling * (xl2 A^T) B^T, which the base GEMM then accumulates onto;
// h = xl2 A^T goes to *h_out. dt: x's dtype, which A, B and the bias are cast to. y_shape: y's sizes ([..., n]).
at::Tensor adapter_output(const Mat& xl2, const at::Tensor& bias, const at::Tensor& lora_a, const at::Tensor& lora_b,
                          double scaling, const Blas& blas, at::IntArrayRef y_shape, at::Tensor* h_out) {
  const auto dt = blas.dt;
  at::Tensor h = gemm(xl2, mat(as_dtype(lora_a, dt)).t(), blas);
  const Mat bt = mat(as_dtype(lora_b, dt)).t();
  at::Tensor y;
  if (bias.defined()) {
    y = at::addmm(as_dtype(bias, dt), h, bt.tensor(), 1.0, scaling);
    if (y.sizes() != y_shape) y = at::_unsafe_view(y, y_shape);
  } else {
    y = scaled_mm(mat(h), bt, scaling, blas, y_shape);
  }
  if (h_out) *h_out = h;
  return y;
}

// y [..., n] (y_shape) = x deq(W)^T (+ bias) (+ the adapter's share) for x [..., k] (its rows: [M, k])
at::Tensor forward_rows(const at::Tensor& x, const at::Tensor& x_lora, const Operands& op, const at::Tensor& bias,
                        const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling, at::IntArrayRef y_shape,
                        at::Tensor* h_out) {
  const auto dt = x.scalar_type();
  const Blas blas(dt);
  const Mat x2 = rows_of(x, op.k);
  const Mat xl2 = x_lora.defined() ? rows_of(x_lora, op.k) : x2;
  if (mixed_input_applies(x, x2.rows(), op)) {  // the same sums as below, without the dense weight
    op.check();
    at::Tensor y = lora_a.defined() ? adapter_output(xl2, bias, lora_a, lora_b, scaling, blas, y_shape, h_out)
                   : bias.defined() ? as_dtype(bias, dt).expand(y_shape).contiguous()
                                    : at::empty(y_shape, x.options());
    mixed_input_into(y, x, x2.rows(), op, lora_a.defined() || bias.defined());
    return y;
  }
  const Mat wt = mat(op.decode(dt)).t();
  if (!lora_a.defined()) {
    if (!bias.defined()) return gemm(x2, wt, blas, y_shape);
    return at::_unsafe_view(at::addmm(as_dtype(bias, dt), x2.tensor(), wt.tensor()), y_shape);
  }
  at::Tensor y = adapter_output(xl2, bias, lora_a, lora_b, scaling, blas, y_shape, h_out);
  gemm_into(y, x2, wt, 1.0, 1.0, blas);
  return y;
}

// The backward: (dx, dx_lora, dA, dB), each undefined where not wanted. dy [..., n] (as rows: [M, n]); xl the adapter's
// input (x itself unless separate_xl; [..., k] as rows); h = xl2 A^T from the forward; x_shape / xl_shape: the sizes of
// dx / dx_lora. Without separate_xl the adapter's input gradient is summed into dx by the accumulating GEMM.
std::array<at::Tensor, 4> backward_rows(const at::Tensor& dy, const at::Tensor& xl, const at::Tensor& h,
                                        const Operands& op, const at::Tensor& lora_a, const at::Tensor& lora_b,
                                        double scaling, bool separate_xl, bool want_x, bool want_xl, bool want_a,
                                        bool want_b, at::IntArrayRef x_shape, at::IntArrayRef xl_shape) {
  std::array<at::Tensor, 4> out;
  const bool lora = lora_a.defined();
  const auto dt = dy.scalar_type();
  const Blas blas(dt);
  const Mat dy2 = rows_of(dy, op.n);
  at::Tensor dh;
  if (lora && (want_a || (want_x && !separate_xl) || want_xl))
    dh = scaled_mm(dy2, mat(as_dtype(lora_b, dt)), scaling, blas);
  const Mat a = lora ? mat(as_dtype(lora_a, dt)) : Mat{};
  if (want_x) {  // (the adapter's share first, the base GEMM accumulating onto it: as in the forward)
    if (lora && !separate_xl) {
      out[0] = gemm(mat(dh), a, blas, x_shape);
      gemm_into(out[0], dy2, mat(op.decode(dt)), 1.0, 1.0, blas);
    } else {
      out[0] = gemm(dy2, mat(op.decode(dt)), blas, x_shape);
    }
  }
  if (lora && want_xl) out[1] = gemm(mat(dh), a, blas, xl_shape);
  if (lora && want_a) out[2] = as_dtype(gemm(mat(dh).t(), rows_of(xl, op.k), blas), lora_a.scalar_type());
  if (lora && want_b) out[3] = as_dtype(scaled_mm(dy2.t(), mat(h), scaling, blas), lora_b.scalar_type());
  return out;
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  auto s = x.sizes().vec();
  s.back() = n;
  return s;
}

const at::Tensor& or_undef(const c10::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// The constants and the input layout both autograd nodes below keep for their backward: the GEMM's, x's shape, and
// the edge index of x_lora, lora_a and lora_b (-1 where absent; x is edge 0; see the note on optionals below).
void save_call(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, bool lora,
               bool lora_b, double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block) {
  auto& d = ctx->saved_data;
  d["fmt"] = fmt;
  d["n"] = n;
  d["k"] = k;
  d["block"] = block;
  d["scaling"] = scaling;
  d["x_shape"] = x.sizes().vec();
  int64_t edge = 1;
  d["edge_xl"] = x_lora.has_value() ? edge++ : int64_t(-1);
  if (x_lora.has_value()) d["xl_shape"] = x_lora->sizes().vec();
  d["edge_a"] = lora ? edge++ : int64_t(-1);
  d["edge_b"] = lora_b ? edge++ : int64_t(-1);
}

// Whether the input recorded under `key` by save_call is present and wants its gradient.
bool wants(AutogradContext* ctx, const char* key) {
  const int64_t e = ctx->saved_data.at(key).toInt();
  return e >= 0 && ctx->needs_input_grad(e);
}

// Optional tensors go in as c10::optional: an absent one is no autograd input (no edge), so needs_input_grad indexes
// only the present ones (x first, then x_lora, lora_a, lora_b where given).
class DecodedLinear : public torch::autograd::Function<DecodedLinear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& x_lora,
                            const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
                            const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                            const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& bias,
                            double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
                            const c10::optional<at::Tensor>& nested_absmax,
                            const c10::optional<at::Tensor>& nested_code,
                            const c10::optional<at::Tensor>& nested_offset) {
    const at::cuda::CUDAGuard guard(x.device());
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // no graph is recorded in here: skip the autograd kernels
    const Operands op{w, scales, or_undef(gscale), or_undef(levels), fmt, n, k, block,
                      nested_of(nested_absmax, nested_code, nested_offset)};
    const bool lora = lora_a.has_value();
    at::Tensor h;
    at::Tensor y = forward_rows(x, or_undef(x_lora), op, or_undef(bias), or_undef(lora_a), or_undef(lora_b), scaling,
                                out_shape(x, n), &h);
    // the frozen operands are module-owned (never versioned by training): kept as plain references, like the
    // Python plan path's; the activations go through save_for_backward (activation checkpointing sees them)
    ctx->save_for_backward({lora ? (x_lora.has_value() ? *x_lora : x) : at::Tensor(), h, or_undef(lora_a),
                            or_undef(lora_b)});
    auto& d = ctx->saved_data;
    d["w"] = w;
    d["scales"] = scales;
    if (gscale.has_value()) d["gscale"] = *gscale;
    if (levels.has_value()) d["levels"] = *levels;
    if (op.nested.defined()) {
      d["nested_absmax"] = op.nested.absmax;
      d["nested_code"] = op.nested.code;
      d["nested_offset"] = op.nested.offset;
    }
    save_call(ctx, x, x_lora, lora, lora_b.has_value(), scaling, fmt, n, k, block);
    return y;  // a fresh output in x's shape, not a view of an intermediate
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(17);  // x, x_lora, lora_a, lora_b, then the frozen weight operands and the constants: none
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xl = saved[0], &h = saved[1], &lora_a = saved[2], &lora_b = saved[3];
    const auto& d = ctx->saved_data;
    auto get = [&](const char* key) { auto it = d.find(key); return it == d.end() ? at::Tensor() : it->second.toTensor(); };
    const Operands op{get("w"), get("scales"), get("gscale"), get("levels"), d.at("fmt").toInt(), d.at("n").toInt(),
                      d.at("k").toInt(), d.at("block").toInt(),
                      Nested{get("nested_absmax"), get("nested_code"), get("nested_offset")}};
    const double scaling = d.at("scaling").toDouble();
    const bool separate_xl = d.at("edge_xl").toInt() >= 0;
    const bool want_x = ctx->needs_input_grad(0), want_xl = wants(ctx, "edge_xl");
    const bool want_a = wants(ctx, "edge_a"), want_b = wants(ctx, "edge_b");
    const at::cuda::CUDAGuard guard(dy.device());
    // no graph is recorded in here either, unless a double backward asked for one
    c10::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const std::vector<int64_t> x_shape = d.at("x_shape").toIntVector();
    const std::vector<int64_t> xl_shape = separate_xl ? d.at("xl_shape").toIntVector() : x_shape;
    const auto g = backward_rows(dy, xl, h, op, lora_a, lora_b, scaling, separate_xl, want_x, want_xl, want_a, want_b,
                                 x_shape, xl_shape);
    out[0] = g[0];
    out[1] = g[1];
    out[2] = g[2];
    out[3] = g[3];
    return out;
  }
};

// AutogradCUDA: the whole forward and backward in C++
at::Tensor decoded_linear_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w,
                                   const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                                   const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& bias,
                                   const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
                                   double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
                                   const c10::optional<at::Tensor>& nested_absmax,
                                   const c10::optional<at::Tensor>& nested_code,
                                   const c10::optional<at::Tensor>& nested_offset) {
  EXT_CHECK(lora_a.has_value() == lora_b.has_value(), "ext_decoded_linear: lora_a and lora_b go together");
  return DecodedLinear::apply(x, x_lora, lora_a, lora_b, w, scales, gscale, levels, bias, scaling, fmt, n, k, block,
                              nested_absmax, nested_code, nested_offset);
}

// CUDA (below autograd: no-grad and inference-mode calls): the forward alone
at::Tensor decoded_linear_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                               const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
                               double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
                               const c10::optional<at::Tensor>& nested_absmax,
                               const c10::optional<at::Tensor>& nested_code,
                               const c10::optional<at::Tensor>& nested_offset) {
  const at::cuda::CUDAGuard guard(x.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // a backend kernel: its aten calls record no graph
  const Operands op{w, scales, or_undef(gscale), or_undef(levels), fmt, n, k, block,
                    nested_of(nested_absmax, nested_code, nested_offset)};
  return forward_rows(x, or_undef(x_lora), op, or_undef(bias), or_undef(lora_a), or_undef(lora_b), scaling,
                      out_shape(x, n), nullptr);
}


// The two ops of a torch.compile graph. A compiled graph cannot call ext_decoded_linear: AOTAutograd traces the
// autograd kernel with fake tensors, and the C++ node above launches kernels. So the graph calls the forward (which
// also returns the adapter's [M, r] intermediate h, saved for the backward; an empty tensor without an adapter) and,
// through the forward's autograd (DecodedLinearFwd below for CUDA tensors), the backward: one opaque call each way,
// the same aten calls as the node's. Gradients that are not wanted come back as empty tensors.
//
// The two graph ops' bodies on a weight's operands, given as arguments (ext_decoded_linear_fwd / _bwd) or registered for
// its codes (ext_registered_linear_fwd / _bwd): (y, h), h empty without an adapter; and (dx, dx_lora, dA, dB), each
// empty where not wanted, as 2-D gradients ([M, k], as the ops' schemas state them).
std::tuple<at::Tensor, at::Tensor> graph_forward(const at::Tensor& x, const c10::optional<at::Tensor>& x_lora,
                                                 const Operands& op, const c10::optional<at::Tensor>& bias,
                                                 const c10::optional<at::Tensor>& lora_a,
                                                 const c10::optional<at::Tensor>& lora_b, double scaling) {
  const at::cuda::CUDAGuard guard(x.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // a backend kernel: its aten calls record no graph
  at::Tensor h;
  at::Tensor y = forward_rows(x, or_undef(x_lora), op, or_undef(bias), or_undef(lora_a), or_undef(lora_b), scaling,
                              out_shape(x, op.n), &h);
  if (!h.defined()) h = at::empty({0}, x.options());
  return {y, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> graph_backward(
    const at::Tensor& dy, const c10::optional<at::Tensor>& x_lora, const c10::optional<at::Tensor>& h,
    const Operands& op, const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
    double scaling, bool separate_xl, bool want_x, bool want_xl, bool want_a, bool want_b, const char* who) {
  const bool lora = lora_a.has_value() && lora_b.has_value();
  EXT_CHECK(!lora || (x_lora.has_value() && h.has_value()), who, ": an adapter's gradients need its input and h");
  const at::cuda::CUDAGuard guard(dy.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t m = op.n > 0 ? dy.numel() / op.n : 0;
  const std::array<int64_t, 2> mk{m, op.k};
  auto g = backward_rows(dy, or_undef(x_lora), or_undef(h), op, or_undef(lora_a), or_undef(lora_b), scaling,
                         separate_xl, want_x, want_xl && lora && separate_xl, want_a && lora, want_b && lora, mk, mk);
  for (auto& t : g)
    if (!t.defined()) t = at::empty({0}, dy.options());
  return {g[0], g[1], g[2], g[3]};
}

std::tuple<at::Tensor, at::Tensor> decoded_linear_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w, const at::Tensor& scales,
    const c10::optional<at::Tensor>& gscale, const c10::optional<at::Tensor>& levels,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& lora_a,
    const c10::optional<at::Tensor>& lora_b, double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
    const c10::optional<at::Tensor>& nested_absmax, const c10::optional<at::Tensor>& nested_code,
    const c10::optional<at::Tensor>& nested_offset) {
  EXT_CHECK(lora_a.has_value() == lora_b.has_value(), "ext_decoded_linear_fwd: lora_a and lora_b go together");
  return graph_forward(x, x_lora, Operands{w, scales, or_undef(gscale), or_undef(levels), fmt, n, k, block,
                                           nested_of(nested_absmax, nested_code, nested_offset)},
                       bias, lora_a, lora_b, scaling);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decoded_linear_bwd_cuda(
    const at::Tensor& dy, const c10::optional<at::Tensor>& x_lora, const c10::optional<at::Tensor>& h,
    const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
    const c10::optional<at::Tensor>& levels, const c10::optional<at::Tensor>& lora_a,
    const c10::optional<at::Tensor>& lora_b, double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
    bool separate_xl, bool want_x, bool want_xl, bool want_a, bool want_b,
    const c10::optional<at::Tensor>& nested_absmax, const c10::optional<at::Tensor>& nested_code,
    const c10::optional<at::Tensor>& nested_offset) {
  return graph_backward(dy, x_lora, h,
                        Operands{w, scales, or_undef(gscale), or_undef(levels), fmt, n, k, block,
                                 nested_of(nested_absmax, nested_code, nested_offset)},
                        lora_a, lora_b, scaling, separate_xl, want_x, want_xl, want_a, want_b, "ext_decoded_linear_bwd");
}


// The forward graph op's autograd, in C++ for CUDA tensors (the Python one registered in surogate_hf/ops/ext.py keeps
// the CPU reference). A compiled forward graph calls ext_decoded_linear_fwd with grad mode off; through the Python
// kernel every call crossed into Python and back (torch._library.autograd: ~20 us of a 135M step's ~130 us per call,
// results/profile_host_compiled_135m_c96b337.md). Here it redispatches in C++. With grad on (eager calls, and
// AOTAutograd tracing the joint graph with fake tensors) the node's backward calls ext_decoded_linear_bwd through the
// dispatcher, never a kernel: so the tracer records it, as it records the Python formula's call.
const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t, int64_t, int64_t, int64_t,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&)>&
fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("surogate::ext_decoded_linear_fwd", "")
                              .typed<std::tuple<at::Tensor, at::Tensor>(
                                  const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&,
                                  const at::Tensor&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t,
                                  int64_t, int64_t, int64_t, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&)>();
  return op;
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const at::Tensor&,
    const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t, int64_t, int64_t, int64_t,
    bool, bool, bool, bool, bool, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&)>&
bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("surogate::ext_decoded_linear_bwd", "")
                              .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                  const at::Tensor&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t,
                                  int64_t, int64_t, int64_t, bool, bool, bool, bool, bool,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&)>();
  return op;
}

// Edges: x, then x_lora, lora_a, lora_b where given (as DecodedLinear's); the weight's operands are no edges.
class DecodedLinearFwd : public torch::autograd::Function<DecodedLinearFwd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& x_lora,
                               const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
                               const c10::optional<at::Tensor>& bias, const at::Tensor& w, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& gscale, const c10::optional<at::Tensor>& levels,
                               double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
                               const c10::optional<at::Tensor>& nested_absmax,
                               const c10::optional<at::Tensor>& nested_code,
                               const c10::optional<at::Tensor>& nested_offset) {
    std::tuple<at::Tensor, at::Tensor> out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = fwd_op().call(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block,
                          nested_absmax, nested_code, nested_offset);
    }
    at::Tensor& h = std::get<1>(out);
    ctx->mark_non_differentiable({h});  // the backward's, not the caller's
    ctx->set_materialize_grads(false);
    const bool lora = lora_a.has_value();
    ctx->save_for_backward({x_lora.has_value() ? *x_lora : x, h, w, scales, or_undef(gscale), or_undef(levels),
                            or_undef(lora_a), or_undef(lora_b), or_undef(nested_absmax), or_undef(nested_code),
                            or_undef(nested_offset)});
    save_call(ctx, x, x_lora, lora, lora_b.has_value(), scaling, fmt, n, k, block);
    return {std::get<0>(out), h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(17);  // x, x_lora, lora_a, lora_b, bias, the weight's operands, the constants, nested
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
    const bool lora = saved[6].defined(), separate = d.at("edge_xl").toInt() >= 0;
    const bool want_x = ctx->needs_input_grad(0), want_xl = wants(ctx, "edge_xl");
    const bool want_a = wants(ctx, "edge_a"), want_b = wants(ctx, "edge_b");
    auto g = bwd_op().call(grads[0].contiguous(), lora ? opt(saved[0]) : c10::nullopt,
                           lora ? opt(saved[1]) : c10::nullopt, saved[2], saved[3], opt(saved[4]), opt(saved[5]),
                           opt(saved[6]), opt(saved[7]), d.at("scaling").toDouble(), d.at("fmt").toInt(),
                           d.at("n").toInt(), d.at("k").toInt(), d.at("block").toInt(), separate, want_x, want_xl,
                           want_a, want_b, opt(saved[8]), opt(saved[9]), opt(saved[10]));
    if (want_x) out[0] = std::get<0>(g).reshape(d.at("x_shape").toIntVector());
    if (separate && want_xl && lora) out[1] = std::get<1>(g).reshape(d.at("xl_shape").toIntVector());
    if (want_a && lora) out[2] = std::get<2>(g);
    if (want_b && lora) out[3] = std::get<3>(g);
    return out;
  }
};

// AutogradCUDA of the forward graph op
std::tuple<at::Tensor, at::Tensor> decoded_linear_fwd_autograd(
    const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w, const at::Tensor& scales,
    const c10::optional<at::Tensor>& gscale, const c10::optional<at::Tensor>& levels,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& lora_a,
    const c10::optional<at::Tensor>& lora_b, double scaling, int64_t fmt, int64_t n, int64_t k, int64_t block,
    const c10::optional<at::Tensor>& nested_absmax, const c10::optional<at::Tensor>& nested_code,
    const c10::optional<at::Tensor>& nested_offset) {
  EXT_CHECK(lora_a.has_value() == lora_b.has_value(), "ext_decoded_linear_fwd: lora_a and lora_b go together");
  EXT_CHECK(!bias.has_value() || !bias->requires_grad(), "ext_decoded_linear_fwd: the bias is frozen");
  auto wants_grad = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); };
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || wants_grad(x_lora) || wants_grad(lora_a) ||
                                       wants_grad(lora_b))) {
    // no graph to record (a compiled forward graph runs with grad mode off): skip the node's context and saves
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fwd_op().call(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt, n, k, block,
                         nested_absmax, nested_code, nested_offset);
  }
  auto out = DecodedLinearFwd::apply(x, x_lora, lora_a, lora_b, bias, w, scales, gscale, levels, scaling, fmt, n, k,
                                     block, nested_absmax, nested_code, nested_offset);
  return {out[0], out[1]};
}


// ---- The registered-operands route: a compiled graph hands each linear's op its codes only.
// Every frozen operand a linear hands a compiled graph crosses it three times a step (a forward input, a forward output
// saved for the backward's decode, a backward input), each crossing host work (dynamo's guard, AOTAutograd's wrappers,
// inductor's checks; through the HF Trainer with CUDA graphs removing them measured no gain). A layer registers its decode
// operands once per load or move (surogate_hf.nn.linear, through ops.ext.register_decode_operands), keyed by its
// codes' address; the graph ops take the codes alone (one graph input per linear, as a bf16 linear's weight) and find
// the rest here. The registry holds the operands themselves, so an address stays the layer's while registered.
// (Both leaked on purpose: destroying the registered CUDA tensors among the static destructors at exit, after the
// CUDA runtime may have gone, could crash the process's exit.)
std::mutex& registry_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

std::unordered_map<const void*, Operands>& registry() {
  static auto* r = new std::unordered_map<const void*, Operands>();
  return *r;
}

void decode_registry_set(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& gscale,
                         const c10::optional<at::Tensor>& levels, int64_t fmt, int64_t n, int64_t k, int64_t block,
                         const c10::optional<at::Tensor>& nested_absmax, const c10::optional<at::Tensor>& nested_code,
                         const c10::optional<at::Tensor>& nested_offset) {
  EXT_CHECK(w.is_cuda(), "ext_decode_registry_set: CUDA operands expected");
  Operands op{w, scales, or_undef(gscale), or_undef(levels), fmt, n, k, block,
              nested_of(nested_absmax, nested_code, nested_offset)};
  op.check();
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[w.data_ptr()] = std::move(op);
}

void decode_registry_release(int64_t w_data_ptr) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(reinterpret_cast<const void*>(w_data_ptr));
}

// The operands registered for the codes w (a copy: a few reference counts), checked against the call's [n, k].
Operands registered_operands(const at::Tensor& w, int64_t n, int64_t k, const char* who) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().find(w.data_ptr());
  EXT_CHECK(it != registry().end(), who, ": no decode operands are registered for these codes (a quantized layer's "
            "slots replaced after the graph was compiled, outside loading and moving the layer: call its "
            "slots_loaded(), or torch._dynamo.reset())");
  const Operands& op = it->second;
  EXT_CHECK(op.n == n && op.k == k && op.w.numel() == w.numel(), who, ": the operands registered for these codes are "
            "of a [", op.n, ", ", op.k, "] weight, the call's is [", n, ", ", k, "]");
  return op;
}

std::tuple<at::Tensor, at::Tensor> registered_linear_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& lora_a,
    const c10::optional<at::Tensor>& lora_b, double scaling, int64_t n, int64_t k) {
  EXT_CHECK(lora_a.has_value() == lora_b.has_value(), "ext_registered_linear_fwd: lora_a and lora_b go together");
  return graph_forward(x, x_lora, registered_operands(w, n, k, "ext_registered_linear_fwd"), bias, lora_a, lora_b,
                       scaling);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> registered_linear_bwd_cuda(
    const at::Tensor& dy, const c10::optional<at::Tensor>& x_lora, const c10::optional<at::Tensor>& h,
    const at::Tensor& w, const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
    double scaling, int64_t n, int64_t k, bool separate_xl, bool want_x, bool want_xl, bool want_a, bool want_b) {
  return graph_backward(dy, x_lora, h, registered_operands(w, n, k, "ext_registered_linear_bwd"), lora_a, lora_b,
                        scaling, separate_xl, want_x, want_xl, want_a, want_b, "ext_registered_linear_bwd");
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t, int64_t)>&
registered_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("surogate::ext_registered_linear_fwd", "")
                              .typed<std::tuple<at::Tensor, at::Tensor>(
                                  const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, double, int64_t, int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const at::Tensor&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t, int64_t, bool, bool, bool,
    bool, bool)>&
registered_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("surogate::ext_registered_linear_bwd", "")
                              .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                  const at::Tensor&, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&, const at::Tensor&,
                                  const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double, int64_t,
                                  int64_t, bool, bool, bool, bool, bool)>();
  return op;
}

// The registered forward's autograd in C++ for CUDA tensors (as DecodedLinearFwd: the backward op through the
// dispatcher, so AOTAutograd traces it). Edges: x, then x_lora, lora_a, lora_b where given. It saves the codes, the
// key of the operands, and nothing else of the weight.
class RegisteredLinearFwd : public torch::autograd::Function<RegisteredLinearFwd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& x_lora,
                               const c10::optional<at::Tensor>& lora_a, const c10::optional<at::Tensor>& lora_b,
                               const c10::optional<at::Tensor>& bias, const at::Tensor& w, double scaling, int64_t n,
                               int64_t k) {
    std::tuple<at::Tensor, at::Tensor> out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = registered_fwd_op().call(x, x_lora, w, bias, lora_a, lora_b, scaling, n, k);
    }
    at::Tensor& h = std::get<1>(out);
    ctx->mark_non_differentiable({h});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x_lora.has_value() ? *x_lora : x, h, w, or_undef(lora_a), or_undef(lora_b)});
    save_call(ctx, x, x_lora, lora_a.has_value(), lora_b.has_value(), scaling, -1, n, k, 0);
    return {std::get<0>(out), h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(9);  // x, x_lora, lora_a, lora_b, bias, w, the constants: none
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    auto opt_of = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
    const bool lora = saved[3].defined(), separate = d.at("edge_xl").toInt() >= 0;
    const bool want_x = ctx->needs_input_grad(0), want_xl = wants(ctx, "edge_xl");
    const bool want_a = wants(ctx, "edge_a"), want_b = wants(ctx, "edge_b");
    auto g = registered_bwd_op().call(grads[0].contiguous(), lora ? opt_of(saved[0]) : c10::nullopt,
                                      lora ? opt_of(saved[1]) : c10::nullopt, saved[2], opt_of(saved[3]),
                                      opt_of(saved[4]), d.at("scaling").toDouble(), d.at("n").toInt(),
                                      d.at("k").toInt(), separate, want_x, want_xl, want_a, want_b);
    if (want_x) out[0] = std::get<0>(g).reshape(d.at("x_shape").toIntVector());
    if (separate && want_xl && lora) out[1] = std::get<1>(g).reshape(d.at("xl_shape").toIntVector());
    if (want_a && lora) out[2] = std::get<2>(g);
    if (want_b && lora) out[3] = std::get<3>(g);
    return out;
  }
};

// AutogradCUDA of the registered forward graph op
std::tuple<at::Tensor, at::Tensor> registered_linear_fwd_autograd(
    const at::Tensor& x, const c10::optional<at::Tensor>& x_lora, const at::Tensor& w,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& lora_a,
    const c10::optional<at::Tensor>& lora_b, double scaling, int64_t n, int64_t k) {
  EXT_CHECK(lora_a.has_value() == lora_b.has_value(), "ext_registered_linear_fwd: lora_a and lora_b go together");
  EXT_CHECK(!bias.has_value() || !bias->requires_grad(), "ext_registered_linear_fwd: the bias is frozen");
  auto wants_grad = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); };
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || wants_grad(x_lora) || wants_grad(lora_a) ||
                                       wants_grad(lora_b))) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return registered_fwd_op().call(x, x_lora, w, bias, lora_a, lora_b, scaling, n, k);
  }
  auto out = RegisteredLinearFwd::apply(x, x_lora, lora_a, lora_b, bias, w, scaling, n, k);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(surogate, CUDA, m) {
  m.impl("ext_dequantize", &dequantize_op);
  m.impl("ext_decoded_linear", &decoded_linear_cuda);
  m.impl("ext_decoded_linear_fwd", &decoded_linear_fwd_cuda);
  m.impl("ext_decoded_linear_bwd", &decoded_linear_bwd_cuda);
  m.impl("ext_registered_linear_fwd", &registered_linear_fwd_cuda);
  m.impl("ext_registered_linear_bwd", &registered_linear_bwd_cuda);
}

TORCH_LIBRARY_IMPL(surogate, AutogradCUDA, m) {
  m.impl("ext_decoded_linear", &decoded_linear_autograd);
  m.impl("ext_decoded_linear_fwd", &decoded_linear_fwd_autograd);
  m.impl("ext_registered_linear_fwd", &registered_linear_fwd_autograd);
}

// The registry's two eager calls (never in a graph; schemas here: surogate_hf calls them only with the library loaded)
TORCH_LIBRARY_FRAGMENT(surogate, m) {
  m.def("ext_decode_registry_set(Tensor w, Tensor scales, Tensor? gscale, Tensor? levels, int fmt, int n, int k, "
        "int block, Tensor? nested_absmax, Tensor? nested_code, Tensor? nested_offset) -> ()",
        &decode_registry_set);
  m.def("ext_decode_registry_release(int w_data_ptr) -> ()", &decode_registry_release);
}
