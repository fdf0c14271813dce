// Host harness: the mixed-input kernel's launch and default-path rules of csrc/weight_only/mixed_input_gemm.h
// (mixed_input_tiles, mixed_input_fill, mixed_input_fast_enough, few_token_wgmma_applies), one line of stdin
// "m n k sms fmt" each, answered "bm split fill fast_enough few_token_wgmma" (fill to 17 digits), for
// tests/kernels/test_csrc_host.py to compare with the Python mirror (surogate_hf.kernels.paths).
#include <cstdio>

#include "../../../csrc/weight_only/mixed_input_gemm.h"

int main() {
  long long m, n, k;
  int sms, fmt;
  while (std::scanf("%lld %lld %lld %d %d", &m, &n, &k, &sms, &fmt) == 5) {
    const surogate::MixedInputTiles t = surogate::mixed_input_tiles(m, n, k, sms, [](int, long long) { return true; });
    std::printf("%d %d %.17g %d %d\n", t.bm, t.split, surogate::mixed_input_fill(m, n, k, sms),
                (int)surogate::mixed_input_fast_enough(m, n, k, sms),
                (int)surogate::few_token_wgmma_applies(fmt, m, n, k));
  }
  return 0;
}
