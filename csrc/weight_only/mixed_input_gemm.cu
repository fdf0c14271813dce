// Mixed-input GEMM (SM90a): y [M, N] = x [M, K] @ deq(W)^T for a frozen NVFP4, MXFP4 or NF4 weight W [N, K] and bf16
// x, on the tensor cores' bf16 WGMMA path with the weight decoded on the fly into register operands.
//
// Hopper has no FP4 tensor cores. The dense route decodes the whole weight into a bf16 buffer and runs cuBLAS: at 2048
// tokens the decode pass writes 2 bytes per element that the GEMM reads back. Here:
//   - a CTA computes a BM-token x 128-row tile of y (BM = 256, or 128 where 256 fills at most half the SMs; 64 at
//     <= 64 tokens) as its transpose y^T = W x^T: warpgroup 0 produces, warpgroups 1 and 2 own 64 weight rows each;
//   - per 64-column stage the producer has the TMA copy the x tile (128-byte swizzle) and the stage's 128 x 64 weight
//     codes (32-byte swizzle) into shared memory, zeros past M, N and K, and its threads store the stage's scales;
//   - each consumer thread decodes its own m64k16 A fragments into registers (the E2M1 byte permutes and block-scale
//     multiply of e2m1_decode.cuh, exact in bf16; NF4 by a 16-word level table in shared memory) and issues
//     register-operand WGMMAs (m64nBMk16) against the x tile: 8 warps share the decode, one warpgroup decoding while
//     the other's WGMMAs run (each waits for its own stage's WGMMAs before decoding the next: they read the fragment
//     registers asynchronously; all but NF4's 64-token tiles wait per half-stage instead, so that a stage's decode
//     overlaps the previous stage's last two WGMMAs); setmaxnreg gives the consumers the registers for a stage's four
//     fragments;
//   - a ring of mbarriers: full (the producer's 128 threads after their stores, plus the TMA's bytes) and empty (the
//     consumers' 256 threads, once the WGMMAs that read the stage completed);
//   - at <= 64 tokens, 64-token tiles with K split over a thread-block cluster whose partial sums meet through
//     distributed shared memory (two CTAs per SM there, no register trade): the few-token op runs this for large
//     weights at 33-64 tokens, wide ones from 17 (few_token_wgmma_applies, mixed_input_gemm.h).
// From 512 tokens the route runs it for the NVFP4 / MXFP4 weights where it measured faster than decode + cuBLAS
// (mixed_input_applies in decoded_linear.cpp; docs/kernels.md has the figures), and everywhere it can run when opted in
// (SUROGATE_HF_MIXED_INPUT=1). A first version decoded in the producer warpgroup into a bf16 weight tile in shared
// memory (one decode warp per scheduler); this kernel was 2-15% faster than it everywhere and equal to it bit for bit,
// and it was removed (docs/kernels.md keeps its history).
// Numerics: the decoded element is the reference's, exact in bf16 (at most 5 significant bits; NF4's product rounded
// once); products accumulate in fp32; the NVFP4 decode global multiplies the fp32 sum once, as the few-token kernel
// does. Only the fp32 summation order differs from x.float() @ deq(W).float().T.
// Requirements (surogate_hf.kernels.paths.mixed_input_kernel checks them, the launcher again): K % 32 == 0 (a lane's
// 32-column half is wholly in or out of range), 16-byte aligned codes and x, any M and N; NF4 blocks a power of two
// >= 32 dividing K.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "../fp4/e2m1_decode.cuh"
#include "mixed_input_gemm.h"

namespace surogate {
namespace {

using namespace wdec;

constexpr int kBN = kMixedInputRows;  // weight rows per CTA: the WGMMA's N
constexpr int kBK = 64;         // K per stage: one 128-byte swizzle row of bf16
constexpr int kThreads = 384;   // warpgroup 0 produces, 1 and 2 consume

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// WGMMA shared-memory descriptor of a K-major bf16 tile with 128-byte swizzle: start address, leading byte offset
// (unused by this layout, 16 as CUTLASS sets it), stride byte offset 1024 (between 8-row groups), layout type 1
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// the barrier's current phase also waits for `bytes` more transaction bytes (the TMA's), without an arrival
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// TMA: the box at (col, row) of the 2-D tensor map into shared memory, its bytes counted on bar
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
// keeps the compiler from moving accumulator reads or writes across the asynchronous WGMMAs
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The accumulator operands of an m64nN WGMMA (N / 2 fp32 registers of fragment d), as the instruction's register list
// and as asm outputs: the instruction names each register, so every wrapper below spells them out through these.
#define SG_WGMMA_ACC_LIST_32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31"
#define SG_WGMMA_ACC_LIST_64 SG_WGMMA_ACC_LIST_32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define SG_WGMMA_ACC_LIST_128 SG_WGMMA_ACC_LIST_64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, " \
  "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, " \
  "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, " \
  "%122, %123, %124, %125, %126, %127"
#define SG_WGMMA_ACC_REGS_64 "{" SG_WGMMA_ACC_LIST_64 "}"
#define SG_WGMMA_ACC_REGS_128 "{" SG_WGMMA_ACC_LIST_128 "}"
#define SG_WGMMA_ACC_REGS_32 "{" SG_WGMMA_ACC_LIST_32 "}"
#define SG_WGMMA_ACC_OPS_32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
  "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
  "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
  "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SG_WGMMA_ACC_OPS_64(d) SG_WGMMA_ACC_OPS_32(d), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define SG_WGMMA_ACC_OPS_128(d) SG_WGMMA_ACC_OPS_64(d), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), \
  "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), \
  "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), \
  "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d[BN / 2] += A (64 x 16, bf16 in registers: the warpgroup's m64k16 A fragment, 4 words per thread) * B (16 x BN,
// a K-major tile in shared memory, descriptor b): one warpgroup's m64nBNk16 WGMMA with A from registers into its fp32
// fragment d. One specialization per shape: the instruction names each accumulator register (as CUTLASS's wrappers
// do); its scale-d operand is a predicate, set to accumulate.
// Fragment word j of a thread (lane l of warp w): row 16 w + l / 4 + 8 (j & 1), columns 2 (l % 4) + 8 (j >> 1)
// + {0, 1}.
template <int BN>
__device__ __forceinline__ void wgmma_rs_k16(float* d, const uint32_t* a, uint64_t b);
template <>
__device__ __forceinline__ void wgmma_rs_k16<256>(float* d, const uint32_t* a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " SG_WGMMA_ACC_REGS_128
               ", {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
               : SG_WGMMA_ACC_OPS_128(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs_k16<128>(float* d, const uint32_t* a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SG_WGMMA_ACC_REGS_64
               ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
               : SG_WGMMA_ACC_OPS_64(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs_k16<64>(float* d, const uint32_t* a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SG_WGMMA_ACC_REGS_32
               ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : SG_WGMMA_ACC_OPS_32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// NF4's operands besides codes and absmax (unused by the other formats): its 16
// levels, the absmax block as a shift (a power of two >= 32 dividing K), and a double-quantized absmax's nested
// operands (null when the absmax is fp32: then `scales` holds it; else `scales` holds its one-byte codes).
struct Nf4Operands {
  const float* levels = nullptr;
  const float* nested_absmax = nullptr;  // fp32, one per 256 blocks
  const float* nested_code = nullptr;    // fp32 [256]
  const float* offset = nullptr;         // fp32 [1]
  int shift = 0;                         // log2(block)
};

// The producer's scale rows: thread t stages the scale(s) of the 32-column half t % 2 of rows t / 2 + 64 i
// (i < BN / 64) of the CTA's BN (the codes come by TMA). Rows past N read row N - 1's (in bounds and finite: their
// codes are zeros, their sums never stored).
template <int FMT, int BN>
struct ProducerScales {
  static constexpr int kRows = BN / 64;
  const uint8_t* scale;   // NVFP4: + n0 * K/16; MXFP4: + n0 * K/32; NF4: the absmax (fp32 or nested codes), unshifted
  int64_t n0k;            // NF4: n0 * K, the flat index of the CTA's first element
  int nf4_shift;          // NF4: log2(block)
  bool nested;            // NF4: the absmax is one-byte codes
  int off[kRows];         // byte offset of the half's codes at stage 0 from the CTA's first row (scale index: a shift)
  int half_col;           // first column of the half at stage 0

  __device__ __forceinline__ ProducerScales(const uint8_t* scales, int64_t n0, int N, int K, int t,
                                            const Nf4Operands& nf4 = {})
      : scale(FMT == kNF4 ? scales : scales + n0 * (FMT == kNVFP4 ? K / 16 : K / 32)),
        n0k(n0 * K),
        nf4_shift(nf4.shift),
        nested(nf4.nested_code != nullptr),
        half_col(32 * (t & 1)) {
    const int last = (int)(N - 1 - n0);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int row = (t >> 1) + 64 * i;
      off[i] = (row < last ? row : last) * (K / 2) + 16 * (t & 1);
    }
  }

  // the half's scale(s) of row i at stage kb; zero past K (K % 32 == 0: a half is wholly in or out)
  __device__ __forceinline__ uint32_t load(int i, int kb, int K) const {
    if (kb * kBK + half_col >= K) return 0u;
    const int o = off[i] + kb * (kBK / 2);  // the codes' byte offset: 2 elements each
    if (FMT == kNVFP4) {
      // the scale bytes of elements 2o .. 2o + 31, (2o / 16, + 1), as one 16-bit load (o / 8 is even: K % 32 == 0).
      // Two byte loads merged here made the producer wait for them at once (Nsight Compute: its top stall)
      return *reinterpret_cast<const uint16_t*>(scale + (o >> 3));
    } else if (FMT == kMXFP4) {
      return scale[o >> 4];
    } else {
      // the half's block (it lies in one: block % 32 == 0 and K % block == 0): the fp32 absmax, or its one-byte code
      // with the block's nested index above it (b / 256 < 2^24 for any weight of fewer than 2^38 elements)
      const int64_t b = (n0k + 2 * (int64_t)o) >> nf4_shift;
      return nested ? (uint32_t)scale[b] | (uint32_t)((b >> 8) << 8) : reinterpret_cast<const uint32_t*>(scale)[b];
    }
  }
};

// The epilogue, run by the 256 consumer threads once their last WGMMAs completed: the fp32 tile
// out[token][row] in shared memory (over the stage buffers, which both consumer warpgroups are done with), then rows
// of y written 16 bytes at a time (accumulate: y + the sum, one rounding). m64nBM fragment of warpgroup cw:
// acc[4j + 2h + e] = weight row 64 cw + 16 warp + lane / 4 + 8h, token 8j + 2 (lane % 4) + e. Row stride kOutLd
// floats: the 32 lanes of a fragment store hit 32 different banks.
constexpr int kOutLd = kBN + 4;

// The consumers' fragments times g into out[token][row] (both consumer warpgroups first wait for each other: their
// last WGMMAs have read the stages that out overlays)
template <int BM>
__device__ __forceinline__ void fragments_to_tile(const float* acc, float* out, float g, int cw, int t) {
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  const int warp = t >> 5, lane = t & 31;
  const int r = cw * 64 + warp * 16 + (lane >> 2), tok = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) out[(8 * j + tok + e) * kOutLd + r + 8 * h] = acc[4 * j + 2 * h + e] * g;
}

template <int FMT, int BM>
__device__ __forceinline__ void store_tile(const float* acc, float* out, const float* __restrict__ gscale,
                                           __nv_bfloat16* __restrict__ y, int M, int N, int m0, int64_t n0, int cw,
                                           int t, bool accumulate) {
  fragments_to_tile<BM>(acc, out, FMT == kNVFP4 ? *gscale : 1.f, cw, t);
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  // 256 threads: each writes 8 consecutive columns (16 bytes) of a token row; 16 threads per row
  const int ct = cw * 128 + t, c8 = (ct & 15) * 8;
  const int64_t col = n0 + c8;
  const bool vec = (N & 7) == 0 && col + 8 <= N;
  for (int tr = ct >> 4; tr < BM; tr += 16) {
    const int row = m0 + tr;
    if (row >= M || col >= N) continue;
    const float4 lo = *reinterpret_cast<const float4*>(out + tr * kOutLd + c8);
    const float4 hi = *reinterpret_cast<const float4*>(out + tr * kOutLd + c8 + 4);
    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    __nv_bfloat16* dst = y + (int64_t)row * N + col;
    if (vec) {
      uint4 old = make_uint4(0, 0, 0, 0);
      if (accumulate) old = *reinterpret_cast<const uint4*>(dst);
      const __nv_bfloat16* o = reinterpret_cast<const __nv_bfloat16*>(&old);
      __align__(16) __nv_bfloat162 packed[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (accumulate) {
          v[2 * i] += __bfloat162float(o[2 * i]);
          v[2 * i + 1] += __bfloat162float(o[2 * i + 1]);
        }
        packed[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      }
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
    } else {
      for (int i = 0; i < 8 && col + i < N; ++i)
        dst[i] = __float2bfloat16_rn(accumulate ? v[i] + __bfloat162float(dst[i]) : v[i]);
    }
  }
}

// The K-split epilogue (few tokens: gridDim.z CTAs of one thread-block cluster hold
// fp32 partial tiles over consecutive K ranges, in out[token][row] of each one's shared memory). Run by all threads
// of every CTA of the cluster: each CTA sums a strided share of the tile over ranks 0 .. split - 1 in order (the same
// sum whichever CTA computes it: deterministic), times the NVFP4 global, (+ y,) one rounding.
constexpr int kMaxSplit = kMixedInputMaxSplit;  // the portable cluster size

template <int FMT, int BM>
__device__ __forceinline__ void reduce_split_tile(float* out, const float* __restrict__ gscale,
                                                  __nv_bfloat16* __restrict__ y, int M, int N, int m0, int64_t n0,
                                                  bool accumulate) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's partial tile is in its shared memory
  const int split = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
  const float g = FMT == kNVFP4 ? *gscale : 1.f;
  // Four columns a thread (16-byte reads of each CTA's tile: kOutLd % 4 == 0), the CTAs' partial sums added in rank
  // order; a 256-token tile has 8192 such quads. Wider tiles than 64 tokens run one CTA per SM, whose producer gave
  // registers away (setmaxnreg.dec): only the consumers' 256 threads add there.
  constexpr int kAdders = BM > 64 ? kThreads - 128 : kThreads;
  const int adder = (int)threadIdx.x - (kThreads - kAdders);
  // four columns stored as one 8-byte word where they are whole and 8-byte aligned (N % 4 == 0)
  const bool vec = (N & 3) == 0;
  // The loop over ranks is unrolled for the cluster's actual size (a branch per size: before, every quad loaded and
  // added all kMaxSplit ranks, zeros past the cluster, and stored its four columns one by one).
  auto reduce = [&](auto split_constant) {
    constexpr int kSplit = decltype(split_constant)::value;
    // each rank's tile, mapped once where registers allow (64-token tiles; the wider ones' consumers hold the
    // pointers at the cost of spills, so they map per quad)
    const float* tiles[BM == 64 ? kSplit : 1];
    if constexpr (BM == 64) {
#pragma unroll
      for (int r = 0; r < kSplit; ++r) tiles[r] = cluster.map_shared_rank(out, r);
    }
    for (int q = rank * kAdders + adder; adder >= 0 && q < BM * kBN / 4; q += kSplit * kAdders) {
      const int tok = q / (kBN / 4), col = 4 * (q % (kBN / 4));
      const int row = m0 + tok;
      const int64_t n = n0 + col;
      if (row >= M || n >= N) continue;
      float4 v[kSplit];
#pragma unroll
      for (int r = 0; r < kSplit; ++r) {
        const float* tile = BM == 64 ? tiles[BM == 64 ? r : 0] : cluster.map_shared_rank(out, r);
        v[r] = *reinterpret_cast<const float4*>(tile + tok * kOutLd + col);
      }
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kSplit; ++r) {
        sum[0] += v[r].x;
        sum[1] += v[r].y;
        sum[2] += v[r].z;
        sum[3] += v[r].w;
      }
      __nv_bfloat16* dst = y + (int64_t)row * N + n;
      if (vec && n + 4 <= N) {
        uint2 old = make_uint2(0u, 0u);
        if (accumulate) old = *reinterpret_cast<const uint2*>(dst);
        const __nv_bfloat16* o = reinterpret_cast<const __nv_bfloat16*>(&old);
        __align__(8) __nv_bfloat16 packed[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float scaled = __fmul_rn(sum[i], g);  // (as store_tile: no fused multiply-add with y)
          packed[i] = __float2bfloat16_rn(accumulate ? __fadd_rn(scaled, __bfloat162float(o[i])) : scaled);
        }
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(packed);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (n + i < N) {
            const float scaled = __fmul_rn(sum[i], g);
            dst[i] = __float2bfloat16_rn(accumulate ? __fadd_rn(scaled, __bfloat162float(dst[i])) : scaled);
          }
      }
    }
  };
  static_assert(kMaxSplit == 8, "one case per cluster size below");
  switch (split) {
    case 2: reduce(std::integral_constant<int, 2>{}); break;
    case 3: reduce(std::integral_constant<int, 3>{}); break;
    case 4: reduce(std::integral_constant<int, 4>{}); break;
    case 5: reduce(std::integral_constant<int, 5>{}); break;
    case 6: reduce(std::integral_constant<int, 6>{}); break;
    case 7: reduce(std::integral_constant<int, 7>{}); break;
    default: reduce(std::integral_constant<int, 8>{}); break;
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// The ring of stages: full[s] counts the producer's 128 threads (plus the x and codes tiles' TMA bytes), empty[s] the
// consumers' 256 threads. Called by every thread of the CTA (it ends in a CTA barrier).
template <int STAGES>
__device__ __forceinline__ void init_ring(const CUtensorMap* x_map, const CUtensorMap* w_map, uint64_t* full,
                                          uint64_t* empty) {
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(x_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(w_map)) : "memory");
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_addr(&full[s]), 128);
      mbar_init(smem_addr(&empty[s]), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

// ---- The kernel: the producer only moves bytes, the consumers decode their own A fragments (header above).
//
// Codes tile of a stage: the weight's 128 rows x 32 bytes as they are in memory (word i of a row = codes of columns
// 8i .. 8i + 7), copied by the TMA with its 32-byte swizzle: the 16-byte half c of row r sits at half c ^ (r / 4 % 2),
// so the 8 rows a warp reads at once fall in 8 different bank groups. A consumer thread with lane % 4 == q needs, for
// k16 step s, the bytes of columns 16s + 2q (+1) and 16s + 2q + 8 (+9): byte q of words 2s and 2s + 1. It loads its
// two rows' 32 bytes (two 16-byte loads a row, shared by the 4 lanes of a row) and gathers byte q of each word by byte
// permutes. (Until session 27 the producer threads loaded the codes into registers and stored them regrouped, so
// that a thread's bytes were 8 contiguous ones; that staging was the producer's top stall.)
// Scales tile: 128 rows x 16 bytes (NVFP4 / MXFP4: word s = the bf16 pair (scale, scale) of k16 step s, converted by
// the producer, so that the consumers load their A fragments' multipliers as they are; NF4: the fp32 absmax of half h
// in bytes 4h .. 4h + 3, de-nested by the producer). (Until session 28 the tile held the E4M3 / E8M0 bytes and every
// consumer thread converted them each stage: ~20 of the ~190 instructions of its stage, for 8 values.)
constexpr int kCodeTile = kBN * 32;
constexpr int kScaleRow = 16;
constexpr int kScaleTile = kBN * kScaleRow;
// The kernel's tiles of BM tokens:
// - CTAs per SM: 64-token tiles (<= 64 tokens, 32 accumulators a thread) run two at <= 80 registers with no register
//   trade, so that a K-split grid has twice the clusters resident; wider tiles run one, whose consumers take the
//   producer's registers by setmaxnreg (their 128 or 64 accumulators and a stage's four A fragments).
// - Ring depth: 256- and 128-token tiles take 5 stages (186 / 106 KiB: the stages hold codes, not a bf16 weight tile;
//   -1% to +9% at 8192 tokens on the H200 against 4, where the consumers had waited on the stage-full barrier);
//   64-token tiles keep 4 (53 KiB each, two CTAs per SM).
template <int BM>
struct RsTile {
  static constexpr int kCtasPerSm = BM == 64 ? 2 : 1;
  static constexpr int kStages = BM == 64 ? 4 : 5;
  static constexpr int kATile = BM * kBK * 2;
  static constexpr int kSmemBytes = kStages * (kATile + kCodeTile + kScaleTile) + 1024;
};

// byte q of each of the four words of v, in word order; sel = q | (q + 4) << 4 (prmt: byte q of a, byte q of b)
__device__ __forceinline__ uint32_t gather_byte(uint4 v, uint32_t sel) {
  return prmt(prmt(v.x, v.y, sel), prmt(v.z, v.w, sel), 0x5410u);
}

__device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 ld_shared8(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared8(uint32_t addr, uint32_t lo, uint32_t hi) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}

// A 32-column half's block scale(s) as the bf16 pairs of its two k16 steps (both elements of a pair the same scale):
// NVFP4 two E4M3 bytes (steps 2h, 2h + 1), MXFP4 one E8M0 byte (both steps)
template <int FMT>
__device__ __forceinline__ uint2 half_step_scales(uint32_t raw) {
  if (FMT == kNVFP4) {
    const uint32_t s01 = e4m3x2_to_bf16x2(raw);
    return make_uint2(prmt(s01, s01, 0x1010u), prmt(s01, s01, 0x3232u));
  }
  const uint32_t pair = bf16_pair(e8m0_to_bf16_bits(raw & 0xFFu));
  return make_uint2(pair, pair);
}

template <int FMT, int BM>
__global__ void __launch_bounds__(kThreads, RsTile<BM>::kCtasPerSm)
    mixed_input_gemm_rs_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                               const uint8_t* __restrict__ scales, const float* __restrict__ gscale,
                               __nv_bfloat16* __restrict__ y, int M, int N, int K, bool accumulate,
                               const Nf4Operands nf4, int steps_per_split) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kATile = RsTile<BM>::kATile, kRing = RsTile<BM>::kStages;
  using Scales = ProducerScales<FMT, kBN>;
  __shared__ __align__(8) uint64_t full[kRing], empty[kRing];
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  const uint32_t x_tiles = base, code_tiles = base + kRing * kATile, scale_tiles = code_tiles + kRing * kCodeTile;
  const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
  const int m0 = blockIdx.y * BM;
  const int64_t n0 = (int64_t)blockIdx.x * kBN;
  // this CTA's stages: all of K, or with gridDim.z > 1 (a K-split cluster) the z-th run of steps_per_split
  const int kb_first = blockIdx.z * steps_per_split;
  const int nsteps = min((K + kBK - 1) / kBK - kb_first, steps_per_split);
  __shared__ float levels[16];  // NF4: a 16-word table in 16 banks, so any lookup pattern is conflict-free
  if (FMT == kNF4 && threadIdx.x < 16) levels[threadIdx.x] = nf4.levels[threadIdx.x];
  __shared__ uint32_t zero_word;  // a 0 the compiler cannot see (E2M1Tables below)
  if (threadIdx.x == 0) zero_word = 0u;
  init_ring<kRing>(&x_map, &w_map, full, empty);  // (its CTA barrier publishes the table too)

  if (wg == 0) {
    // ---- producer: per stage, the x and codes tiles by TMA (thread 0), and the scales (loaded kLook stages ahead)
    // into shared memory. Thread t holds the 32-column half h = t % 2 of rows t / 2 + 64 i.
    if constexpr (RsTile<BM>::kCtasPerSm == 1)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");  // registers to the consumers' fragments
    constexpr int kLook = 4;
    const Scales sc(scales, n0, N, K, t, nf4);
    const int h = t & 1;
    const float nf4_offset = FMT == kNF4 && sc.nested ? *nf4.offset : 0.f;
    uint32_t ring[kLook][Scales::kRows];
#pragma unroll
    for (int p = 0; p < kLook; ++p)
#pragma unroll
      for (int i = 0; i < Scales::kRows; ++i) ring[p][i] = p < nsteps ? sc.load(i, kb_first + p, K) : 0u;
    for (int j0 = 0; j0 < nsteps; j0 += kLook) {
#pragma unroll
      for (int p = 0; p < kLook; ++p) {  // unrolled by the ring's depth: its slots are indexed statically
        const int j = j0 + p, kb = kb_first + j;  // (j: the stage's place in this CTA's run)
        if (j >= nsteps) break;
        const int s = j % kRing;
        mbar_wait(smem_addr(&empty[s]), ((j / kRing) & 1) ^ 1);  // (open on the first pass)
        if (t == 0) {
          // zeros past M, N and K (the codes' zeros past N and K meet zero x columns or unstored rows)
          mbar_expect_tx(smem_addr(&full[s]), kATile + kCodeTile);
          tma_load_2d(x_tiles + s * kATile, &x_map, kb * kBK, m0, smem_addr(&full[s]));
          tma_load_2d(code_tiles + s * kCodeTile, &w_map, kb * (kBK / 2), (int)n0, smem_addr(&full[s]));
        }
#pragma unroll
        for (int i = 0; i < Scales::kRows; ++i) {
          const uint32_t scale = ring[p][i];
          if (j + kLook < nsteps) ring[p][i] = sc.load(i, kb + kLook, K);
          const uint32_t sdst = scale_tiles + s * kScaleTile + ((t >> 1) + 64 * i) * kScaleRow;
          if (FMT != kNF4) {
            const uint2 pairs = half_step_scales<FMT>(scale);  // words 2h, 2h + 1: steps 2h, 2h + 1
            st_shared8(sdst + 8 * h, pairs.x, pairs.y);
          } else {
            uint32_t absmax = scale;
            if (sc.nested) {  // formats.nf4.nf4_absmax: nested_code[q] * nested_absmax[b / 256] + offset, each rounded
              const float code = nf4.nested_code[scale & 0xFFu], nscale = nf4.nested_absmax[scale >> 8];
              absmax = __float_as_uint(__fadd_rn(__fmul_rn(code, nscale), nf4_offset));
            }
            st_shared4(sdst + 4 * h, absmax);
          }
        }
        mbar_arrive(smem_addr(&full[s]));  // (generic-proxy stores read by ld.shared: no proxy fence)
      }
    }
  } else {
    // ---- consumers: warpgroup wg - 1 owns weight rows 64 (wg - 1) .. + 64, all BM tokens; per k16 step one
    // register-operand m64nBMk16 WGMMA with the thread's decoded fragment of rows r0 = 64 cw + 16 warp + lane / 4 and
    // r0 + 8 as A and the x tile as B (the product is y^T)
    if constexpr (RsTile<BM>::kCtasPerSm == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const int cw = wg - 1, lane = t & 31;
    const int r0 = cw * 64 + (t >> 5) * 16 + (lane >> 2);
    // row r0's 16-byte halves 0 and 1 at these offsets (the TMA's 32-byte swizzle; r0 + 8: 256 bytes further, the
    // same swizzle); byte q = lane % 4 of each word by prmt(a, b, q | (q + 4) << 4)
    const uint32_t code_lo = r0 * 32 + (((r0 >> 2) & 1) << 4), code_hi = code_lo ^ 16u, scale_off = r0 * kScaleRow;
    // the x tiles' WGMMA descriptors: stage s, step k at x_desc + s * kATile / 16 + 2 k (the start address field holds
    // addr / 16 in 14 bits; every stage's address is below 2^18: no carry out of the field)
    const uint64_t x_desc = smem_desc(x_tiles);
    const uint32_t byte_sel = (lane & 3) | (((lane & 3) + 4) << 4);
    // 0, loaded: the tables stay in per-thread registers. (With M >> 31, uniform across the warp, the compiler kept
    // them in uniform registers and copied one into a register before each prmt: 16 of a stage's ~160 instructions.)
    uint32_t zero;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(zero) : "r"(smem_addr(&zero_word)) : "memory");
    const E2M1Tables tables(zero);
    float acc[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[i] = 0.f;

    // Stage j's codes and scales for this thread's rows r0 and r0 + 8, read from shared memory once it is full:
    // c0 / c1 byte q of words 0-3 (.x: k16 steps 0, 1) and of words 4-7 (.y: steps 2, 3) of the two rows;
    // NVFP4 / MXFP4 the bf16 scale pairs of steps 0-3 (sp0, sp1), NF4 the fp32 absmax bits of halves 0, 1 (am0, am1)
    struct StageCodes {
      uint2 c0, c1;
      uint4 sp0, sp1;
      uint2 am0, am1;
    };
    auto load_stage = [&](int j) {
      const int s = j % kRing;
      mbar_wait(smem_addr(&full[s]), (j / kRing) & 1);
      const uint32_t ct = code_tiles + s * kCodeTile, st = scale_tiles + s * kScaleTile + scale_off;
      StageCodes c;
      c.c0 = make_uint2(gather_byte(ld_shared16(ct + code_lo), byte_sel),
                        gather_byte(ld_shared16(ct + code_hi), byte_sel));
      c.c1 = make_uint2(gather_byte(ld_shared16(ct + code_lo + 256), byte_sel),
                        gather_byte(ld_shared16(ct + code_hi + 256), byte_sel));
      if (FMT == kNF4) {
        c.am0 = ld_shared8(st);
        c.am1 = ld_shared8(st + 8 * kScaleRow);
      } else {
        c.sp0 = ld_shared16(st);
        c.sp1 = ld_shared16(st + 8 * kScaleRow);
      }
      return c;
    };
    // The A fragments of k16 steps 2 half and 2 half + 1, frag[step][0..3] (rows r0, r0 + 8, r0, r0 + 8 of the
    // m64k16 fragment)
    auto decode_half = [&](const StageCodes& c, int half, uint32_t (&frag)[kBK / 16][4]) {
      // bytes 0, 1: step 2 half (columns 2q, 2q + 1 and 2q + 8, 2q + 9); bytes 2, 3: step 2 half + 1
      const uint32_t w0 = half ? c.c0.y : c.c0.x, w1 = half ? c.c1.y : c.c1.x;
      uint32_t d0[4], d1[4];
      if (FMT != kNF4) {
        e2m1x8_to_bf16(w0, tables, d0);
        e2m1x8_to_bf16(w1, tables, d1);
      }
      // NF4: each code byte's two nibbles as byte offsets of their levels (4 x the nibble; unused by the others)
      const uint32_t h0 = (w0 >> 2) & 0x3C3C3C3Cu, l0 = (w0 << 2) & 0x3C3C3C3Cu;
      const uint32_t h1 = (w1 >> 2) & 0x3C3C3C3Cu, l1 = (w1 << 2) & 0x3C3C3C3Cu;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int step = 2 * half + e;
        uint32_t* a = frag[step];
        if (FMT == kNF4) {  // levels[code] * absmax in fp32, rounded once (bitsandbytes: the even column high)
          const float m0f = __uint_as_float(half ? c.am0.y : c.am0.x), m1f = __uint_as_float(half ? c.am1.y : c.am1.x);
          a[0] = nf4_pair(h0, l0, 2 * e, levels, m0f);  // (e2m1_decode.cuh)
          a[1] = nf4_pair(h1, l1, 2 * e, levels, m1f);
          a[2] = nf4_pair(h0, l0, 2 * e + 1, levels, m0f);
          a[3] = nf4_pair(h1, l1, 2 * e + 1, levels, m1f);
        } else {  // exact: e2m1 times a block scale has at most 5 significant bits
          const uint32_t s0 = step == 0 ? c.sp0.x : step == 1 ? c.sp0.y : step == 2 ? c.sp0.z : c.sp0.w;
          const uint32_t s1 = step == 0 ? c.sp1.x : step == 1 ? c.sp1.y : step == 2 ? c.sp1.z : c.sp1.w;
          a[0] = bf16x2_mul(d0[2 * e], s0);
          a[1] = bf16x2_mul(d1[2 * e], s1);
          a[2] = bf16x2_mul(d0[2 * e + 1], s0);
          a[3] = bf16x2_mul(d1[2 * e + 1], s1);
        }
      }
    };
    // The A fragments of stage j's four k16 steps, decoded once the stage is full
    auto decode_stage = [&](int j, uint32_t (&frag)[kBK / 16][4]) {
      const StageCodes c = load_stage(j);
      decode_half(c, 0, frag);
      decode_half(c, 1, frag);
    };
    // the WGMMAs of k16 steps 2 half and 2 half + 1 of stage j, each its own commit group
    auto issue_half = [&](int j, int half, const uint32_t (&frag)[kBK / 16][4]) {
      const uint64_t stage_desc = x_desc + (uint32_t)((j % kRing) * (kATile >> 4));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int step = 2 * half + e;
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
        wgmma_fence();
        wgmma_rs_k16<BM>(acc, frag[step], stage_desc + 2 * step);  // (x_tile + 32 step)
        wgmma_commit();
      }
    };
    // A WGMMA reads its A registers asynchronously, and a loop body's registers are the same ones every time round:
    // a fragment may be written again only once the WGMMAs that read it are complete (PTX: writing it earlier is
    // undefined). Until session 27 the loop left the last three WGMMAs in flight and decoded the next stage into the
    // same registers; while the producer made the consumers wait, those WGMMAs had always read them by then. With the
    // codes by TMA the consumers no longer wait, and MXFP4's rows r0 came out wrong, differently from run to run.
    // So each stage waits for its own WGMMAs before the next decode (but NF4's 64-token tiles: for the two that read
    // the half it decodes next, below), and the other consumer warpgroup (at 64 tokens, the other three) keeps
    // the tensor cores busy meanwhile. (Tried: decoding stage j + 1 into a second set of fragments while stage j's
    // WGMMAs run. Copied into the first set after the wait, the SASS wrote the first set's registers before it and
    // every format broke; with the stages alternating between the two sets, ptxas serialized the WGMMAs, C7513.
    // tests/kernels/test_csrc_ptxas.py checks the SASS for both hazards.)
    uint32_t frag[kBK / 16][4];
    if constexpr (BM != 64 || FMT != kNF4) {
      // A stage's decode overlaps the previous stage's last WGMMAs. H200: NVFP4 64-token tiles (<= 64 tokens, K split
      // over a cluster: few stages a CTA, latency-bound) +0-7%, geomean +5%, at 40-64 tokens (session 32); NVFP4 /
      // MXFP4 128- and 256-token tiles +0-8%, geomean +4%, at 512-2048 tokens (session 33); NF4's at 512-2048 tokens
      // even (+-3%). NF4's 64-token tiles, whose decode reads its levels from shared memory, lost 1-4% this way and
      // keep the loop below.
      // Each half of the fragments is written again only once the two WGMMAs that read it are complete (wait_group 2
      // leaves the other half's two in flight). So the loop goes round with the stage's four WGMMAs in flight, and its
      // head writes none of their registers before the first wait (test_csrc_ptxas.py follows the SASS round it).
      if (nsteps > 0) {
        decode_stage(0, frag);
        issue_half(0, 0, frag);
        issue_half(0, 1, frag);
      }
      for (int j = 1; j < nsteps; ++j) {
        const StageCodes c = load_stage(j);  // (read while stage j - 1's WGMMAs run)
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
        wgmma_wait<2>();  // stage j - 1's steps 0, 1: frag[0], frag[1] free
        decode_half(c, 0, frag);
        issue_half(j, 0, frag);
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
        wgmma_wait<2>();  // stage j - 1's steps 2, 3: frag[2], frag[3] free, and the stage read
        mbar_arrive(smem_addr(&empty[(j - 1) % kRing]));
        decode_half(c, 1, frag);
        issue_half(j, 1, frag);
      }
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
      wgmma_wait<0>();
      if (nsteps > 0) mbar_arrive(smem_addr(&empty[(nsteps - 1) % kRing]));
    } else {
      for (int j = 0; j < nsteps; ++j) {
        decode_stage(j, frag);
        issue_half(j, 0, frag);
        issue_half(j, 1, frag);
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
        wgmma_wait<0>();
        mbar_arrive(smem_addr(&empty[j % kRing]));  // its x tile, codes and scales may be refilled
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_operand(acc[i]);
    static_assert(BM * kOutLd * 4 <= kRing * (kATile + kCodeTile + kScaleTile), "the output tile fits the stages");
    float* out = reinterpret_cast<float*>(smem_raw + (base - smem_addr(smem_raw)));
    if (gridDim.z == 1)
      store_tile<FMT, BM>(acc, out, gscale, y, M, N, m0, n0, cw, t, accumulate);
    else
      fragments_to_tile<BM>(acc, out, 1.f, cw, t);  // the partial sum, reduced across the cluster below
  }
  if (gridDim.z > 1)  // every thread of the CTA (the producer's too): the cluster's barriers count them all
    reduce_split_tile<FMT, BM>(reinterpret_cast<float*>(smem_raw + (base - smem_addr(smem_raw))), gscale, y, M, N,
                               m0, n0, accumulate);
#endif
}

constexpr int kMaxDevices = 64;

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda)
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// One call's operands, as the launchers pass them on
struct Call {
  const void* x;
  const uint8_t* w;
  const uint8_t* scales;
  const float* gscale;
  Nf4Operands nf4;
  void* y;
  int M, N, K;
  bool accumulate;
};

template <int FMT, int BM>
constexpr auto kernel_of() { return mixed_input_gemm_rs_kernel<FMT, BM>; }

template <int BM>
constexpr int smem_bytes_of() { return RsTile<BM>::kSmemBytes; }

// the kernel's opt-in to its dynamic shared memory, once per device
template <int FMT, int BM>
cudaError_t prepare(int dev) {
  static std::once_flag opted[kMaxDevices];
  cudaError_t err = cudaSuccess;
  std::call_once(opted[dev], [&] {
    err = cudaFuncSetAttribute(kernel_of<FMT, BM>(), cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes_of<BM>());
  });
  return err;
}

cudaLaunchConfig_t launch_config(dim3 grid, int smem_bytes, int split, cudaLaunchAttribute* attr,
                                 cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = (size_t)smem_bytes;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;  // a K split's CTAs form one cluster (their sum goes by DSMEM)
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = (unsigned)split;
  cfg.attrs = attr;
  cfg.numAttrs = split > 1 ? 1 : 0;
  return cfg;
}

// Clusters of `split` CTAs of the BM-token tiles that fit on device dev at once (cached): a grid
// past it would run a second, nearly empty wave (as the few-token kernel found).
template <int FMT, int BM>
int cluster_capacity(int dev, int split) {
  static std::mutex mutex;
  static std::unordered_map<int, int> cache;
  const int key = dev * 16 + split;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int n = 0;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = launch_config(dim3(1, 1, (unsigned)split), smem_bytes_of<BM>(), split, attr,
                                         nullptr);
  cfg.numAttrs = 1;
  if (prepare<FMT, BM>(dev) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&n, kernel_of<FMT, BM>(), &cfg) != cudaSuccess || n < 1) {
    (void)cudaGetLastError();
    n = 1;
  }
  const std::lock_guard<std::mutex> lock(mutex);
  cache[key] = n;
  return n;
}

// One launch: BM-token x 128-row tiles; with split > 1, each tile's K in `split` runs of steps_per_split stages by
// the CTAs of one cluster
template <int FMT, int BM>
cudaError_t launch_tile(const Call& c, int split, int steps_per_split, int dev, cudaStream_t stream) {
  cudaError_t err = prepare<FMT, BM>(dev);
  if (err != cudaSuccess) return err;
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // x [M, K] bf16 row-major: dims innermost first; boxes of 64 columns (128 bytes, the swizzle span) x BM rows
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)c.K, (cuuint64_t)c.M};
  const cuuint64_t strides[1] = {(cuuint64_t)c.K * 2};
  const cuuint32_t box[2] = {(cuuint32_t)kBK, (cuuint32_t)BM};
  const cuuint32_t elem_strides[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(c.x), dims, strides, box, elem_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  // the codes [N, K/2] bytes: boxes of one stage's 32 bytes x the CTA's 128 rows, 32-byte swizzle (the consumers'
  // bank groups), zeros past N and K/2 (a row stride of K/2 bytes: a multiple of 16, K % 32 == 0)
  CUtensorMap w_map;
  const cuuint64_t w_dims[2] = {(cuuint64_t)c.K / 2, (cuuint64_t)c.N};
  const cuuint64_t w_strides[1] = {(cuuint64_t)c.K / 2};
  const cuuint32_t w_box[2] = {(cuuint32_t)kBK / 2, (cuuint32_t)kBN};
  if (encode(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(c.w), w_dims, w_strides, w_box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_32B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const dim3 grid((unsigned)((c.N + kBN - 1) / kBN), (unsigned)((c.M + BM - 1) / BM), (unsigned)split);
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = launch_config(grid, smem_bytes_of<BM>(), split, attr, stream);
  return cudaLaunchKernelEx(&cfg, kernel_of<FMT, BM>(), map, w_map, c.scales, c.gscale,
                            reinterpret_cast<__nv_bfloat16*>(c.y), c.M, c.N, c.K, c.accumulate, c.nf4,
                            steps_per_split);
}

// The many-token tiles (the rule and its measurements: mixed_input_tiles, mixed_input_gemm.h)
template <int FMT>
cudaError_t launch_fmt(const Call& c, int sms, int dev, cudaStream_t stream) {
  const int steps = (c.K + kBK - 1) / kBK;
  const MixedInputTiles tiles = mixed_input_tiles(
      c.M, c.N, c.K, sms, [&](int s, long long clusters) { return clusters <= cluster_capacity<FMT, 256>(dev, s); });
  if (tiles.bm == 128) return launch_tile<FMT, 128>(c, 1, steps, dev, stream);
  const int per = (steps + tiles.split - 1) / tiles.split;
  return launch_tile<FMT, 256>(c, (steps + per - 1) / per, per, dev, stream);  // (no CTA without a stage)
}

// At most 64 tokens: 64-token tiles (m64n64 WGMMAs), K split over the largest cluster
// (<= 8 CTAs, <= one per stage) whose clusters all fit on the GPU at once, so that the weight streams through every SM;
// where not even clusters of 2 fit, few_token_multi_wave_split (mixed_input_gemm.h has why).
template <int FMT>
cudaError_t launch_few_tokens(const Call& c, int dev, int forced_split, cudaStream_t stream) {
  const int steps = (c.K + kBK - 1) / kBK, tiles = (c.N + kBN - 1) / kBN;
  int split = 0;
  for (int s = std::min(kMaxSplit, steps); s >= 2; --s)
    if (tiles <= cluster_capacity<FMT, 64>(dev, s)) {
      split = s;
      break;
    }
  if (split == 0)
    split = few_token_multi_wave_split(tiles, cluster_capacity<FMT, 64>(dev, 1), steps, kFewTokenMultiWaveSplit);
  split = few_token_split_or_forced(split, forced_split, steps);
  const int per = (steps + split - 1) / split;
  return launch_tile<FMT, 64>(c, (steps + per - 1) / per, per, dev, stream);  // (no CTA without a stage)
}

// NF4's operands for the kernel into *out, or false where they break its requirements: levels,
// blocks a power of two >= 32 dividing K, and a nested absmax's three operands all or none
bool nf4_operands(const float* levels, int nf4_block, int K, const float* nested_absmax, const float* nested_code,
                  const float* nested_offset, Nf4Operands* out) {
  int shift = 0;
  while (shift < 30 && (1 << shift) < nf4_block) ++shift;
  if (levels == nullptr || nf4_block < 32 || (1 << shift) != nf4_block || K % nf4_block != 0 ||
      (nested_code != nullptr && (nested_absmax == nullptr || nested_offset == nullptr)))
    return false;
  *out = Nf4Operands{levels, nested_absmax, nested_code, nested_offset, shift};
  return true;
}

}  // namespace

// Whether the loaded library holds the kernel's SM90a code for device dev: a cc 9.0 GPU, and a kernel whose static
// shared memory (its mbarriers, declared only in the SM90a body) is there. A build without an sm_90a target compiles
// an empty body. (An attribute query, not a probe launch: callable while a CUDA graph is being captured.)
bool mixed_input_gemm_supported(int dev) {
  static std::once_flag checked[kMaxDevices];
  static bool supported[kMaxDevices];
  if (dev < 0 || dev >= kMaxDevices) return false;
  std::call_once(checked[dev], [&] {
    int major = 0, minor = 0;
    cudaFuncAttributes attr{};
    supported[dev] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                     cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
                     major == 9 && minor == 0 &&
                     cudaFuncGetAttributes(&attr, mixed_input_gemm_rs_kernel<kNVFP4, 256>) == cudaSuccess &&
                     attr.sharedSizeBytes >= 2 * RsTile<256>::kStages * sizeof(uint64_t);
  });
  return supported[dev];
}

// y [M, N] bf16 (+)= x [M, K] bf16 @ deq(W)^T; fmt 0 NVFP4 (scales E4M3 [N, K/16], gscale the fp32 decode global),
// 1 MXFP4 (scales E8M0 [N, K/32]), 2 NF4 (bitsandbytes packing; scales the fp32 absmax per nf4_block elements, or its
// one-byte codes with nested_absmax / nested_code / nested_offset; levels its 16 values; nf4_block a power of two
// >= 32 dividing K). K % 32 == 0, x and w 16-byte aligned, y contiguous (the caller checks,
// mixed_input_gemm_supported first).
cudaError_t launch_mixed_input_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                    const float* gscale, const float* levels, int nf4_block,
                                    const float* nested_absmax, const float* nested_code, const float* nested_offset,
                                    void* y, int M, int N, int K, bool accumulate, int sms, int dev,
                                    cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  Call c{x, w, scales, gscale, {}, y, M, N, K, accumulate};
  const bool few = M <= 64;  // (64-token tiles, K split over a cluster)
  if (fmt == kNF4) {
    if (!nf4_operands(levels, nf4_block, K, nested_absmax, nested_code, nested_offset, &c.nf4))
      return cudaErrorInvalidValue;
    return few ? launch_few_tokens<kNF4>(c, dev, 0, stream) : launch_fmt<kNF4>(c, sms, dev, stream);
  }
  if (fmt == kNVFP4)
    return few ? launch_few_tokens<kNVFP4>(c, dev, 0, stream) : launch_fmt<kNVFP4>(c, sms, dev, stream);
  return few ? launch_few_tokens<kMXFP4>(c, dev, 0, stream) : launch_fmt<kMXFP4>(c, sms, dev, stream);
}

cudaError_t launch_mixed_input_gemm_few_tokens(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                               const float* gscale, const float* levels, int nf4_block, void* y, int M,
                                               int N, int K, int dev, int forced_split, cudaStream_t stream) {
  if (M < 1 || M > 64 || K % 32 != 0 || fmt < kNVFP4 || fmt > kNF4 || forced_split < 0) return cudaErrorInvalidValue;
  if (N <= 0) return cudaSuccess;
  Call c{x, w, scales, gscale, {}, y, M, N, K, false};
  if (fmt == kNF4) {  // (the fp32 absmax as it is: no nested operands)
    if (!nf4_operands(levels, nf4_block, K, nullptr, nullptr, nullptr, &c.nf4)) return cudaErrorInvalidValue;
    return launch_few_tokens<kNF4>(c, dev, forced_split, stream);
  }
  return fmt == kNVFP4 ? launch_few_tokens<kNVFP4>(c, dev, forced_split, stream)
                       : launch_few_tokens<kMXFP4>(c, dev, forced_split, stream);
}

}  // namespace surogate
