// surogate::ext_fp8_linear: the eager fp8 recipes' linear (recipes.fp8_hybrid.Fp8LinearFn's delayed-scaling training
// path) as one dispatcher call with a C++ autograd node, for CUDA tensors:
//   forward  y  = E4M3(x) E4M3(W)^T       (x cast here with its state row, or handed over by the norm that made x)
//   dgrad    dx = fmt(dy) E4M3(W^T)^T     (fmt: E5M2 for fp8-hybrid)
//   wgrad    dW = fmt(dy)^T E4M3(x^T)^T   (into the master's dtype), db = sum(dy)
// The same casts (ext_fp8_cast[_transpose]_amax) and GEMMs (ext_fp8_scaled_mm) that the Python Function calls one by
// one, so the same bits (the GPU test compares the two paths). What it removes is host time: Fp8LinearFn's Python
// forward and backward cost ~130 us per linear per step on the H100 host against a GPU time of ~10-30 us at a small
// model's widths (SmolLM2-135M profile, benchmarks/results/profile_fp8_eager_smollm2_135m.md), and the HF Trainer's
// per-step sync exposes that host time. The Python side (RecipeLinear._fp8_forward) takes this op only where it applies
// (CUDA, training after the first step, FP8 backward, token count and widths multiples of 16)
// and checks the operands first (the checks of the ops it calls raise with their numbers: csrc/common/check.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

// the extension's casts (csrc/bindings.cpp) and scaled GEMM (csrc/fp8/scaled_mm.cpp)
void fp8_cast_amax(const at::Tensor& x, const at::Tensor& scale, at::Tensor& q, at::Tensor& amax_bits);
void fp8_cast_transpose_amax(const at::Tensor& x, const at::Tensor& scale, at::Tensor& q, at::Tensor& qt,
                             at::Tensor& amax_bits);

namespace surogate {
at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                         const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A contiguous 2-D view at a 16-byte aligned address (the cast kernels load 16 bytes at a time): a copy otherwise.
at::Tensor aligned_2d(const at::Tensor& t, int64_t cols) {
  at::Tensor t2 = t.reshape({-1, cols}).contiguous();
  return reinterpret_cast<uintptr_t>(t2.data_ptr()) % 16 == 0 ? t2 : t2.clone();
}

// (q, q^T or undefined) of t2 [R, C] scaled by the one-element `scale`; amax_bits raised to max|t2|.
std::pair<at::Tensor, at::Tensor> cast(const at::Tensor& t2, const at::Tensor& scale, at::Tensor amax_bits,
                                       at::ScalarType fmt, bool transpose) {
  at::Tensor q = at::empty(t2.sizes(), t2.options().dtype(fmt));
  if (!transpose) {
    fp8_cast_amax(t2, scale, q, amax_bits);
    return {q, at::Tensor()};
  }
  at::Tensor qt = at::empty({t2.size(1), t2.size(0)}, t2.options().dtype(fmt));
  fp8_cast_transpose_amax(t2, scale, q, qt, amax_bits);
  return {q, qt};
}

const at::Tensor& or_undef(const c10::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// The forward's math: y [..., N] and, for the backward, x^T's cast when `keep_xt` (x cast here unless handed over).
at::Tensor forward_math(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_sinv,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& xq,
                        const c10::optional<at::Tensor>& xqt, const at::Tensor& x_sinv, const at::Tensor& x_scale,
                        at::Tensor x_amax_bits, bool fast_accum, bool keep_xt, at::Tensor* xqt_out) {
  const int64_t k = wq.size(1), n = wq.size(0);
  at::Tensor q = or_undef(xq), qt = or_undef(xqt);
  if (!q.defined()) std::tie(q, qt) = cast(aligned_2d(x, k), x_scale, x_amax_bits, at::kFloat8_e4m3fn, keep_xt);
  if (xqt_out) *xqt_out = qt;
  const auto dt = x.scalar_type();
  at::Tensor y;
  if (bias.has_value() && (bias->scalar_type() != dt || dt == at::kFloat)) {
    // a bias cuBLASLt's epilogue does not take (an fp32 master's): added to the fp32 product, then one rounding, as
    // kernels.fp8_gemm.fp8_scaled_mm does
    y = fp8_scaled_mm(q, wq, x_sinv, w_sinv, c10::nullopt, at::kFloat, fast_accum).add_(bias->to(at::kFloat)).to(dt);
  } else {
    y = fp8_scaled_mm(q, wq, x_sinv, w_sinv, bias, dt, fast_accum);
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return at::_unsafe_view(y, shape);
}

// Autograd edges: x (0), weight (1), bias (2, where given), then the FP8 operands and the state rows, which never want
// a gradient (an absent optional tensor is no edge). The backward's gradients go by forward argument position.
class Fp8Linear : public torch::autograd::Function<Fp8Linear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& wq,
                            const c10::optional<at::Tensor>& wqt, const at::Tensor& w_sinv,
                            const c10::optional<at::Tensor>& xq, const c10::optional<at::Tensor>& xqt,
                            const at::Tensor& x_sinv, const at::Tensor& x_scale, const at::Tensor& x_amax_bits,
                            const at::Tensor& dy_scale, const at::Tensor& dy_amax_bits, const at::Tensor& dy_sinv,
                            bool e5m2_grad, bool fast_accum) {
    const at::cuda::CUDAGuard guard(x.device());
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // no graph is recorded in here: skip the autograd kernels
    const bool need_dw = weight.requires_grad();
    at::Tensor xt;
    at::Tensor y = forward_math(x, wq, w_sinv, bias, xq, xqt, x_sinv, x_scale, x_amax_bits, fast_accum, need_dw, &xt);
    // The GEMM operands as Fp8LinearFn saves them (save_for_backward: freed once this node's backward ran, and seen by
    // activation checkpointing's hooks; saved_data would hold x^T's cast until the whole graph is gone: +3.9 GiB peak
    // at the Qwen3-1.7B shape). The dy state rows as plain references, as Fp8LinearFn keeps them: other layers'
    // backward casts write the state between this forward and this backward.
    ctx->save_for_backward({need_dw ? xt : at::Tensor(), wqt.has_value() ? *wqt : at::Tensor(), x_sinv, w_sinv});
    auto& d = ctx->saved_data;
    d["dy_scale"] = dy_scale;
    d["dy_amax_bits"] = dy_amax_bits;
    d["dy_sinv"] = dy_sinv;
    d["e5m2"] = e5m2_grad;
    d["x_shape"] = x.sizes().vec();
    d["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    d["b_dtype"] = bias.has_value() ? static_cast<int64_t>(bias->scalar_type()) : int64_t(-1);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& d = ctx->saved_data;
    const bool has_bias = d.at("b_dtype").toInt() >= 0;
    variable_list out(16);  // by forward argument: dx, dW, db, then none for the operands, state rows and flags
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    const bool need_db = has_bias && ctx->needs_input_grad(2);
    // unpacked first: under non-reentrant activation checkpointing this runs the layer's forward again, which must
    // record its autograd graph (below the autograd keys it saved nothing, and checkpoint refused the mismatch)
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xqt = saved[0], &wqt = saved[1], &x_sinv = saved[2], &w_sinv = saved[3];
    const at::cuda::CUDAGuard guard(dy.device());
    c10::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const int64_t n = dy.size(-1);
    const at::Tensor dy2 = aligned_2d(dy, n);
    if (need_dx || need_dw) {
      at::Tensor dyq, dyqt;
      std::tie(dyq, dyqt) = cast(dy2, d.at("dy_scale").toTensor(), d.at("dy_amax_bits").toTensor(),
                                 d.at("e5m2").toBool() ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn, need_dw);
      const at::Tensor dy_sinv = d.at("dy_sinv").toTensor();
      if (need_dx) {
        at::Tensor dx = fp8_scaled_mm(dyq, wqt, dy_sinv, w_sinv, c10::nullopt, dy.scalar_type(), false);
        out[0] = at::_unsafe_view(dx, d.at("x_shape").toIntVector());
      }
      if (need_dw) {
        const auto w_dtype = static_cast<at::ScalarType>(d.at("w_dtype").toInt());
        const auto direct = w_dtype == at::kFloat || w_dtype == at::kBFloat16 ? w_dtype : at::kFloat;
        at::Tensor dw = fp8_scaled_mm(dyqt, xqt, dy_sinv, x_sinv, c10::nullopt, direct, false);
        out[1] = dw.scalar_type() == w_dtype ? dw : dw.to(w_dtype);
      }
    }
    if (need_db) out[2] = dy2.to(at::kFloat).sum(0).to(static_cast<at::ScalarType>(d.at("b_dtype").toInt()));
    return out;
  }
};

// AutogradCUDA: the layer's forward and backward in C++
at::Tensor fp8_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const at::Tensor& wq, const c10::optional<at::Tensor>& wqt, const at::Tensor& w_sinv,
                               const c10::optional<at::Tensor>& xq, const c10::optional<at::Tensor>& xqt,
                               const at::Tensor& x_sinv, const at::Tensor& x_scale, at::Tensor& x_amax_bits,
                               const at::Tensor& dy_scale, const at::Tensor& dy_amax_bits, const at::Tensor& dy_sinv,
                               bool e5m2_grad, bool fast_accum) {
  return Fp8Linear::apply(x, weight, bias, wq, wqt, w_sinv, xq, xqt, x_sinv, x_scale, x_amax_bits, dy_scale,
                          dy_amax_bits, dy_sinv, e5m2_grad, fast_accum);
}

// CUDA (below autograd: no-grad and inference-mode calls): the forward alone
at::Tensor fp8_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const at::Tensor& wq, const c10::optional<at::Tensor>& wqt, const at::Tensor& w_sinv,
                           const c10::optional<at::Tensor>& xq, const c10::optional<at::Tensor>& xqt,
                           const at::Tensor& x_sinv, const at::Tensor& x_scale, at::Tensor& x_amax_bits,
                           const at::Tensor& dy_scale, const at::Tensor& dy_amax_bits, const at::Tensor& dy_sinv,
                           bool e5m2_grad, bool fast_accum) {
  const at::cuda::CUDAGuard guard(x.device());
  return forward_math(x, wq, w_sinv, bias, xq, xqt, x_sinv, x_scale, x_amax_bits, fast_accum, false, nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(surogate, CUDA, m) { m.impl("ext_fp8_linear", &fp8_linear_cuda); }

TORCH_LIBRARY_IMPL(surogate, AutogradCUDA, m) { m.impl("ext_fp8_linear", &fp8_linear_autograd); }

}  // namespace surogate
