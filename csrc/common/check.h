// EXT_CHECK(cond, parts...): TORCH_CHECK with its message put together here from strings and numbers, never
// through std::ostringstream.
//
// Why: on the GPU machines (H100 and H200, torch 2.11) a TORCH_CHECK of this extension whose message streamed a number
// or a shape (c10::str builds those with a std::ostringstream in the caller's library) ended the process with a
// segmentation fault instead of raising; a message that is one string literal, which c10::str passes through as it
// is, raised a RuntimeError as it should (session 33: few_token_gemm with 65 rows and nvfp4_amax with axis 7 crashed,
// few_token_gemm's fmt check raised). So every check of csrc/*.cpp formats its message with msg() below
// (std::to_string and appends), and TORCH_CHECK receives one std::string, which c10::str also passes through.
// tests/kernels/test_gpu_kernels.py calls such checks in a subprocess and asserts the RuntimeError;
// tests/kernels/test_csrc_checks.py keeps TORCH_CHECK out of csrc.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <string>
#include <type_traits>

namespace surogate::check_detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <class T>
void append(std::string& s, c10::ArrayRef<T> v) {  // a tensor's sizes, as torch prints them: [2, 3]
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    append(s, v[i]);
  }
  s += ']';
}

}  // namespace surogate::check_detail

namespace surogate {
template <class... Parts>
std::string msg(const Parts&... parts) {
  std::string s;
  (check_detail::append(s, parts), ...);
  return s;
}
}  // namespace surogate

// (the message is built only when the check fails, as TORCH_CHECK's own)
#define EXT_CHECK(cond, ...) TORCH_CHECK(cond, ::surogate::msg(__VA_ARGS__))

// TORCH_CUDABLAS_CHECK's message has three strings, which c10::str also joins with a std::ostringstream: the same,
// through EXT_CHECK (needs ATen/cuda/Exceptions.h for the status name)
#define EXT_CUBLAS_CHECK(EXPR)                                                                            \
  do {                                                                                                    \
    const cublasStatus_t ext_status_ = (EXPR);                                                            \
    EXT_CHECK(ext_status_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error: ",                                     \
              at::cuda::blas::_cublasGetErrorEnum(ext_status_), " when calling `" #EXPR "`");            \
  } while (0)
