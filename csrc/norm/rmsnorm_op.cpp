// surogate::ext_rmsnorm(x, weight, eps, gemma, out_dtype) -> y: recipes.norm.FusedRMSNorm's eager CUDA path with its
// autograd in C++ (kernels: rmsnorm.cu; math and reference: surogate_hf/recipes/norm.py, surogate_hf/ops/ext.py).
//
// Why C++: the Triton version runs as a Python autograd.Function, and at a small model's widths its host time (the
// Function, the Triton launcher, the dw reduction as separate torch calls) was several times the kernels' time: a
// profiled SmolLM2-360M QLoRA step spent ~140 us per norm forward and ~240 us per backward on the host. Here one
// dispatcher call runs the forward, and the backward is a C++ node: its kernel, then a column sum for dw only when the
// weight trains. The FP8 hand-off (the norm writing its consumers' FP8 input) stays on the Triton path.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <array>
#include "../common/check.h"

namespace surogate {
void launch_rmsnorm_fwd(const void* x, int x_dtype, const void* w, int w_dtype, void* y, bool y_is_f32, float* rstd,
                        int64_t R, int64_t C, float eps, bool gemma, int sms, cudaStream_t stream);
int64_t rmsnorm_bwd_partials(int64_t R, int64_t C, int sms);
void launch_rmsnorm_bwd(const void* dy, bool dy_is_f32, const void* x, int x_dtype, const void* w, int w_dtype,
                        const float* rstd, void* dx, float* dw_part, int64_t R, int64_t C, bool gemma, int sms,
                        cudaStream_t stream);
void launch_column_sum(const float* part, void* dw, int w_dtype, int64_t P, int64_t C, cudaStream_t stream);
}  // namespace surogate

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMaxCols = 16384;  // 16 columns per thread of a 1024-thread block (rmsnorm.cu's geometry)

int float_code(at::ScalarType t) { return t == at::kFloat ? 0 : (t == at::kBFloat16 ? 1 : 2); }

// the current device's SM count, read once per device
int sm_count() {
  static std::array<int, 64> cached{};
  const int dev = c10::cuda::current_device();
  if (dev >= (int)cached.size()) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  if (cached[dev] == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMultiProcessorCount, dev));
  return cached[dev];
}

void check(const at::Tensor& x, const at::Tensor& w, at::ScalarType out) {
  EXT_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(),
            "ext_rmsnorm: x and weight must be CUDA tensors on one device");
  const auto xt = x.scalar_type();
  EXT_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, "ext_rmsnorm: x must be fp32, bf16 or fp16, got ",
            xt);
  EXT_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
            "ext_rmsnorm: weight must be fp32 or bf16, got ", w.scalar_type());
  EXT_CHECK(out == xt || out == at::kFloat, "ext_rmsnorm: out_dtype must be x's dtype or fp32, got ", out);
  EXT_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "ext_rmsnorm: weight must be [C] for x [..., C]");
  EXT_CHECK(x.size(-1) <= kMaxCols, "ext_rmsnorm: rows longer than ", kMaxCols, " columns are not supported");
}

// (y [R, C] out, rstd [R] fp32) of a contiguous x2 [R, C]
std::tuple<at::Tensor, at::Tensor> forward_2d(const at::Tensor& x2, const at::Tensor& w, double eps, bool gemma,
                                              at::ScalarType out) {
  const int64_t R = x2.size(0), C = x2.size(1);
  at::Tensor y = at::empty({R, C}, x2.options().dtype(out));
  at::Tensor rstd = at::empty({R}, x2.options().dtype(at::kFloat));
  if (R > 0 && C > 0) {
    surogate::launch_rmsnorm_fwd(x2.data_ptr(), float_code(x2.scalar_type()), w.data_ptr(), float_code(w.scalar_type()),
                                 y.data_ptr(), out == at::kFloat, rstd.data_ptr<float>(), R, C, (float)eps, gemma,
                                 sm_count(), c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {y, rstd};
}

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma,
                            at::ScalarType out) {
    check(x, weight, out);
    const c10::cuda::CUDAGuard guard(x.device());
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const at::Tensor w = weight.contiguous();
    auto [y, rstd] = forward_2d(x2, w, eps, gemma, out);
    ctx->save_for_backward({x2, w, rstd});
    ctx->saved_data["gemma"] = gemma;
    ctx->saved_data["x_shape"] = x.sizes().vec();
    ctx->saved_data["out"] = (int64_t)out;
    return at::_unsafe_view(y, x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &w = saved[1], &rstd = saved[2];
    const int64_t R = x2.size(0), C = x2.size(1);
    const auto out = (at::ScalarType)ctx->saved_data["out"].toInt();
    const c10::cuda::CUDAGuard guard(x2.device());
    const at::Tensor dy = grads[0].to(out).reshape({R, C}).contiguous();
    const bool want_w = ctx->needs_input_grad(1);
    at::Tensor dx = at::empty({R, C}, x2.options());
    const int sms = sm_count();
    const int64_t parts = surogate::rmsnorm_bwd_partials(R, C, sms);
    at::Tensor part = want_w ? at::empty({parts, C}, x2.options().dtype(at::kFloat)) : at::Tensor();
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (R > 0 && C > 0) {
      surogate::launch_rmsnorm_bwd(dy.data_ptr(), out == at::kFloat, x2.data_ptr(), float_code(x2.scalar_type()),
                                   w.data_ptr(), float_code(w.scalar_type()), rstd.data_ptr<float>(), dx.data_ptr(),
                                   want_w ? part.data_ptr<float>() : nullptr, R, C, ctx->saved_data["gemma"].toBool(),
                                   sms, stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (want_w) {
      at::Tensor dw = R > 0 ? at::empty({C}, w.options()) : at::zeros({C}, w.options());
      if (R > 0 && C > 0) {
        surogate::launch_column_sum(part.data_ptr<float>(), dw.data_ptr(), float_code(w.scalar_type()), parts, C,
                                    stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      result[1] = dw;
    }
    if (ctx->needs_input_grad(0)) result[0] = at::_unsafe_view(dx, ctx->saved_data["x_shape"].toIntVector());
    return result;
  }
};

// AutogradCUDA: the forward and the C++ backward node
at::Tensor rmsnorm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::ScalarType out) {
  return RMSNormFn::apply(x, weight, eps, gemma, out);
}

// CUDA (below autograd: no-grad and inference-mode calls): the forward alone
at::Tensor rmsnorm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::ScalarType out) {
  check(x, weight, out);
  const c10::cuda::CUDAGuard guard(x.device());
  auto [y, rstd] = forward_2d(x.reshape({-1, x.size(-1)}).contiguous(), weight.contiguous(), eps, gemma, out);
  return at::_unsafe_view(y, x.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(surogate, CUDA, m) { m.impl("ext_rmsnorm", &rmsnorm_cuda); }

TORCH_LIBRARY_IMPL(surogate, AutogradCUDA, m) { m.impl("ext_rmsnorm", &rmsnorm_autograd); }
