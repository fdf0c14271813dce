// The mixed-input WGMMA GEMMs' entry points (mixed_input_gemm.cu), declared once for their callers: the ops
// surogate::ext_mixed_input_gemm and ext_few_token_gemm (bindings.cpp) and the decode route's forward
// (decoded_linear.cpp).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace surogate {

// Whether the loaded library holds the kernel's SM90a code for device dev (an attribute query, safe under capture).
bool mixed_input_gemm_supported(int dev);

// y [M, N] bf16 (+)= x [M, K] bf16 @ deq(W)^T for an NVFP4 (fmt 0), MXFP4 (1) or NF4 (2) weight; the operands and
// their requirements are stated at the definition.
cudaError_t launch_mixed_input_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                    const float* gscale, const float* levels, int nf4_block,
                                    const float* nested_absmax, const float* nested_code, const float* nested_offset,
                                    void* y, int M, int N, int K, bool accumulate, int sms, int dev,
                                    cudaStream_t stream);

// The many-token launch's tiles (mixed_input_gemm.cu, launch_fmt), of kMixedInputRows weight rows and 64-column
// stages: 256-token tiles unless they would fill at most half the SMs. Then the same tiles with K split over a
// cluster of `split` CTAs (their partial sums added through DSMEM): the largest split whose clusters all fit at once
// (fits(split, clusters)), that leaves each CTA at least kMixedInputMinSplitSteps stages, and that either makes 4x
// the CTAs or leaves each CTA kMixedInputMinPairSteps stages. Otherwise 128-token tiles (twice the CTAs, m64n128
// WGMMAs: twice the decode per product).
// H200, 2652f14 + this rule's first form (any split of >= 8 stages), against 128-token tiles
// (benchmarks/results/decode/large_m_rs_split_first_form_h200.md): splits of 4-8 gained 21-99% (Llama-3.1-8B k/v,
// Qwen3-1.7B q / k/v / down and Qwen3-0.6B down at 512 tokens), 2-way splits of >= 32 stages 9-24% (8B q / down at
// 512, k/v at 2048), while 2-way splits of 8-16 stages lost 7-21% (Qwen3-0.6B q / k/v / gate at 512, k/v at 2048;
// 1.7B k/v at 2048). (64-token tiles at two CTAs per SM for the k/v projections at 2048 tokens were measured slower
// than 128-token ones: 0.41-0.44x cuBLAS against 0.55-0.59x, H200, aa68787.)
// surogate_hf.kernels.paths.mixed_input_tiles states the same rule.
constexpr int kMixedInputRows = 128, kMixedInputMaxSplit = 8;
constexpr int kMixedInputMinSplitSteps = 8, kMixedInputMinPairSteps = 32;
struct MixedInputTiles {
  int bm;     // tokens per tile: 256 or 128
  int split;  // CTAs per tile, each over a run of K
};
template <class Fits>
inline MixedInputTiles mixed_input_tiles(long long m, long long n, long long k, int sms, Fits fits) {
  const long long wide = ((n + kMixedInputRows - 1) / kMixedInputRows) * ((m + 255) / 256);
  const long long steps = (k + 63) / 64;
  if (2 * wide > sms) return {256, 1};
  for (long long s = steps / kMixedInputMinSplitSteps < kMixedInputMaxSplit ? steps / kMixedInputMinSplitSteps
                                                                              : kMixedInputMaxSplit;
       s >= 2; --s)
    if ((s >= 4 || steps / s >= kMixedInputMinPairSteps) && wide * s <= sms && fits((int)s, wide)) return {256, (int)s};
  return {128, 1};
}

// The share of the SMs' time that launch keeps busy: its CTAs over whole waves of one per SM (a split's clusters
// taken to fit)
inline double mixed_input_fill(long long m, long long n, long long k, int sms) {
  const MixedInputTiles t = mixed_input_tiles(m, n, k, sms, [](int, long long) { return true; });
  const long long ctas = ((n + kMixedInputRows - 1) / kMixedInputRows) * ((m + t.bm - 1) / t.bm) * t.split;
  const long long waves = (ctas + sms - 1) / sms;
  return (double)ctas / (double)(waves * sms);
}

// The many-token default's speed test (decoded_linear.cpp's mixed_input_applies adds the format, size and token
// bounds; its comment has the measurements): 256-token tiles (the 128-token ones decode twice per product), and
// kMixedInputSpeed x fill x (1 + kRouteDecodeTokens / m) >= 1, i.e. the kernel at kMixedInputSpeed x bf16 cuBLAS's
// speed per full wave against decode + cuBLAS at bf16's time x (1 + kRouteDecodeTokens / m); or, where each CTA runs
// at least kMixedInputLongSteps stages, a fill of at least kMixedInputLongFill (long runs amortize a tile's pipeline
// fill and epilogue, which the fill model undersold).
// surogate_hf.kernels.paths.mixed_input_fast_enough states the same test.
constexpr double kMixedInputSpeed = 0.97;
constexpr double kRouteDecodeTokens = 220;
constexpr double kMixedInputLongFill = 0.8;
constexpr long long kMixedInputLongSteps = 48;
inline bool mixed_input_fast_enough(long long m, long long n, long long k, int sms) {
  const MixedInputTiles tiles = mixed_input_tiles(m, n, k, sms, [](int, long long) { return true; });
  if (tiles.bm != 256) return false;
  const double fill = mixed_input_fill(m, n, k, sms);
  const long long run = ((k + 63) / 64 + tiles.split - 1) / tiles.split;  // stages per CTA
  return kMixedInputSpeed * fill * (1.0 + kRouteDecodeTokens / m) >= 1.0 ||
         (fill >= kMixedInputLongFill && run >= kMixedInputLongSteps);
}

// The few-token op's (ext_few_token_gemm) choice of kernel: a weight of at least kFewTokenWgmmaMinElements elements
// and kFewTokenWgmmaMinRows rows takes the register-operand WGMMA kernel (64-token tiles, K split over a cluster),
// where each weight fragment is decoded once for all the tokens, from kFewTokenWgmmaMinTokens to 64 tokens, and a wide
// one (kFewTokenWgmmaWideMinElements) from kFewTokenWgmmaWideMinTokens; elsewhere the few-token mma kernel, whose n8
// token tiles each repeat their mmas. Measured on the H200 (docs/kernels.md):
// - from 40 tokens the WGMMA kernel took 0.53-0.98x the time on Llama-3.1-8B's q / gate_up / down and Qwen3-1.7B's MLP
//   projections (NF4: 0.62-0.94x); 1.02-1.43x on the smaller weights (Qwen3-1.7B q and k/v, SmolLM2-135M's; the 8B
//   k/v 0.86-1.04x).
// - 33-39 tokens (session 35, 611ce17, benchmarks/results/decode/few_tokens_wgmma_from_17_h200.md): there the mma
//   kernel runs six n8 tiles of two 8-row groups a warp (17-32 tokens: four tiles of four groups, from the
//   shared-memory ring), 1.15-1.6x its time at 32 tokens on the large weights; at 39 tokens the WGMMA kernel ran at
//   1.08-1.89x its speed on every eligible weight measured (Llama-3.1-8B q / MLP, Qwen2.5-7B q / MLP, Qwen3-1.7B and
//   Gemma-2-2B gate_up, GPT-OSS-20B q) in all three formats.
// - 17-32 tokens (same run): on the wide MLP weights of Llama-3.1-8B (56M elements) and Qwen2.5-7B (65M) the WGMMA
//   kernel ran at 1.10-1.39x the mma kernel's speed (NF4 1.10-1.19x); on the 12-20M-element ones (Llama-3.1-8B q,
//   Qwen2.5-7B q, Qwen3-1.7B and Gemma-2-2B gate_up, GPT-OSS-20B q) at 0.86-0.99x in NVFP4 / MXFP4, hence the wide
//   bound between them.
// - The row bound: on Qwen3-1.7B's down projection (2048 rows: 16 tiles, whose K split leaves about one CTA per SM)
//   the mma kernel took 0.81-0.85x the WGMMA kernel's time at 40-48 tokens in NVFP4 (1.01x at 64; session 29, its
//   weight-as-A form) and 0.94-0.97x in NF4 (session 33, 72282d6's kernels: 0.84-0.88x at 40-48 tokens, 1.04-1.06x at
//   64); again 0.88x at 39 tokens (session 35). Qwen2.5-7B's 3584-row q / o and down projections (28 tiles) take it
//   since session 33 (the bound was 4096 rows): there the WGMMA kernel ran at 1.03-1.30x (q) and 1.47-1.78x (down)
//   the mma kernel's speed at 40-64 tokens in NVFP4 / MXFP4, 1.07-1.57x in NF4.
// surogate_hf.kernels.paths.few_token_wgmma states the same rule (and the caller checks mixed_input_gemm_supported).
constexpr int kFewTokenWgmmaMinTokens = 33;
constexpr long long kFewTokenWgmmaMinElements = 8ll << 20;
constexpr long long kFewTokenWgmmaMinRows = 3072;
constexpr int kFewTokenWgmmaWideMinTokens = 17;
constexpr long long kFewTokenWgmmaWideMinElements = 48ll << 20;
inline bool few_token_wgmma_applies(int fmt, long long m, long long n, long long k) {
  if (fmt < 0 || fmt > 2 || n < kFewTokenWgmmaMinRows || m > 64 || n * k < kFewTokenWgmmaMinElements) return false;
  return m >= kFewTokenWgmmaMinTokens || (m >= kFewTokenWgmmaWideMinTokens && n * k >= kFewTokenWgmmaWideMinElements);
}

// The K split of a few-token launch (this kernel's and the few-token mma kernel's, csrc/fp4/few_token_gemm.cu): the
// largest cluster (<= 8 CTAs) whose clusters all fit on the GPU at once; where not even clusters of 2 fit (before
// session 34: no split), several waves of clusters:
// - this kernel (33-64 tokens, 17-64 on wide weights) and the mma kernel at 17-32 tokens: 4 and 3 ways, where the
//   unsplit launch would fill at most 60% of a wave's CTA slots, else none (few_token_multi_wave_split). (The mma
//   kernel's 3 ways were measured on Qwen2.5-7B's gate / up below, which the WGMMA kernel takes from 17 tokens since
//   session 35; they stay for the many-row weights under the wide bound.)
// - the mma kernel at 1-16 tokens: 4 ways, or 3 where 4 would run NVFP4's split decode on its short-run ring of 2.
// Forced splits 1-8 on the H200 (session 34, benchmarks/results/decode/few_tokens_multi_wave_split_h200.md):
// - Qwen2.5-7B's 18944-row gate / up (148 tiles of this kernel, 296 of the mma kernel's: unsplit 56% of the slots, a
//   few SMs running two while the rest ran one): here 4 ways took 0.79-0.82x the time of none at 40-64 tokens (NVFP4
//   / NF4; 3 ways 0.83-0.85x, 5-8 ways up to 1.09x: their waves lost balance); the mma kernel 3 ways 0.82x at 32
//   tokens (4 ways 0.86-0.89x) and 0.93-0.94x at 1-8 in NVFP4, where 4 ways ran the split decode's short-run ring of
//   2 (few_token_gemm.cu: kShortRunSteps) and lost 3-5% to none; 4 ways 0.88-0.90x at 16 tokens and 0.92x at one
//   token in NF4 (3 ways 0.93-0.94x), MXFP4 0.84x at 1-8 tokens (its ring of 2 helps; 3 ways 0.90-0.91x)
//   (probe_few_token_split_b306e6d_h200.md, probe_few_token_split_1c44e0e_h200.md);
// - a 28672-row gate / up (Llama-3.1-70B; unsplit 85% of the slots): 4 ways took 1.06-1.08x none's time at 32-64
//   tokens (not split there) and 0.93-0.96x at 1-16 in every format (16 steps a CTA: no short runs);
// - where a split of 2+ fits one wave (Llama-3.1-8B, Gemma-2-2B, Qwen2.5-14B gate / up), the rule's split measured
//   within 0.5% of the best of 1-8 at 32-64 tokens.
constexpr int kFewTokenMultiWaveSplit = 4, kFewTokenMmaMultiWaveSplit = 3;  // (mma kernel: 3 where stated above)
inline int few_token_multi_wave_split(long long ctas, long long wave_ctas, int steps, int ways) {
  if (10 * ctas > 6 * wave_ctas) return 1;
  return steps < ways ? steps : ways;
}
// The split a few-token launch takes: the rule's, or SUROGATE_HF_FEW_TOKEN_SPLIT's forced one (bindings.cpp) where
// set, capped at the cluster size and at one CTA per K step
inline int few_token_split_or_forced(int rule_split, int forced_split, int steps) {
  if (forced_split <= 0) return rule_split;
  const int split = forced_split < kMixedInputMaxSplit ? forced_split : kMixedInputMaxSplit;
  return split < steps ? split : steps;
}

// y [M, N] bf16 = x [M, K] bf16 @ deq(W)^T for 1 <= M <= 64 by the register-operand kernel's K-split variant: fmt 0
// NVFP4, 1 MXFP4 (the operands as launch_mixed_input_gemm's), 2 NF4 (scales its fp32 absmax per nf4_block elements,
// a power of two >= 32 dividing K; levels its 16 values); forced_split 1-8 overrides the split rule (0: the rule)
cudaError_t launch_mixed_input_gemm_few_tokens(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                               const float* gscale, const float* levels, int nf4_block, void* y, int M,
                                               int N, int K, int dev, int forced_split, cudaStream_t stream);

}  // namespace surogate
