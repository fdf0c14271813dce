// Host build of csrc/fp4/nvfp4_math.cuh, driven by tests/kernels/test_csrc_host.py: the NVFP4 block math of the
// nvfp4_qdq kernels run on the CPU, element for element in the kernels' order, so the Python reference can check it
// bit for bit on a machine with no GPU. Input on stdin (binary): int64 R, C, axis, four_over_six, rule, stochastic,
// seed, has_signs; fp32 signs[16]; fp32 x[R * C]. Output on stdout: fp32 amax, fp32 g_dec, fp32 out[Rp * C].
// Element mode (R = -1, C = n): after the signs, fp32 y[n], fp32 u[n]; output the E2M1 values of y, round-to-nearest then
// stochastic with draw u (fp32 rne[n], sr[n]).
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../../csrc/fp4/nvfp4_math.cuh"

using namespace surogate::nvfp4;

static void read_exact(void* p, size_t n) {
  if (fread(p, 1, n, stdin) != n) {
    fprintf(stderr, "short input\n");
    exit(2);
  }
}

int main() {
  int64_t hdr[8];
  read_exact(hdr, sizeof hdr);
  const int64_t R = hdr[0], C = hdr[1], axis = hdr[2], fos = hdr[3], rule = hdr[4], sr = hdr[5], seed = hdr[6];
  const bool rht = hdr[7] != 0;
  float signs[kBlock];
  read_exact(signs, sizeof signs);
  if (R == -1) {
    std::vector<float> y(C), u(C), out(2 * C);
    read_exact(y.data(), C * 4);
    read_exact(u.data(), C * 4);
    for (int64_t i = 0; i < C; ++i) {
      out[i] = copysign_(e2m1_round_mag(abs_of(y[i])), y[i]);
      out[C + i] = copysign_(e2m1_sr_mag(abs_of(y[i]), u[i]), y[i]);
    }
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
  }
  std::vector<float> x(R * C);
  read_exact(x.data(), x.size() * 4);
  const int64_t Rp = axis == 1 ? R : (R + kBlock - 1) / kBlock * kBlock;
  const int64_t nblk = axis == 1 ? R * (C / kBlock) : (Rp / kBlock) * C;  // 1D blocks of the quantized tensor
  // gather block b's 16 values (after the transform) and the offset of its first element in the quantized tensor
  auto block = [&](int64_t b, float* v) -> int64_t {
    if (axis == 1) {
      for (int i = 0; i < kBlock; ++i) v[i] = x[b * kBlock + i];
    } else {
      const int64_t rb = b / C, c = b % C;
      for (int i = 0; i < kBlock; ++i) v[i] = rb * kBlock + i < R ? x[(rb * kBlock + i) * C + c] : 0.f;
    }
    if (rht) rht16(v, signs);
    return axis == 1 ? b * kBlock : (b % C) * Rp + (b / C) * kBlock;
  };
  uint32_t amax_bits = 0;
  float v[kBlock], q[kBlock];
  for (int64_t b = 0; b < nblk; ++b) {
    block(b, v);
    for (int i = 0; i < kBlock; ++i) amax_bits = amax_bits > abs_bits_of(v[i]) ? amax_bits : abs_bits_of(v[i]);
  }
  const float amax = float_of(amax_bits);
  const Globals g = globals_of(amax);
  std::vector<float> out(Rp * C);
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t off = block(b, v);
    if (fos)
      quantize_block<true>(v, g, (int)rule, sr != 0, seed_mix_of(seed), off, q);
    else
      quantize_block<false>(v, g, (int)rule, sr != 0, seed_mix_of(seed), off, q);
    for (int i = 0; i < kBlock; ++i) {
      if (axis == 1) out[b * kBlock + i] = q[i];
      else out[((b / C) * kBlock + i) * C + b % C] = q[i];
    }
  }
  fwrite(&amax, 4, 1, stdout);
  fwrite(&g.dec, 4, 1, stdout);
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
