// surogate::ext_fp8_scaled_mm: out [M, N] = (a [M, K] @ b [N, K]^T) * sa * sb (+ bias), per-tensor scaled FP8 GEMM
// (fp32 accumulation, one rounding) for the eager fp8 recipes (recipes.fp8_hybrid.scaled_mm).
//
// It is the cuBLASLt call torch._scaled_mm(a, b.t(), sa, sb, bias, out_dtype, use_fast_accum) makes for tensor-wise
// scales (at::cuda::blas::scaled_gemm), with the same descriptors and the same heuristic query, minus its host cost:
// aten asks cuBLASLt's heuristic on every call, which made _scaled_mm ~96 us of host time per call against ~15 us
// for a bf16 mm (SmolLM2-135M fp8-hybrid step, H100, benchmarks/results/profile_fp8_eager_*.md), three per linear per
// step. Here the descriptors and the heuristic's answer are cached per (shapes, dtypes, bias, fast accumulation,
// workspace, device): the query is deterministic for identical descriptors, so the cached algorithm is the one aten
// would run, and so are the bits (the GPU test compares them with torch._scaled_mm). A call sets only the scale and
// bias pointers, which are its own.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <tuple>
#include "../common/check.h"

namespace surogate {
namespace {

cudaDataType_t lt_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: EXT_CHECK(false, "ext_fp8_scaled_mm: unsupported dtype ", t);
  }
  return CUDA_R_32F;
}

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc() { EXT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    EXT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(T)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  Layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    EXT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  }
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  explicit Preference(uint64_t workspace) {
    EXT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p));
    EXT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                          sizeof(workspace)));
  }
  ~Preference() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

// (device, m, n, k, a, b, c, d dtypes, bias dtype or -1, fast accumulation, workspace bytes)
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, bool, uint64_t>;

// One GEMM configuration's descriptors and algorithm, built once: a call only points the scale (and bias) attributes
// at its own tensors. Per thread (the autograd engine runs the backward on its own thread): a plan is never shared.
struct Plan {
  MatmulDesc desc;
  std::unique_ptr<Layout> la, lb, lc, ld;
  cublasLtMatmulAlgo_t algo;
};

thread_local std::map<PlanKey, std::unique_ptr<Plan>> plans;
constexpr size_t kMaxPlans = 4096;

}  // namespace

// a [M, K], b [N, K]: contiguous float8 (not both e5m2); sa, sb: one fp32 value each, on a's device (16-byte aligned,
// as cuBLASLt reads them); bias [N] in out_dtype (not fp32) or none. K and N multiples of 16 (cuBLASLt's FP8 rule).
// The Python caller (recipes.fp8_hybrid.scaled_mm) checks all of it first; the checks below only guard misuse.
at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                         const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum) {
  EXT_CHECK(a.is_cuda() && b.is_cuda() && a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() &&
                a.size(1) == b.size(1) && a.size(1) % 16 == 0 && b.size(0) % 16 == 0,
            "ext_fp8_scaled_mm: a [M, K] and b [N, K] must be contiguous CUDA tensors with K and N multiples of 16; "
            "got ", a.sizes(), " and ", b.sizes());
  EXT_CHECK(sa.scalar_type() == at::kFloat && sb.scalar_type() == at::kFloat && sa.numel() == 1 && sb.numel() == 1,
            "ext_fp8_scaled_mm: sa and sb must be one fp32 value each");
  const bool has_bias = bias.has_value() && bias->defined();
  EXT_CHECK(!has_bias || (bias->scalar_type() == out_dtype && out_dtype != at::kFloat && bias->numel() == b.size(0) &&
                          bias->is_contiguous()),
            "ext_fp8_scaled_mm: bias must be a contiguous [N] tensor of out_dtype (bf16 or fp16)");
  const at::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  at::Tensor out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
  if (K == 0) return has_bias ? out.copy_(bias->expand({M, N})) : out.zero_();

  // Column-major, as aten hands it to cuBLASLt: out^T [N, M] = b [N, K] (its row-major bytes read as K x N, op T)
  // times a^T [K, M] (a's bytes as K x M, op N); A's scale is b's, B's is a's. C takes the bias dtype, else out's.
  const cudaDataType_t ta = lt_type(b.scalar_type()), tb = lt_type(a.scalar_type()), td = lt_type(out_dtype);
  const cudaDataType_t tc = has_bias ? lt_type(bias->scalar_type()) : td;
  const uint64_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace_ptr = at::cuda::getCUDABlasLtWorkspace();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const PlanKey key{a.get_device(), N, M, K, (int)ta, (int)tb, (int)tc, (int)td, has_bias ? (int)tc : -1, fast_accum,
                    workspace};
  const void* a_scale = sb.data_ptr();
  const void* b_scale = sa.data_ptr();
  const void* bias_ptr = has_bias ? bias->data_ptr() : nullptr;
  auto it = plans.find(key);
  if (it == plans.end()) {
    // token counts that change every step (dynamic padding) add a plan each: bounded, dropped wholesale when full
    if (plans.size() >= kMaxPlans) plans.clear();
    auto plan = std::make_unique<Plan>();
    MatmulDesc& desc = plan->desc;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale);
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale);
    desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
#if defined(CUDA_VERSION) && CUDA_VERSION >= 12080
    const int32_t scalar_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scalar_mode);
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scalar_mode);
#endif
    if (has_bias) {
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, tc);
    }
    plan->la = std::make_unique<Layout>(ta, K, N, K);
    plan->lb = std::make_unique<Layout>(tb, K, M, K);
    plan->lc = std::make_unique<Layout>(tc, N, M, N);
    plan->ld = std::make_unique<Layout>(td, N, M, N);
    Preference pref(workspace);
    cublasLtMatmulHeuristicResult_t result = {};
    int returned = 0;
    EXT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.d, plan->la->l, plan->lb->l, plan->lc->l,
                                                    plan->ld->l, pref.p, 1, &result, &returned));
    EXT_CHECK(returned > 0, "ext_fp8_scaled_mm: cuBLASLt offers no algorithm for a [", M, ", ", K, "] x [", N, ", ", K,
              "]^T GEMM to ", out_dtype, has_bias ? " with a bias" : "");
    plan->algo = result.algo;
    it = plans.emplace(key, std::move(plan)).first;
  } else {
    it->second->desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale);
    it->second->desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale);
    if (has_bias) it->second->desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
  }
  Plan& plan = *it->second;
  const float alpha = 1.0f, beta = 0.0f;
  // C is unused (beta 0) but cuBLASLt wants a pointer that is neither null nor D: aten passes its first operand's
  EXT_CUBLAS_CHECK(cublasLtMatmul(handle, plan.desc.d, &alpha, b.data_ptr(), plan.la->l, a.data_ptr(), plan.lb->l,
                                  &beta, b.data_ptr(), plan.lc->l, out.data_ptr(), plan.ld->l, &plan.algo,
                                  workspace_ptr, workspace, at::cuda::getCurrentCUDAStream()));
  return out;
}

TORCH_LIBRARY_IMPL(surogate, CUDA, m) { m.impl("ext_fp8_scaled_mm", &fp8_scaled_mm); }

}  // namespace surogate
