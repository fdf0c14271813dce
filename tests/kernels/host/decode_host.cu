// Host build of csrc/weight_only/decode_math.cuh, driven by tests/kernels/test_csrc_host.py: the dense decode's element
// math (the kernel's element-by-element path and the spec of its vector path) run on the CPU, so the Python reference
// decode can check it bit for bit on a machine with no GPU.
// Input on stdin (binary): int64 fmt, n, k, block, w_bytes, scale_bytes; w[w_bytes]; scales[scale_bytes] (raw bytes:
// one-byte scales for fmt 0/1 and a double-quantized NF4 absmax, fp32 for 2/3); fp32 gscale; fp32 levels[16];
// int64 nested_count (0: no NF4 double quantization), then fp32 nested_absmax[nested_count], nested_code[256], offset.
// Output on stdout: fp32 out[n * k].
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../../csrc/weight_only/decode_math.cuh"

using namespace surogate::decode;

static void read_exact(void* p, size_t n) {
  if (fread(p, 1, n, stdin) != n) {
    fprintf(stderr, "short input\n");
    exit(2);
  }
}

template <int FMT>
static void run(const Weight& a, const float* levels, float* out) {
  for (int64_t e = 0; e < a.n * a.k; ++e) out[e] = element<FMT>(a, levels, e);
}

int main() {
  int64_t hdr[6];
  read_exact(hdr, sizeof hdr);
  const int64_t fmt = hdr[0], n = hdr[1], k = hdr[2], block = hdr[3], w_bytes = hdr[4], scale_bytes = hdr[5];
  std::vector<uint8_t> w(w_bytes), scales(scale_bytes);
  read_exact(w.data(), w_bytes);
  read_exact(scales.data(), scale_bytes);
  float gscale, levels[16];
  read_exact(&gscale, 4);
  read_exact(levels, sizeof levels);
  int64_t nested_count;
  read_exact(&nested_count, 8);
  std::vector<float> nested_absmax(nested_count), nested_code(nested_count ? 256 : 0);
  float offset = 0.f;
  if (nested_count) {
    read_exact(nested_absmax.data(), 4 * nested_count);
    read_exact(nested_code.data(), 4 * 256);
    read_exact(&offset, 4);
  }
  const bool u8 = fmt <= 1 || nested_count;
  const Weight a{w.data(), u8 ? scales.data() : nullptr, u8 ? nullptr : reinterpret_cast<const float*>(scales.data()),
                 &gscale, levels, n, k, (int)block, nested_count ? nested_absmax.data() : nullptr,
                 nested_count ? nested_code.data() : nullptr, nested_count ? &offset : nullptr};
  std::vector<float> out(n * k);
  if (fmt == 0) run<0>(a, levels, out.data());
  else if (fmt == 1) run<1>(a, levels, out.data());
  else if (fmt == 2) run<2>(a, levels, out.data());
  else run<3>(a, levels, out.data());
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
