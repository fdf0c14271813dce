// Few-token weight-only GEMM: y [M, N] = x [M, K] @ deq(W)^T for a frozen 4-bit weight W [N, K] (NVFP4, MXFP4
// or NF4), M <= 64 (kernels.paths.FEW_TOKEN_MAX_TOKENS), x in bf16. With so few tokens the GEMM is bound
// by reading the weight, 0.5 byte per element against bf16's 2, so the kernel streams the packed codes once:
//   - each lane loads 16 bytes (32 codes) of one weight row per 128-column step, 4 lanes per row, 4 steps ahead, and
//     decodes them in registers (E2M1 by byte permutes, NF4 by a 16-level table) straight into bf16 mma B fragments;
//   - the reduction order inside an mma is free, so lane q's 32 codes fill its k-slots of 8 consecutive m16n8k16
//     steps, and x is staged in shared memory (cp.async) in the same permuted order, as ready A fragments; where the
//     CTA's whole x range fits (the usual case), it is copied once before the loop, which then has no barrier;
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

#include "e2m1_decode.cuh"

namespace surogate {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 128;  // 4 warps; warp w owns n8 tiles [w * NT, (w + 1) * NT) of the CTA's columns
constexpr int kStep = 128;     // K per main-loop step: 4 lanes x 32 codes of each weight row
constexpr int kMaxSplit = 8;   // the portable cluster size
constexpr int kMaxDevices = 64;  // the per-device shared-memory opt-in is a bit mask
// One m16 tile: x row-major from this many tokens on (see ROWS). With 9-16 tokens the fragment order's 4-byte copies,
// one per row, cost more than the row-major order's register moves: at 16 tokens the Llama-3.1-8B linears gained
// 0-9% and Qwen3-1.7B's -1-4% (H100, chained graphs); from 2 tokens on, 2-9% was lost at 4-8 tokens.
constexpr int kRowMajorMinTokens = 9;
constexpr int kStageTileBytes = 16 * kStep * 2;  // bytes of one m16 tile of an x stage (16 rows x kStep bf16)
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
      if (FMT == kNVFP4) {
        lw.scale = *reinterpret_cast<const unsigned short*>(scale + (o >> 3));
      } else if (FMT == kMXFP4) {
        lw.scale = scale[o >> 4];
      } else {
        lw.scale = __float_as_uint(absmax[(2 * o) >> nf4_shift]);
      }
    }
    return lw;
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

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  // 4 bytes global -> shared; valid == false writes zeros
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}

// One m16 tile (1 to kRowMajorMinTokens - 1 tokens): x stages in shared memory in mma A-fragment order: 16 bytes per
// (m16 tile mt, row g, lane group q, mma step j) = x[g][c], x[g + 8][c], x[g][c + 2], x[g + 8][c + 2] (pairs of bf16)
// with c = 32q + 4j, so that one 16-byte load is the four A registers of an mma (as a row-major tile they took two
// loads and ~7 register moves per mma). The 16-byte slot of step j is j ^ q ^ 4 (g & 1): the 8 lanes of a
// quarter-warp (g = 2p, 2p + 1; q = 0..3) read 8 different bank groups.
__device__ __forceinline__ int x_frag_byte(int g, int q, int j) { return ((g * 4 + q) * 8 + (j ^ q ^ ((g & 1) << 2))) * 16; }

// A thread's x copies of one step: bf16 pair t % 64 (columns 2 (t % 64), + 1) of rows 2k + t / 64 (k = 0..7) of each
// m16 tile, rows < M only; rows >= M stay zero (the stages are zeroed once). Consecutive threads copy consecutive
// pairs of a row, so each copy instruction reads 128 contiguous bytes per warp (a thread-per-row-segment order read 32
// bytes apart and cost 8x the sectors). Offsets fixed across steps.
template <int MT>
struct XFragmentCopies {
  int smem;  // byte offset in a stage of row t / 64 (k = 0), tile 0; row 2k adds frag_rows(k)
  int gmem;  // elements into x of that row's pair, step 0
  int col;   // the pair's first column at step 0
  int row0;  // t / 64

  __device__ __forceinline__ XFragmentCopies(int K) {
    const int t = threadIdx.x, pair = t & 63;
    row0 = t >> 6;
    col = 2 * pair;
    const int q = pair >> 4, j = (pair >> 1) & 7, p = pair & 1;
    smem = x_frag_byte(row0, q, j) + 8 * p;  // the swizzle depends on the row's parity, = row0 for every k
    gmem = row0 * K + col;
  }

  // bytes from row row0 to row 2k + row0 of a tile in the fragment layout: rows g -> g + 2k (k < 4) or, past 8,
  // the g + 8 half (4 bytes further) of row g + 2k - 8
  static __device__ __forceinline__ int frag_rows(int k) { return k < 4 ? 2 * k * 512 : (2 * k - 8) * 512 + 4; }

  __device__ __forceinline__ void issue(unsigned char* stage, const __nv_bfloat16* __restrict__ x, int M, int K,
                                        int step) const {
    const bool col_ok = col + step * kStep < K;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int row = mt * 16 + 2 * k + row0;
        if (row >= M) break;
        cp_async4(stage + mt * kStageTileBytes + smem + frag_rows(k),
                  col_ok ? x + gmem + (int64_t)(mt * 16 + 2 * k) * K + step * kStep : x, col_ok);
      }
    }
  }
};

// Two to four m16 tiles (17-64 tokens), and one from kRowMajorMinTokens on: x stages in shared memory, each m16 tile
// of a step row-major, 16 rows x 128
// columns (256 bytes a row), 16-byte chunk ch of row r at slot ch ^ ((ch >> 3) & 1 | (r & 1) << 1). The A fragments
// of lane (g, q) for the 8 mma steps of a step are columns [32q, 32q + 32) of rows g and g + 8: chunks 4q .. 4q + 3,
// one 16-byte load per row per two mma steps (the k permutation makes each lane's columns contiguous). The 8 lanes of
// a quarter-warp (g = 2p, 2p + 1, q = 0..3) then read 8 different bank groups, and 8 consecutive threads copying one
// row's chunks write 8. Storing ready A fragments (XFragmentCopies) takes 4-byte copies, 8 per thread and m16 tile
// per step against 2 here, but a fragment is then one load, where here it is assembled from two (register moves: the
// mma wants its A registers consecutive). Measured on the H200 (4096 x 4096 nvfp4, kernel time): with 1 token the
// fragment order is 5% faster (9.6 vs 10.1 us), with 48 / 64 tokens this order (18.4 / 22.2 us against 21.0 / 26.2
// us).
__device__ __forceinline__ int x_chunk_byte(int row, int ch) {
  return row * 256 + ((ch ^ (((ch >> 3) & 1) | ((row & 1) << 1))) << 4);
}
constexpr int kCopiesPerTile = 16 * kStep * 2 / 16 / kThreads;  // 16-byte chunks per thread and m16 tile (2)

// A thread's x copies of one step: chunks t and t + 128 of each m16 tile (row = chunk / 16, 8 columns each), rows < M
// only; rows >= M stay zero (the stages are zeroed once), columns past K are written as zeros. Offsets fixed across
// steps.
template <int MT>
struct XRowCopies {
  int smem[kCopiesPerTile];  // byte offset in a tile
  int gmem[kCopiesPerTile];  // elements into x, step 0, tile 0
  int col[kCopiesPerTile];   // first column at step 0
  int row[kCopiesPerTile];   // row in the tile

  __device__ __forceinline__ XRowCopies(int K) {
#pragma unroll
    for (int i = 0; i < kCopiesPerTile; ++i) {
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
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < kCopiesPerTile; ++i) {
        if (mt * 16 + row[i] >= M) continue;
        const bool col_ok = col[i] + step * kStep < K;
        cp_async16(stage + mt * kStageTileBytes + smem[i],
                   col_ok ? x + gmem[i] + (int64_t)(mt * 16) * K + step * kStep : x, col_ok);
      }
    }
  }
};

// RESIDENT: x for the CTA's whole K range is copied into shared memory once, before the loop (one stage per step), so
// the loop has no barrier and no copies: each warp streams its weight rows at its own pace. Taken where that fits in
// the shared memory of the split the staged variant would get (few_token_plan below). Otherwise x rotates through
// kDepth stages, one barrier per step.
// ROWS: x row-major in its stages (16-byte copies, fragments assembled from two loads) rather than in A-fragment order
// (one load per mma, 4-byte copies): always with two to four m16 tiles, and with one from kRowMajorMinTokens tokens on
template <int FMT, int MT, int NT, bool RESIDENT, bool ROWS>
__global__ void __launch_bounds__(kThreads, MT * NT <= 2 ? 4 : 1) few_token_gemm_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
    const float* __restrict__ absmax, const float* __restrict__ nf4_levels, const float* __restrict__ gscale,
    __nv_bfloat16* __restrict__ y, int M, int N, int K, int nf4_shift, int steps_per_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int BN = 4 * NT * 8;  // output columns per CTA
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int split = gridDim.y, s = blockIdx.y;
  const int64_t n_cta = (int64_t)blockIdx.x * BN;
  const int steps = (K + kStep - 1) / kStep;
  const int step_lo = s * steps_per_split, step_hi = min(step_lo + steps_per_split, steps);

  // the codes of the next kDepth steps stay in flight per lane (a register ring, indexed statically by unrolling the
  // step loop kDepth times); staged, the x tiles of the next kDepth - 1 steps too (cp.async): with one step ahead, or
  // x read from L2 at its use, the kernel waited a memory latency per step
  constexpr int kDepth = NT == 4 ? 2 : 4;
  constexpr int kStage = MT * 16 * kStep;  // bf16 elements of one x stage
  const int stages = RESIDENT ? step_hi - step_lo : kDepth;
  __shared__ float levels[16];
  extern __shared__ __align__(16) unsigned char smem[];  // x stages, then (after the loop) the fp32 partial tile
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);

  // the weight stream starts first: its loads fly while x is staged
  const CtaWeights<FMT> wts(w, scales, absmax, n_cta, K, nf4_shift);
  const E2M1Tables tables((threadIdx.x * (unsigned)M) >> 31);
  int rows[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) rows[nt] = CtaWeights<FMT>::lane_offset((warp * NT + nt) * 8 + g, n_cta, N, K, q);
  LaneWeights ring[kDepth][NT];
#pragma unroll
  for (int i = 0; i < kDepth; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      ring[i][nt] = step_lo + i < step_hi ? wts.load(rows[nt], step_lo + i, q, K, nf4_shift)
                                          : LaneWeights{make_uint4(0, 0, 0, 0), 0u};

  if (FMT == kNF4) {
    if (threadIdx.x < 16) levels[threadIdx.x] = nf4_levels[threadIdx.x];
  }
  // every stage zeroed once (rows >= M stay zero), before any copy lands in them
  if (M < MT * 16)
    for (int c = threadIdx.x; c < stages * kStage / 8; c += kThreads) reinterpret_cast<uint4*>(xs)[c] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const std::conditional_t<!ROWS, XFragmentCopies<MT>, XRowCopies<MT>> xcopy(K);
  unsigned char* xbytes = reinterpret_cast<unsigned char*>(xs);
  if constexpr (RESIDENT) {
    for (int step = step_lo; step < step_hi; ++step) xcopy.issue(xbytes + (step - step_lo) * kStage * 2, x, M, K, step);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  } else {
#pragma unroll
    for (int i = 0; i < kDepth - 1; ++i) {
      if (step_lo + i < step_hi) xcopy.issue(xbytes + i * kStage * 2, x, M, K, step_lo + i);
      cp_async_commit();
    }
  }

  // one m16 tile: the even and odd mma steps of each n8 tile accumulate apart (two dependency chains per tile where
  // one serialized every mma of a step on the one before), summed at the end
  constexpr int kChains = MT == 1 ? 2 : 1;
  float acc[MT][NT][kChains][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][c][i] = 0.f;

  // XFragmentCopies: x_frag_byte(g, q, j) = xfrag + (j ^ xfswz) * 16. XRowCopies: this lane's A chunk c of rows g and
  // g + 8 at x_chunk_byte(g, 4q + c) = xrow + ((4q + c) ^ xswz) * 16 and 8 rows (2048 bytes) further
  const int xfrag = (g * 4 + q) * 128, xfswz = q ^ ((g & 1) << 2);
  const int xrow = g * 256, xswz = ((q >> 1) & 1) | ((g & 1) << 1);

  for (int base = step_lo; base < step_hi; base += kDepth) {
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int step = base + i;
      if (step >= step_hi) break;
      if constexpr (!RESIDENT) {
        cp_async_wait<kDepth - 2>();  // this step's x stage (this thread's copies) ...
        __syncthreads();              // ... and everyone's; the stage read last step is free again
        if (step + kDepth - 1 < step_hi)
          xcopy.issue(xbytes + ((i + kDepth - 1) % kDepth) * kStage * 2, x, M, K, step + kDepth - 1);
        cp_async_commit();
      }
      uint32_t b[NT][16];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        decode_lane<FMT>(ring[i][nt], levels, tables, b[nt]);
        // (past the split's last step the slot is never decoded again: left as it is, no select, no second copy of
        // the loop body)
        if (step + kDepth < step_hi) ring[i][nt] = wts.load(rows[nt], step + kDepth, q, K, nf4_shift);
      }
      const unsigned char* stage = xbytes + (RESIDENT ? (step - step_lo) : i) * kStage * 2;
      if constexpr (!ROWS) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          // A fragment of mma step j: rows (g, g + 8) x k-slots (2q, 2q + 1) <- columns 4j, 4j + 1 of the lane's range,
          // k-slots (2q + 8, 2q + 9) <- columns 4j + 2, 4j + 3: the same permutation as the B fragment
          const uint4 a = *reinterpret_cast<const uint4*>(stage + xfrag + ((j ^ xfswz) << 4));
          const uint32_t frag[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_16816(acc[0][nt][j & 1], frag, b[nt][2 * j], b[nt][2 * j + 1]);
        }
      } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          // A fragment of mma step j: rows (g, g + 8) x k-slots (2q, 2q + 1) <- columns 4j, 4j + 1 of the lane's range,
          // k-slots (2q + 8, 2q + 9) <- columns 4j + 2, 4j + 3: the same permutation as the B fragment. Chunk c of a
          // row holds the lane's columns 8c .. 8c + 7: mma steps 2c and 2c + 1.
          const unsigned char* tile = stage + mt * kStageTileBytes + xrow + (((4 * q + c) ^ xswz) << 4);
          const uint4 lo = *reinterpret_cast<const uint4*>(tile);         // row g
          const uint4 hi = *reinterpret_cast<const uint4*>(tile + 2048);  // row g + 8 (same parity: same slot)
          const uint32_t f0[4] = {lo.x, hi.x, lo.y, hi.y}, f1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma_16816(acc[mt][nt][0], f0, b[nt][4 * c], b[nt][4 * c + 1]);
            mma_16816(acc[mt][nt][kChains - 1], f1, b[nt][4 * c + 2], b[nt][4 * c + 3]);
          }
        }
      }
      }
    }
  }
  if constexpr (kChains == 2) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][nt][0][i] += acc[0][nt][1][i];
  }
  cp_async_wait<0>();
  __syncthreads();  // the x stages become the partial tile
  float* partial = reinterpret_cast<float*>(smem);  // [MT * 16][BN] fp32: this CTA's share of the sum

  // C fragment: c0, c1 at row g, columns 2q, 2q + 1 of the n8 tile; c2, c3 at row g + 8
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = (warp * NT + nt) * 8 + 2 * q, row = mt * 16 + g;
      partial[row * BN + col] = acc[mt][nt][0][0];
      partial[row * BN + col + 1] = acc[mt][nt][0][1];
      partial[(row + 8) * BN + col] = acc[mt][nt][0][2];
      partial[(row + 8) * BN + col + 1] = acc[mt][nt][0][3];
    }
  const float gdec = gscale != nullptr ? *gscale : 1.f;
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
template <int FMT, int MT, int NT, bool RESIDENT, bool ROWS>
struct Variant {
  static constexpr int BN = 4 * NT * 8;
  static constexpr int kDepth = NT == 4 ? 2 : 4;  // as in the kernel
  static constexpr size_t kStageBytes = MT * 16 * kStep * 2;
  static constexpr size_t kPartialBytes = MT * 16 * BN * sizeof(float);
  // staged: kDepth stages; resident: one per step of the split, up to what one SM holds (the planner also keeps the
  // split the staged variant would get, so residency never costs occupancy there)
  static constexpr size_t kMaxSmem = RESIDENT ? 200 * 1024 : std::max<size_t>(kDepth * kStageBytes, kPartialBytes);

  // dynamic shared memory of a launch whose CTAs run steps_per_split steps (rounded up to 4 KiB: fewer occupancy
  // queries)
  static size_t smem(int steps_per_split) {
    if (!RESIDENT) return kMaxSmem;
    const size_t bytes = std::max<size_t>((size_t)steps_per_split * kStageBytes, kPartialBytes);
    return (bytes + 4095) / 4096 * 4096;
  }

  static cudaError_t prepare(int dev) {
    // opt in to more than 48 KiB of static + dynamic shared memory (levels[] is static), once per device (the
    // attribute is per device)
    if constexpr (kMaxSmem > 40 * 1024) {
      static std::atomic<unsigned long long> configured{0};
      const unsigned long long bit = 1ull << (dev % kMaxDevices);
      if (!(configured.load() & bit)) {
        const cudaError_t err = cudaFuncSetAttribute(few_token_gemm_kernel<FMT, MT, NT, RESIDENT, ROWS>,
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
        cudaOccupancyMaxActiveClusters(&n, few_token_gemm_kernel<FMT, MT, NT, RESIDENT, ROWS>, &cfg) != cudaSuccess ||
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
    return cudaLaunchKernelEx(&cfg, few_token_gemm_kernel<FMT, MT, NT, RESIDENT, ROWS>, (const __nv_bfloat16*)x, w, scales,
                              absmax, levels, gscale, (__nv_bfloat16*)y, M, N, K, nf4_block, steps_per_split);
  }
};

// The K split: the largest (at most 8 CTAs per cluster, at most one per 128-column step) whose clusters of the staged
// variant all fit at once; 1 (no cluster, any number of waves) where even 2 do not. Then the resident variant where
// its shared memory keeps that split's clusters all resident too (with no cluster: no more memory than staged's).
template <int FMT, int MT, int NT, bool ROWS>
cudaError_t plan_and_launch(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                            const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                            int dev, cudaStream_t stream) {
  using Staged = Variant<FMT, MT, NT, false, ROWS>;
  using Resident = Variant<FMT, MT, NT, true, ROWS>;
  const int steps = (K + kStep - 1) / kStep, nb = (N + Staged::BN - 1) / Staged::BN;
  int split = 1;
  for (int s = std::min(kMaxSplit, steps); s >= 2; --s)
    if (nb <= Staged::capacity(dev, s, Staged::kMaxSmem)) {
      split = s;
      break;
    }
  const int per = (steps + split - 1) / split;
  split = (steps + per - 1) / per;  // no empty CTA
  const size_t resident_smem = Resident::smem(per);
  const bool resident = resident_smem <= Resident::kMaxSmem &&
                        (split == 1 ? resident_smem <= Staged::kMaxSmem
                                    : nb <= Resident::capacity(dev, split, resident_smem));
  if (resident)
    return Resident::launch(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per, dev, stream);
  return Staged::launch(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, split, per, dev, stream);
}

// Tile width: NT = 2 n8 tiles per warp (4 with 17-32 tokens, where x is re-read per tile; 3-4 m16 tiles with 4
// would spill registers); 1 where the wider tile leaves fewer CTAs than SMs even split 8 ways (small weights).
template <int FMT, int MT, bool ROWS = (MT > 1)>
cudaError_t launch_mt(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax, const float* levels,
                      const float* gscale, void* y, int M, int N, int K, int nf4_block, int sms, int dev,
                      cudaStream_t stream) {
  const int steps = (K + kStep - 1) / kStep;
  constexpr int kWide = MT == 2 ? 4 : 2;
  if ((int64_t)((N + 32 * kWide - 1) / (32 * kWide)) * std::min(kMaxSplit, steps) >= sms)
    return plan_and_launch<FMT, MT, kWide, ROWS>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, dev,
                                                 stream);
  return plan_and_launch<FMT, MT, 1, ROWS>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, dev, stream);
}

// 1-16 tokens take one m16 tile (MT 1; x row-major from kRowMajorMinTokens), 17-64 two to four, all routed here
// (kernels.paths.FEW_TOKEN_MAX_TOKENS). Against
// bf16 cuBLAS on Llama-3.1-8B's linears (eight layers back to back in a CUDA graph, H100, benchmarks/results/
// shapes_chain8_s20.md): nvfp4 1.50-1.87x at 1 token, 1.38-1.61x at 16, 0.65-0.96x at 64. An earlier probe reported
// the 17-64-token tiles 12-14x slower: it had called the op before the extension was loaded, and timed the op's
// reference path.
template <int FMT>
cudaError_t launch_fmt(const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax, const float* levels,
                       const float* gscale, void* y, int M, int N, int K, int nf4_block, int sms, int dev,
                       cudaStream_t stream) {
  switch ((M + 15) / 16) {
    case 1:
      if (M >= kRowMajorMinTokens)
        return launch_mt<FMT, 1, true>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
      return launch_mt<FMT, 1, false>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
    case 2: return launch_mt<FMT, 2>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
    case 3: return launch_mt<FMT, 3>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
    default: return launch_mt<FMT, 4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
  }
}

}  // namespace

// fmt: 0 NVFP4 (scales E4M3 [N, K/16], gscale the decode global), 1 MXFP4 (scales E8M0 [N, K/32]), 2 NF4 (absmax
// fp32 per nf4_block elements of the flattened weight, levels its 16 values). x bf16 [M, K] and w [N, K/2] 16-byte
// aligned, K % 32 == 0, 1 <= M <= 64, NF4 blocks a power of two >= 32: the caller checks.
cudaError_t launch_few_token_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales, const float* absmax,
                                  const float* levels, const float* gscale, void* y, int M, int N, int K, int nf4_block,
                                  int sms, cudaStream_t stream) {
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  int nf4_shift = 0;  // the kernel takes NF4's block size (a power of two) as a shift
  while (fmt == kNF4 && (1 << nf4_shift) < nf4_block) ++nf4_shift;
  nf4_block = nf4_shift;
  if (fmt == kNVFP4) return launch_fmt<kNVFP4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
  if (fmt == kMXFP4) return launch_fmt<kMXFP4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
  return launch_fmt<kNF4>(x, w, scales, absmax, levels, gscale, y, M, N, K, nf4_block, sms, dev, stream);
}

}  // namespace surogate
