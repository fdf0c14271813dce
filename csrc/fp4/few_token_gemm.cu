// Few-token weight-only GEMM: y [M, N] = x [M, K] @ deq(W)^T for a frozen 4-bit weight W [N, K] (NVFP4, MXFP4
// or NF4), M <= 64 (kernels.paths.FEW_TOKEN_MAX_TOKENS), x in bf16. With so few tokens the GEMM is bound
// by reading the weight, 0.5 byte per element against bf16's 2, so the kernel streams the packed codes once:
//   - each lane loads 16 bytes (32 codes) of one weight row per 128-column step, 4 lanes per row, 2-4 steps ahead
//     (into registers, or at 17-32 tokens on large weights into its own shared-memory slots, few_token_smem_ring),
//     and decodes them in registers (E2M1 by byte permutes, or on large weights at 1-8 tokens by shifts and masks
//     into the bf16 exponent field, few_token_split_decode; NF4 by a 16-level table) straight into bf16 mma
//     operands;
//   - the weight is the mma's A operand (an m16 tile: 16 weight rows) and x^T its B operand (n8 tiles of 8 tokens),
//     so y^T is what the mmas sum. A lane's decoded words of rows g and g + 8 are its A fragments as they are, and a
//     token tile's B fragment is two consecutive words of one 16-byte shared-memory load: no register moves, and
//     with <= 8 tokens no zero rows are staged or loaded. (Until session 29 x was the A operand in m16 token
//     tiles: from 9 tokens its fragments were assembled from two loads by register moves, 16% of the instructions
//     at 16 tokens, and with 1-8 tokens half of every x stage and load was zeros.)
//   - the reduction order inside an mma is free, so lane q's 32 codes fill its k-slots of 8 consecutive m16n8k16
//     steps, and x is staged in shared memory (cp.async, row-major, swizzled) in the same order; where the CTA's
//     whole x range fits (the usual case), it is copied once before the loop, which then has no barrier;
//   - the K range is split over up to 8 CTAs of one thread-block cluster (SM90), whose fp32 partials are summed
//     through distributed shared memory in a fixed order (deterministic, one launch, no workspace).
// Numerics: each decoded element is the reference's, rounded to bf16 (exact for NVFP4 and MXFP4: e2m1 times a
// block scale has at most 5 significant bits); products accumulate in fp32; the NVFP4 decode global multiplies
// the fp32 sum once, like the Triton kernels' bf16 path. Only the fp32 summation order differs from
// x.float() @ deq(W).float().T. The reference and the decision of when this kernel runs: surogate::ext_few_token_gemm
// (surogate_hf/ops/ext.py) and surogate_hf.kernels.paths.few_token_kernel.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <type_traits>

#include "../weight_only/mixed_input_gemm.h"
#include "e2m1_decode.cuh"

namespace surogate {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 128;  // 4 warps; warp w owns the 8-row weight groups [w * NT, (w + 1) * NT) of the CTA's rows
constexpr int kStep = 128;     // K per main-loop step: 4 lanes x 32 codes of each weight row
constexpr int kMaxSplit = kMixedInputMaxSplit;  // the portable cluster size
constexpr int kMaxDevices = 64;  // the per-device shared-memory opt-in is a bit mask
constexpr int kRowBytes = kStep * 2;  // one token's x in a stage (kStep bf16)
using namespace wdec;

__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The weight as a CTA reads it: its first row's codes and scales, from which each lane's row is one 32-bit byte
// offset of its codes (the scale's index follows from it by a shift: K/16 scales per K/2 code bytes for NVFP4, K/32
// for MXFP4, one NF4 block per 2^shift elements). One register per row and a few integer ops per step: with the
// lane's three 64-bit pointers per row the compiler ran out of registers and rebuilt each address per load (~30
// instructions, as many as the decode of 8 codes). Rows past N read row N - 1 (in bounds; their sums are never
// stored), so a load checks the K tail only.
template <int FMT>
struct CtaWeights {
  const uint8_t* codes;  // w + n_cta * K/2
  const uint8_t* scale;  // NVFP4: + n_cta * K/16; MXFP4: + n_cta * K/32
  const float* absmax;   // NF4: + n_cta * K >> shift (K is a multiple of the block)

  __device__ __forceinline__ CtaWeights(const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
                                        const float* __restrict__ am, int64_t n_cta, int K, int nf4_shift)
      : codes(w + n_cta * (K / 2)),
        scale(FMT == kNVFP4 ? scales + n_cta * (K / 16) : FMT == kMXFP4 ? scales + n_cta * (K / 32) : nullptr),
        absmax(FMT == kNF4 ? am + ((n_cta * K) >> nf4_shift) : nullptr) {}

  // the byte offset of lane q's first 16 codes of row n_cta + row (clamped to N - 1)
  static __device__ __forceinline__ int lane_offset(int row, int64_t n_cta, int N, int K, int q) {
    const int last = (int)(N - 1 - n_cta);  // < BN where the tile passes N
    return (row < last ? row : last) * (K / 2) + q * 16;
  }

  __device__ __forceinline__ LaneWeights load(int offset, int step, int q, int K, int nf4_shift) const {
    LaneWeights lw{make_uint4(0, 0, 0, 0), 0u};  // past K: zero codes, zero scale -> zero products
    if (step * kStep + q * 32 < K) {
      const int o = offset + step * (kStep / 2);
      lw.codes = ld_stream(codes + o);
      lw.scale = load_scale(o, nf4_shift);
    }
    return lw;
  }

  // load's codes into this lane's 16-byte slot of a shared-memory ring instead (cp.async, zeros past K); returns
  // the scale (0 past K)
  __device__ __forceinline__ uint32_t copy(unsigned char* slot, int offset, int step, int q, int K,
                                           int nf4_shift) const;

  __device__ __forceinline__ uint32_t load_scale(int o, int nf4_shift) const {
    if (FMT == kNVFP4) return *reinterpret_cast<const unsigned short*>(scale + (o >> 3));
    if (FMT == kMXFP4) return scale[o >> 4];
    return __float_as_uint(absmax[(2 * o) >> nf4_shift]);
  }
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  // 16 bytes global -> shared; valid == false writes zeros
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async16_stream(void* smem, const void* gmem, bool valid) {
  // 16 bytes global -> shared through L2 only (the weight is read once per call); valid == false writes zeros
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}

template <int FMT>
__device__ __forceinline__ uint32_t CtaWeights<FMT>::copy(unsigned char* slot, int offset, int step, int q, int K,
                                                          int nf4_shift) const {
  const bool in_k = step * kStep + q * 32 < K;
  const int o = offset + step * (kStep / 2);
  cp_async16_stream(slot, in_k ? codes + o : codes, in_k);
  return in_k ? load_scale(o, nf4_shift) : 0u;
}

// x stages in shared memory row-major, one token's kStep columns (256 bytes) a row, 16-byte chunk ch of row r at
// slot ch ^ ((ch >> 3) & 1 | (r & 1) << 1). The B fragments of lane (g, q) for the 8 mma steps of a step are columns
// [32q, 32q + 32) of token g of each n8 token tile: chunks 4q .. 4q + 3, one 16-byte load per tile per two mma steps
// (the k permutation makes each lane's columns contiguous). The 8 lanes of a quarter-warp (g = 2p, 2p + 1, q = 0..3)
// then read 8 different bank groups, and 8 consecutive threads copying one row's chunks write 8.
__device__ __forceinline__ int x_chunk_byte(int row, int ch) {
  return row * kRowBytes + ((ch ^ (((ch >> 3) & 1) | ((row & 1) << 1))) << 4);
}

// A stage of T8 n8 token tiles: 8 rows with one tile, else 16 per pair of tiles (the copies below go by 16 rows)
template <int T8>
struct XStage {
  static constexpr int kRows = T8 == 1 ? 8 : 16 * ((T8 + 1) / 2);
  static constexpr int kBytes = kRows * kRowBytes;
  static constexpr int kCopies = T8 == 1 ? 1 : 2;  // 16-byte chunks per thread and 16 rows (8 rows: 128 chunks)
};

// A thread's x copies of one step: chunks t (and t + 128) of each 16 rows (row = chunk / 16, 8 columns each), rows < M
// only; rows >= M stay zero (the stages are zeroed once), columns past K are written as zeros. Offsets fixed across
// steps.
template <int T8>
struct XRowCopies {
  static constexpr int kCopies = XStage<T8>::kCopies, kGroups = XStage<T8>::kRows / 16 > 0 ? XStage<T8>::kRows / 16 : 1;
  int smem[kCopies];  // byte offset in a stage, rows 0-15
  int gmem[kCopies];  // elements into x, step 0, rows 0-15
  int col[kCopies];   // first column at step 0
  int row[kCopies];   // row among rows 0-15

  __device__ __forceinline__ XRowCopies(int K) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = threadIdx.x + i * kThreads, r = c >> 4, ch = c & 15;
      smem[i] = x_chunk_byte(r, ch);
      row[i] = r;
      col[i] = ch * 8;
      gmem[i] = r * K + col[i];
    }
  }

  __device__ __forceinline__ void issue(unsigned char* stage, const __nv_bfloat16* __restrict__ x, int M, int K,
                                        int step) const {
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        if (grp * 16 + row[i] >= M) continue;
        const bool col_ok = col[i] + step * kStep < K;
        cp_async16(stage + grp * 16 * kRowBytes + smem[i],
                   col_ok ? x + gmem[i] + (int64_t)(grp * 16) * K + step * kStep : x, col_ok);
      }
    }
  }

  // the split decode's order (e2m1_decode.cuh: split_order) for this thread's chunks of a stage, once its copies
  // have landed
  __device__ __forceinline__ void reorder(unsigned char* stage, int M) const {
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        if (grp * 16 + row[i] >= M) continue;
        uint4* chunk = reinterpret_cast<uint4*>(stage + grp * 16 * kRowBytes + smem[i]);
        *chunk = split_order(*chunk);
      }
    }
  }
};

// RESIDENT: x for the CTA's whole K range is copied into shared memory once, before the loop (one stage per step), so
// the loop has no barrier and no copies: each warp streams its weight rows at its own pace. Taken where that fits in
// the shared memory of the split the staged variant would get (few_token_plan below). Otherwise x rotates through
// kDepth stages, one barrier per step.
// T8: n8 token tiles of 8 tokens (1, 2, 4, 6 or 8: launch_fmt). NT: 8-row weight groups per warp, 2 or 4 (one or two
// m16 weight tiles), or 1 for small weights (more CTAs; with one token tile an m16 weight tile whose rows g + 8 are
// zeros, from two on x as the A operand: kXAsA below).
template <int T8, int NT>
constexpr int few_token_ctas_per_sm() { return (T8 <= 2 && NT <= 2) || (T8 <= 4 && NT == 1) ? 4 : 1; }

// Steps of weight codes in flight per lane (the ring below): 2 with two m16 tiles a warp, else 4 ...
template <int NT>
__host__ __device__ constexpr int few_token_depth() { return NT == 4 ? 2 : 4; }
// ... and the split-order E2M1 decode (e2m1_decode.cuh: decode_lane_split) with 1-8 tokens on weights of one m16
// tile a warp, where it also takes a ring of 2 when a CTA runs at most kShortRunSteps steps (session 30 also gave it
// to MXFP4 with 17-32 tokens on weights of two m16 tiles a warp, for its registers, until the shared-memory ring
// below made the byte permutes faster there). Measured against the byte-permute decode (H200, session 30,
// benchmarks/results/decode/few_tokens_split_decode_h200.md, few_tokens_mxfp4_32_split_h200.md): it cut the ALU
// pipe's share from 46% to 34% at one token on Llama-3.1-8B's gate/up (the instruction count unchanged; the kernel
// is latency-bound, 20% of the warp slots occupied) and took 4-5% off the 8B's gate/up and down at 1-8 tokens; the
// ring of 2 took 6-11% more off on short runs (4-5 steps a CTA: 8B q, Qwen3-1.7B gate/up) but cost 4-13% on the
// 8B's 14-16-step runs. MXFP4 at 17-32 tokens gained 10-18% (8B, Qwen2.5-7B and Qwen3-1.7B q / gate_up / down), which
// put it 4-14% ahead of NVFP4 there, where it had been 1-8% behind; NVFP4 in that variant lost 6-13% (its scale
// conversion is longer; 227 registers against 203). Elsewhere the split decode lost (a first form took it
// everywhere): 5-10% on one-group weights (SmolLM2-135M, the 8B and 1.7B k/v; the x reordering before the loop, a
// larger share of their short runs, the likely cause) and 1-5% at 9-16 tokens, where x's loads and the mmas outweigh
// the decode. The gains are small because the decode was never the only bound: Nsight Compute at one token put 41%
// of the issue slots busy either way.
template <int FMT, int T8, int NT>
__host__ __device__ constexpr bool few_token_split_decode() {
  return FMT != kNF4 && T8 == 1 && NT == 2;
}

// NVFP4 / MXFP4 with two m16 weight tiles a warp (17-32 tokens on large weights) and x resident keep the weight
// ring's codes in shared memory (cp.async into one 16-byte slot per thread, 8-row group and step; the scales stay in
// registers), not in registers: that took the kernels from 193-203 registers (2 CTAs an SM) to 126-134 (3-4).
// Measured against the register ring (H200, session 31, results/decode/few_tokens_17_32_smem_ring_h200.md): NVFP4
// +1-55% on the large weights of Llama-3.1-8B, Qwen2.5-7B and Qwen3-1.7B at 17-32 tokens (8B gate/up 0.85-0.89x ->
// 1.03-1.09x bf16, Qwen2.5-7B gate/up 0.68-0.70x -> 1.01-1.08x); MXFP4 with the byte-permute decode there (the split
// decode, which session 30 gave it for its registers, lost 5-18% more with the ring in shared memory) -7% to +45%,
// 0.999-1.03x NVFP4 on every row. The same ring for every variant was measured too and lost up to 15% where the
// register ring already let 4 CTAs onto an SM (Llama-3.1-8B down at 1-8 tokens; not profiled), and padding shared
// memory to spread CTAs evenly made that worse (few_tokens_smem_ring_variants_h200.md). NF4 (255 registers either
// way) is not measured with it and keeps the register ring, as do the staged variants (x rotating through stages:
// at 17-32 tokens only weights of many rows and a long K take them, none of the shapes table's, so they were neither
// measured nor tested with it).
template <int FMT, int NT, bool RESIDENT>
__host__ __device__ constexpr bool few_token_smem_ring() { return FMT != kNF4 && NT == 4 && RESIDENT; }
template <int FMT, int NT, bool RESIDENT, int DEPTH>
__host__ __device__ constexpr int few_token_wring_bytes() {
  return few_token_smem_ring<FMT, NT, RESIDENT>() ? DEPTH * NT * kThreads * 16 : 0;
}
constexpr int kShortRunSteps = 8;

template <int FMT, int T8, int NT, bool RESIDENT, int DEPTH>
__global__ void __launch_bounds__(kThreads, few_token_ctas_per_sm<T8, NT>()) few_token_gemm_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
    const float* __restrict__ absmax, const float* __restrict__ nf4_levels, const float* __restrict__ gscale,
    __nv_bfloat16* __restrict__ y, int M, int N, int K, int nf4_shift, int steps_per_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int BN = 4 * NT * 8;  // weight rows (output columns) per CTA
  constexpr int WT = NT == 4 ? 2 : 1;  // m16 weight tiles per warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int split = gridDim.y, s = blockIdx.y;
  const int64_t n_cta = (int64_t)blockIdx.x * BN;
  const int steps = (K + kStep - 1) / kStep;
  const int step_lo = s * steps_per_split, step_hi = min(step_lo + steps_per_split, steps);

  // the codes of the next kDepth steps stay in flight per lane (a register ring, indexed statically by unrolling the
  // step loop kDepth times, or few_token_smem_ring's slots in shared memory); staged, the x tiles of the next
  // kDepth - 1 steps too (cp.async): with one step ahead, or x read from L2 at its use, the kernel waited a memory
  // latency per step
  constexpr int kDepth = DEPTH;
  constexpr bool kSplit = few_token_split_decode<FMT, T8, NT>();  // (x staged in the same split order)
  constexpr int kStageBytes = XStage<T8>::kBytes;
  const int stages = RESIDENT ? step_hi - step_lo : kDepth;
  __shared__ float levels[16];
  // the weight ring (kSmemRing), then the x stages; after the loop the fp32 partial tile from the start
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr bool kSmemRing = few_token_smem_ring<FMT, NT, RESIDENT>();
  unsigned char* const xsm = smem + few_token_wring_bytes<FMT, NT, RESIDENT, DEPTH>();
  // this thread's slot of ring entry (i, nt): a warp's reads are 512 contiguous bytes, and only this thread writes
  // the slot (its cp.async.wait_group suffices: no barrier)
  auto wring_slot = [&](int i, int nt) { return smem + ((i * NT + nt) * kThreads + threadIdx.x) * 16; };

  // the weight stream starts first: its loads fly while x is staged
  const CtaWeights<FMT> wts(w, scales, absmax, n_cta, K, nf4_shift);
  const E2M1Tables tables((threadIdx.x * (unsigned)M) >> 31);
  int rows[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) rows[nt] = CtaWeights<FMT>::lane_offset((warp * NT + nt) * 8 + g, n_cta, N, K, q);
  // (kSmemRing: only the scales in registers, the codes in shared memory, one cp.async group per step)
  LaneWeights ring[kDepth][NT];
#pragma unroll
  for (int i = 0; i < kDepth; ++i) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if constexpr (kSmemRing)
        ring[i][nt].scale =
            step_lo + i < step_hi ? wts.copy(wring_slot(i, nt), rows[nt], step_lo + i, q, K, nf4_shift) : 0u;
      else
        ring[i][nt] = step_lo + i < step_hi ? wts.load(rows[nt], step_lo + i, q, K, nf4_shift)
                                            : LaneWeights{make_uint4(0, 0, 0, 0), 0u};
    }
    if constexpr (kSmemRing) cp_async_commit();
  }

  if (FMT == kNF4) {
    if (threadIdx.x < 16) levels[threadIdx.x] = nf4_levels[threadIdx.x];
  }
  // every stage zeroed once (rows >= M stay zero), before any copy lands in them
  if (M < XStage<T8>::kRows)
    for (int c = threadIdx.x; c < stages * kStageBytes / 16; c += kThreads)
      reinterpret_cast<uint4*>(xsm)[c] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const XRowCopies<T8> xcopy(K);
  if constexpr (RESIDENT) {
    for (int step = step_lo; step < step_hi; ++step) xcopy.issue(xsm + (step - step_lo) * kStageBytes, x, M, K, step);
    cp_async_commit();
    cp_async_wait<0>();
    if constexpr (kSplit)
      for (int step = step_lo; step < step_hi; ++step) xcopy.reorder(xsm + (step - step_lo) * kStageBytes, M);
    __syncthreads();
  } else {
#pragma unroll
    for (int i = 0; i < kDepth - 1; ++i) {
      if (step_lo + i < step_hi) xcopy.issue(xsm + i * kStageBytes, x, M, K, step_lo + i);
      cp_async_commit();
    }
  }

  // A one-group weight tile (NT 1) would leave half of each mma's rows empty, which doubles the mmas from two token
  // tiles on: there x stays the A operand (m16 token tiles, each fragment assembled from the loads of tokens g and
  // g + 8 by register moves) and the decoded words are B fragments, as before session 29 (new orientation at 16-32
  // tokens with NT 1: Llama-3.1-8B k/v and Qwen3-1.7B q / down 3-8% slower, H200)
  constexpr bool kXAsA = NT == 1 && T8 >= 2;
  // one token tile (with x as A: one m16 one): the even and odd mma steps of each tile accumulate apart (two
  // dependency chains where one serialized every mma of a step on the one before), summed at the end
  constexpr int kChains = T8 == 1 || (kXAsA && T8 == 2) ? 2 : 1;
  float acc[WT][T8][kChains][4];
#pragma unroll
  for (int wt = 0; wt < WT; ++wt)
#pragma unroll
    for (int tt = 0; tt < T8; ++tt)
#pragma unroll
      for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[wt][tt][c][i] = 0.f;

  // this lane's B chunk c of token g of tile tt at xrow + tt * 8 rows + ((4q + c) ^ xswz) * 16 (x_chunk_byte: token
  // g + 8 tt has g's parity, so the same slot)
  const int xrow = g * kRowBytes, xswz = ((q >> 1) & 1) | ((g & 1) << 1);

  for (int base = step_lo; base < step_hi; base += kDepth) {
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int step = base + i;
      if (step >= step_hi) break;
      if constexpr (!RESIDENT) {
        cp_async_wait<kDepth - 2>();  // this step's x stage (this thread's copies) ...
        if constexpr (kSplit) xcopy.reorder(xsm + i * kStageBytes, M);
        __syncthreads();              // ... and everyone's; the stage read last step is free again
        if (step + kDepth - 1 < step_hi)
          xcopy.issue(xsm + ((i + kDepth - 1) % kDepth) * kStageBytes, x, M, K, step + kDepth - 1);
        cp_async_commit();
      } else if constexpr (kSmemRing) {
        // cp.async groups: the prologue commits one per step of weights (kDepth), then one for all of x, waited for
        // there; each step commits one with the weights kDepth steps ahead. So this step's are complete once at most
        // kDepth - 1 newer groups are pending (this thread's own copies: no barrier)
        cp_async_wait<kDepth - 1>();
      }
      // the lane's 32 decoded elements of each of its rows: word i = elements 2i, 2i + 1 (split decode: word 4c + j =
      // elements 8c + j, 8c + j + 4, and x's words the same)
      uint32_t d[NT][16];
      if constexpr (kSmemRing) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) ring[i][nt].codes = *reinterpret_cast<const uint4*>(wring_slot(i, nt));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if constexpr (kSplit)
          decode_lane_split<FMT>(ring[i][nt], d[nt]);
        else
          decode_lane<FMT>(ring[i][nt], levels, tables, d[nt]);
        // (past the split's last step the slot is never decoded again: left as it is, no select, no second copy of
        // the loop body; kSmemRing: this thread refills the slot after its own read of it, which the decode consumed)
        if (step + kDepth < step_hi) {
          if constexpr (kSmemRing)
            ring[i][nt].scale = wts.copy(wring_slot(i, nt), rows[nt], step + kDepth, q, K, nf4_shift);
          else
            ring[i][nt] = wts.load(rows[nt], step + kDepth, q, K, nf4_shift);
        }
      }
      if constexpr (kSmemRing) cp_async_commit();
      const unsigned char* stage = xsm + (RESIDENT ? (step - step_lo) : i) * kStageBytes;
      if constexpr (kXAsA) {
#pragma unroll
        for (int mt = 0; mt < T8 / 2; ++mt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            // A fragments of mma steps 2c, 2c + 1: tokens (g, g + 8) of m16 tile mt, chunk c of the lane's columns
            const unsigned char* tile = stage + mt * 16 * kRowBytes + xrow + (((4 * q + c) ^ xswz) << 4);
            const uint4 lo = *reinterpret_cast<const uint4*>(tile);
            const uint4 hi = *reinterpret_cast<const uint4*>(tile + 8 * kRowBytes);  // (same parity: same slot)
            const uint32_t f0[4] = {lo.x, hi.x, lo.y, hi.y}, f1[4] = {lo.z, hi.z, lo.w, hi.w};
            mma_16816(acc[0][mt][0], f0, d[0][4 * c], d[0][4 * c + 1]);
            mma_16816(acc[0][mt][kChains - 1], f1, d[0][4 * c + 2], d[0][4 * c + 3]);
          }
      } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        // chunk c of the lane's columns: mma steps 2c and 2c + 1. Mma step j takes k-slots (2q, 2q + 1) from columns
        // 4j, 4j + 1 of the lane's range and (2q + 8, 2q + 9) from 4j + 2, 4j + 3, in A (decoded words 2j, 2j + 1
        // of rows g and g + 8) and B (x words 2j, 2j + 1 of token g) alike
        uint4 xb[T8];
#pragma unroll
        for (int tt = 0; tt < T8; ++tt)
          xb[tt] = *reinterpret_cast<const uint4*>(stage + xrow + tt * 8 * kRowBytes + (((4 * q + c) ^ xswz) << 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
#pragma unroll
          for (int wt = 0; wt < WT; ++wt) {
            // rows g + 8: the warp's next 8-row group (NT 1, one token tile: zeros)
            const uint32_t* lo = d[2 * wt];
            const uint32_t* hi = d[NT == 1 ? 0 : 2 * wt + 1];
            const uint32_t a[4] = {lo[2 * j], NT == 1 ? 0u : hi[2 * j], lo[2 * j + 1], NT == 1 ? 0u : hi[2 * j + 1]};
#pragma unroll
            for (int tt = 0; tt < T8; ++tt)
              mma_16816(acc[wt][tt][kChains == 2 ? (j & 1) : 0], a, h ? xb[tt].z : xb[tt].x, h ? xb[tt].w : xb[tt].y);
          }
        }
      }
      }
    }
  }
  if constexpr (kChains == 2) {
#pragma unroll
    for (int wt = 0; wt < WT; ++wt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[wt][0][0][i] += acc[wt][0][1][i];
  }
  cp_async_wait<0>();
  __syncthreads();  // the x stages become the partial tile
  float* partial = reinterpret_cast<float*>(smem);  // [T8 * 8][BN] fp32: this CTA's share of the sum

  if constexpr (kXAsA) {
    // C fragment with x as A (y): c0, c1 at token g of m16 tile mt, weight rows 2q, 2q + 1 of the warp's 8; c2, c3 at
    // token g + 8
#pragma unroll
    for (int mt = 0; mt < T8 / 2; ++mt) {
      const int col = warp * 8 + 2 * q, tok = mt * 16 + g;
      partial[tok * BN + col] = acc[0][mt][0][0];
      partial[tok * BN + col + 1] = acc[0][mt][0][1];
      partial[(tok + 8) * BN + col] = acc[0][mt][0][2];
      partial[(tok + 8) * BN + col + 1] = acc[0][mt][0][3];
    }
  } else {
    // C fragment (y^T): c0, c1 at weight row g, tokens 2q, 2q + 1 of the n8 tile; c2, c3 at row g + 8
#pragma unroll
    for (int wt = 0; wt < WT; ++wt)
#pragma unroll
      for (int tt = 0; tt < T8; ++tt) {
        const int col = (warp * NT + 2 * wt) * 8 + g, tok = tt * 8 + 2 * q;
        partial[tok * BN + col] = acc[wt][tt][0][0];
        partial[(tok + 1) * BN + col] = acc[wt][tt][0][1];
        if (NT > 1) {
          partial[tok * BN + col + 8] = acc[wt][tt][0][2];
          partial[(tok + 1) * BN + col + 8] = acc[wt][tt][0][3];
        }
      }
  }
  // (NVFP4's split-order words carry 2^-8: exact to take back here, the sums being those of 2^-8 times the products)
  const float gdec =
      (gscale != nullptr ? *gscale : 1.f) * (kSplit && FMT == kNVFP4 ? float(1 << kNvfp4SplitLog2) : 1.f);
  const int E = M * BN;  // rows past M are zeros: not summed
  if (split == 1) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) {
      const int64_t n = n_cta + e % BN;
      if (n < N) y[(int64_t)(e / BN) * N + n] = __float2bfloat16_rn((0.f + partial[e]) * gdec);
    }
    return;
  }
  // the cluster's CTAs hold partial sums over consecutive K ranges; each sums a strided share of the tile over
  // ranks 0 .. split - 1 in order (the sum is the same whichever CTA computes it), all remote loads issued first
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int e = s * kThreads + threadIdx.x; e < E; e += split * kThreads) {
    float v[kMaxSplit];
#pragma unroll
    for (int r = 0; r < kMaxSplit; ++r) v[r] = r < split ? cluster.map_shared_rank(partial, r)[e] : 0.f;
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxSplit; ++r)
      if (r < split) sum += v[r];
    const int64_t n = n_cta + e % BN;
    if (n < N) y[(int64_t)(e / BN) * N + n] = __float2bfloat16_rn(sum * gdec);
  }
  // no CTA leaves while another still reads its shared memory. Relaxed: every remote load above has delivered its value
  // (each fed a store), so nothing needs publishing, and the release form cost a GPU-scope memory barrier per CTA
  // (Nsight Compute: ~10% of the warps' stall samples at 4096 x 4096, one token)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}

// One compiled variant: its launch configuration, its shared-memory opt-in and how many of its clusters fit at once.
template <int FMT, int T8, int NT, bool RESIDENT, int DEPTH>
struct Variant {
  static constexpr int BN = 4 * NT * 8;
  static constexpr int kDepth = DEPTH;
  static constexpr size_t kStageBytes = XStage<T8>::kBytes;
  static constexpr size_t kPartialBytes = T8 * 8 * BN * sizeof(float);
  // staged: kDepth stages; resident: one per step of the split, up to what one SM holds (the planner also keeps the
  // split the staged variant would get, so residency never costs occupancy there)
  static constexpr size_t kWRingBytes = few_token_wring_bytes<FMT, NT, RESIDENT, DEPTH>();
  static constexpr size_t kMaxSmem =
      RESIDENT ? 200 * 1024 : std::max<size_t>(kWRingBytes + kDepth * kStageBytes, kPartialBytes);

  // dynamic shared memory of a launch whose CTAs run steps_per_split steps (rounded up to 4 KiB: fewer occupancy
  // queries)
  static size_t smem(int steps_per_split) {
    if (!RESIDENT) return kMaxSmem;
    const size_t bytes = std::max<size_t>(kWRingBytes + (size_t)steps_per_split * kStageBytes, kPartialBytes);
    return (bytes + 4095) / 4096 * 4096;
  }

  static cudaError_t prepare(int dev) {
    // opt in to more than 48 KiB of static + dynamic shared memory (levels[] is static), once per device (the
    // attribute is per device)
    if constexpr (kMaxSmem > 40 * 1024) {
      static std::atomic<unsigned long long> configured{0};
      const unsigned long long bit = 1ull << (dev % kMaxDevices);
      if (!(configured.load() & bit)) {
        const cudaError_t err = cudaFuncSetAttribute(few_token_gemm_kernel<FMT, T8, NT, RESIDENT, DEPTH>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem);
        if (err != cudaSuccess) return err;
        configured.fetch_or(bit);
      }
    }
    return cudaSuccess;
  }

  static cudaLaunchConfig_t config(int N, int split, size_t smem_bytes, cudaLaunchAttribute* attr,
                                   cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)((N + BN - 1) / BN), (unsigned)split, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = (unsigned)split;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = split > 1 ? 1 : 0;
    return cfg;
  }

  // clusters of `split` CTAs with smem_bytes each that can be resident at once on device dev (cached). A cluster's
  // CTAs share one GPC, so this is below CTAs-per-SM x SMs / split: a grid past it runs a second, nearly empty wave
  // (measured: 128 clusters of 5 against 124 resident doubled a 4096 x 4096 call).
  static int capacity(int dev, int split, size_t smem_bytes) {
    static std::mutex mutex;
    static std::unordered_map<uint64_t, int> cache;
    const uint64_t key = ((uint64_t)dev << 40) | ((uint64_t)split << 32) | (uint64_t)smem_bytes;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      const auto it = cache.find(key);
      if (it != cache.end()) return it->second;
    }
    int n = 0;
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = config(BN, split, smem_bytes, attr, nullptr);
    cfg.numAttrs = 1;  // the occupancy query wants the cluster shape even for split 1
    if (prepare(dev) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, few_token_gemm_kernel<FMT, T8, NT, RESIDENT, DEPTH>, &cfg) !=
            cudaSuccess ||
        n < 1) {
      (void)cudaGetLastError();
      n = 1;
    }
    const std::lock_guard<std::mutex> lock(mutex);
    cache[key] = n;
    return n;
  }

  static cudaError_t launch(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                            const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                            int split, int steps_per_split, int dev, cudaStream_t stream) {
    const cudaError_t err = prepare(dev);
    if (err != cudaSuccess) return err;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = config(N, split, smem(steps_per_split), attr, stream);
    return cudaLaunchKernelEx(&cfg, few_token_gemm_kernel<FMT, T8, NT, RESIDENT, DEPTH>, (const __nv_bfloat16*)x, w,
                              scales, absmax, levels, gscale, (__nv_bfloat16*)y, M, N, K, nf4_block, steps_per_split);
  }
};

// The resident variant where its shared memory keeps the split's clusters all resident too (with no cluster: no more
// memory than the staged variant's), else the staged one
template <int FMT, int T8, int NT, int DEPTH>
cudaError_t launch_planned(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                           const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                           int split, int per, int nb, int dev, cudaStream_t stream) {
  using Staged = Variant<FMT, T8, NT, false, DEPTH>;
  using Resident = Variant<FMT, T8, NT, true, DEPTH>;
  const size_t resident_smem = Resident::smem(per);
  const bool resident = resident_smem <= Resident::kMaxSmem &&
                        (split == 1 ? resident_smem <= Staged::kMaxSmem
                                    : nb <= Resident::capacity(dev, split, resident_smem));
  if (resident)
    return Resident::launch(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per, dev, stream);
  return Staged::launch(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per, dev, stream);
}

// The K split: the largest (at most 8 CTAs per cluster, at most one per 128-column step) whose clusters of the staged
// variant all fit at once; where even 2 do not, 3 or 4 over several waves (at 17-32 tokens only where the unsplit
// launch fills few of a wave's slots: few_token_multi_wave_split; mixed_input_gemm.h has the measurements). Then the
// ring of 2 for the split decode's short runs (few_token_split_decode; its staged variant holds fewer registers and
// stages than the ring of 4's, whose clusters the split was planned on).
template <int FMT, int T8, int NT>
cudaError_t plan_and_launch(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                            const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                            int forced_split, int dev, cudaStream_t stream) {
  constexpr int kDepth = few_token_depth<NT>();
  using Staged = Variant<FMT, T8, NT, false, kDepth>;
  const int steps = (K + kStep - 1) / kStep, nb = (N + Staged::BN - 1) / Staged::BN;
  int split = 0;
  for (int s = std::min(kMaxSplit, steps); s >= 2; --s)
    if (nb <= Staged::capacity(dev, s, Staged::kMaxSmem)) {
      split = s;
      break;
    }
  if (split == 0) {  // no cluster of 2+ fits one wave (mixed_input_gemm.h has the measurements)
    if constexpr (T8 <= 2) {
      // 1-16 tokens: 4 ways over several waves whatever the unsplit launch's fill, but 3 where 4 would put NVFP4's
      // split decode on its short-run ring of 2 (below), which lost there (MXFP4's gained)
      int ways = kFewTokenMultiWaveSplit;
      if (FMT == kNVFP4 && few_token_split_decode<FMT, T8, NT>() && (steps + ways - 1) / ways <= kShortRunSteps)
        ways = kFewTokenMmaMultiWaveSplit;
      split = std::min(ways, steps);
    } else {
      split = few_token_multi_wave_split(nb, Staged::capacity(dev, 1, Staged::kMaxSmem), steps,
                                         kFewTokenMmaMultiWaveSplit);
    }
  }
  split = few_token_split_or_forced(split, forced_split, steps);
  const int per = (steps + split - 1) / split;
  split = (steps + per - 1) / per;  // no empty CTA
  if constexpr (few_token_split_decode<FMT, T8, NT>() && kDepth > 2) {
    if (per <= kShortRunSteps)
      return launch_planned<FMT, T8, NT, 2>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per,
                                            nb, dev, stream);
  }
  return launch_planned<FMT, T8, NT, kDepth>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per,
                                             nb, dev, stream);
}

// Tile width: NT = 2 8-row groups per warp (one m16 weight tile; 4 with 17-32 tokens, where x is re-read per tile;
// 5-8 token tiles with 4 would spill registers); 1 where the wider tile leaves fewer CTAs than SMs even split 8 ways
// (small weights).
template <int FMT, int T8>
cudaError_t launch_tokens(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                          const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                          int sms, int forced_split, int dev, cudaStream_t stream) {
  const int steps = (K + kStep - 1) / kStep;
  constexpr int kWide = T8 == 4 ? 4 : 2;
  if ((int64_t)((N + 32 * kWide - 1) / (32 * kWide)) * std::min(kMaxSplit, steps) >= sms)
    return plan_and_launch<FMT, T8, kWide>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, forced_split,
                                           dev, stream);
  return plan_and_launch<FMT, T8, 1>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, forced_split, dev,
                                     stream);
}

// 1-8 tokens take one n8 token tile, 9-16 two, 17-64 four to eight (in steps of two), all routed here
// (kernels.paths.FEW_TOKEN_MAX_TOKENS). Against bf16 cuBLAS on Llama-3.1-8B's linears (eight layers back to back in
// a CUDA graph, H200, benchmarks/results/decode/few_tokens_weight_as_a_h200.md): nvfp4 1.37-1.64x at 1 token,
// 1.38-1.60x at 8, 1.18-1.47x at 16, 0.85-1.28x at 32 (64: the WGMMA kernel on the 8B's large weights).
template <int FMT>
cudaError_t launch_fmt(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax, const float* levels,
                       const float* gscale, void* y, int M, int N, int K, int nf4_block, int sms, int forced_split,
                       int dev, cudaStream_t stream) {
  // n8 token tiles: 1 up to 8 tokens, else 2, 4, 6 or 8
  const int t8 = M <= 8 ? 1 : std::min(8, 2 * ((M + 15) / 16));
  auto launch = [&](auto t8_constant) {
    return launch_tokens<FMT, decltype(t8_constant)::value>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block,
                                                            sms, forced_split, dev, stream);
  };
  switch (t8) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    case 6: return launch(std::integral_constant<int, 6>{});
    default: return launch(std::integral_constant<int, 8>{});
  }
}

}  // namespace

// fmt: 0 NVFP4 (scales E4M3 [N, K/16], gscale the decode global), 1 MXFP4 (scales E8M0 [N, K/32]), 2 NF4 (absmax
// fp32 per nf4_block elements of the flattened weight, levels its 16 values). x bf16 [M, K] and w [N, K/2] 16-byte
// aligned, K % 32 == 0, 1 <= M <= 64, NF4 blocks a power of two >= 32: the caller checks. forced_split 1-8 overrides
// the K split rule (plan_and_launch; 0: the rule).
cudaError_t launch_few_token_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                                  const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                                  int sms, int forced_split, cudaStream_t stream) {
  if (forced_split < 0) return cudaErrorInvalidValue;
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  int nf4_shift = 0;  // the kernel takes NF4's block size (a power of two) as a shift
  while (fmt == kNF4 && (1 << nf4_shift) < nf4_block) ++nf4_shift;
  nf4_block = nf4_shift;
  if (fmt == kNVFP4)
    return launch_fmt<kNVFP4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, forced_split, dev,
                             stream);
  if (fmt == kMXFP4)
    return launch_fmt<kMXFP4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, forced_split, dev,
                             stream);
  return launch_fmt<kNF4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, forced_split, dev, stream);
}

}  // namespace surogate
