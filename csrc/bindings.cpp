// Python bindings of the csrc kernels: argument checks and launches only, no math.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace surogate {
void launch_cast_amax(const void* x, int dtype, const float* scale, void* q, bool e4m3, unsigned* amax, int64_t n,
                      int sms, cudaStream_t stream);
}

// q = sat_rne(x * scale) into the preallocated fp8 tensor q; amax_bits (int32 scalar, zeroed by the caller)
// receives max|x| as float bits.
void fp8_cast_amax(const torch::Tensor& x, const torch::Tensor& scale, torch::Tensor& q, torch::Tensor& amax_bits) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "fp8_cast_amax: x must be a contiguous CUDA tensor");
  TORCH_CHECK(q.is_contiguous() && q.numel() == x.numel(), "fp8_cast_amax: q must be contiguous with x's numel");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "fp8_cast_amax: scale must be one fp32 value");
  TORCH_CHECK(amax_bits.scalar_type() == at::kInt && amax_bits.numel() == 1, "fp8_cast_amax: amax_bits must be int32[1]");
  const bool e4m3 = q.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(e4m3 || q.scalar_type() == at::kFloat8_e5m2, "fp8_cast_amax: q must be float8_e4m3fn or float8_e5m2");
  int dtype;
  switch (x.scalar_type()) {
    case at::kFloat: dtype = 0; break;
    case at::kBFloat16: dtype = 1; break;
    case at::kHalf: dtype = 2; break;
    default: TORCH_CHECK(false, "fp8_cast_amax: x must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 8 == 0,
              "fp8_cast_amax: x must be 16-byte and q 8-byte aligned");
  const at::cuda::CUDAGuard guard(x.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  surogate::launch_cast_amax(x.data_ptr(), dtype, scale.data_ptr<float>(), q.data_ptr(), e4m3,
                             reinterpret_cast<unsigned*>(amax_bits.data_ptr<int>()), x.numel(), sms,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_cast_amax", &fp8_cast_amax, "per-tensor FP8 cast with fused amax");
}
