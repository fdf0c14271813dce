// Mixed-input GEMM for many tokens (SM90a): y [M, N] = x [M, K] @ deq(W)^T for a frozen NVFP4 or MXFP4 weight
// W [N, K] and bf16 x, on the tensor cores' bf16 WGMMA path with the weight decoded on the fly.
//
// Hopper has no FP4 tensor cores. The route this replaces decodes the whole weight into a bf16 buffer and runs cuBLAS:
// at 2048 tokens the decode pass writes 2 bytes per element that the GEMM reads back, a fifth of cuBLAS's time at
// 4096 x 4096. Here the decode is a producer warpgroup's work, overlapped with the consumers' WGMMAs:
//   - a CTA computes a 128-token x 256-row tile of y (128 rows where 256 leave SMs idle); warpgroup 0 produces,
//     warpgroups 1 and 2 each run one m64n256k16 WGMMA per 16 columns of K on their 64 tokens;
//   - per 64-column stage the producer copies the x tile into shared memory (cp.async two stages ahead, 128-byte
//     swizzle, zeros past M and K) and decodes the stage's 256 x 64 weight codes (loaded into registers two stages ahead) into the bf16
//     tile the WGMMAs read, in the same swizzle: lane pairs own a row's two 32-column halves, the E2M1 decode and the
//     block-scale multiply of e2m1_decode.cuh (exact in bf16), one 16-byte store per 8 elements;
//   - four stages in a ring of mbarriers: full (the producer's 128 threads, each after its copies landed and its
//     stores were fenced for the async proxy) and empty (the consumers' 256 threads, once the WGMMAs that read the
//     stage completed).
// Each decoded element is used by the CTA's 128 tokens, so the decode costs ~2.5 instructions per element per 128
// tokens: a small share of the issue slots, which the tensor cores' work leaves free.
// Numerics: the decoded element is the reference's, exact in bf16 (at most 5 significant bits); products accumulate
// in fp32; the NVFP4 decode global multiplies the fp32 sum once, as the few-token kernel does. Only the fp32
// summation order differs from x.float() @ deq(W).float().T.
// Requirements (surogate_hf.kernels.paths.mixed_input_kernel checks them, the launcher again): K % 32 == 0 (a lane's
// 32-column half is wholly in or out of range), 16-byte aligned codes and x, any M and N.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "../fp4/e2m1_decode.cuh"

namespace surogate {
namespace {

using namespace wdec;

constexpr int kBM = 128;        // tokens per CTA: two consumer warpgroups of 64
constexpr int kBK = 64;         // K per stage: one 128-byte swizzle row of bf16
constexpr int kStages = 4;
constexpr int kThreads = 384;   // warpgroup 0 produces, 1 and 2 consume
constexpr int kATile = kBM * kBK * 2;  // bytes of a stage's x tile
// BN weight rows per CTA (the WGMMA's N): 256, or 128 where 256 leaves SMs idle (launch_fmt)
template <int BN>
struct Tile {
  static constexpr int kBTile = BN * kBK * 2;  // bytes of a stage's decoded weight tile
  static constexpr int kSmemBytes = kStages * (kATile + kBTile) + 1024;  // + slack to align the tiles to 1024 bytes
};

// Byte offset of 16-byte chunk c (0..7) of row r in a tile of 128-byte rows, 128-byte swizzle (what the WGMMA
// descriptor's layout type 1 reads: chunk c of row r at slot c ^ (r % 8), rows in 1024-byte groups of 8)
__device__ __forceinline__ uint32_t swizzled(int r, int c) { return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4)); }

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

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  // 16 bytes global -> shared through L2 only; valid == false writes zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ void st_shared16(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy that WGMMA reads through
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
// keeps the compiler from moving accumulator reads or writes across the asynchronous WGMMAs
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d[BN / 2] += A (64 x 16) * B (16 x BN), both bf16 K-major tiles in shared memory (descriptors a, b): one warpgroup's
// m64nBNk16 WGMMA into its fp32 fragment d
template <int BN>
__device__ __forceinline__ void wgmma_k16(float* d, uint64_t a, uint64_t b);
template <>
__device__ __forceinline__ void wgmma_k16<256>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, "
      "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "
      "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "
      "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "
      "%124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
        "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),
        "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),
        "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
        "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_k16<128>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(1));
}

// The producer's weight rows: thread t decodes the 32-column half t % 2 of rows t / 2 + 64 i (i < BN / 64) of the CTA's
// BN, so a warp's 16-byte loads cover 16 rows' 32 contiguous bytes each. Rows past N read row N - 1 (in bounds; their
// sums are never stored).
template <int FMT, int BN>
struct ProducerWeights {
  static constexpr int kRows = BN / 64;
  const uint8_t* codes;   // w + n0 * K/2
  const uint8_t* scale;   // NVFP4: + n0 * K/16; MXFP4: + n0 * K/32
  int off[kRows];         // byte offset of the half's codes at stage 0, from codes
  int half_col;           // first column of the half at stage 0

  __device__ __forceinline__ ProducerWeights(const uint8_t* w, const uint8_t* scales, int64_t n0, int N, int K, int t)
      : codes(w + n0 * (K / 2)), scale(scales + n0 * (FMT == kNVFP4 ? K / 16 : K / 32)), half_col(32 * (t & 1)) {
    const int last = (int)(N - 1 - n0);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int row = (t >> 1) + 64 * i;
      off[i] = (row < last ? row : last) * (K / 2) + 16 * (t & 1);
    }
  }

  // the half's 32 codes and scale(s) of row i at stage kb; zeros past K (K % 32 == 0: a half is wholly in or out)
  __device__ __forceinline__ LaneWeights load(int i, int kb, int K) const {
    LaneWeights lw{make_uint4(0, 0, 0, 0), 0u};
    if (kb * kBK + half_col < K) {
      const int o = off[i] + kb * (kBK / 2);  // bytes: 2 elements each
      lw.codes = ld_stream(codes + o);
      if (FMT == kNVFP4) {  // scale bytes of elements 2o .. 2o + 31: (2o / 16, + 1); byte loads, as K / 16 may be odd
        lw.scale = (uint32_t)scale[o >> 3] | ((uint32_t)scale[(o >> 3) + 1] << 8);
      } else {
        lw.scale = scale[o >> 4];
      }
    }
    return lw;
  }
};

// accumulate: y += the product (y read in the epilogue, one rounding of the fp32 sum), else y = the product
template <int FMT, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    mixed_input_gemm_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                            const uint8_t* __restrict__ scales, const float* __restrict__ gscale,
                            __nv_bfloat16* __restrict__ y, int M, int N, int K, bool accumulate) {
  constexpr int kBTile = Tile<BN>::kBTile;
  using Weights = ProducerWeights<FMT, BN>;
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  const uint32_t a_tiles = base, b_tiles = base + kStages * kATile;
  const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
  const int m0 = blockIdx.y * kBM;
  const int64_t n0 = (int64_t)blockIdx.x * BN;
  const int kblocks = (K + kBK - 1) / kBK;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full[s]), 128);
      mbar_init(smem_addr(&empty[s]), 256);
    }
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: x copies one stage ahead, weight codes two stages ahead (registers), the decode of this stage
    const Weights wts(w, scales, n0, N, K, t);
    const E2M1Tables tables((threadIdx.x * (unsigned)M) >> 31);
    // x: chunk t + 128 j (j = 0..7) of the 128 x 8 chunks of a stage: row (t >> 3) + 16 j, chunk t & 7; a warp's
    // copies read 4 rows' 128 contiguous bytes each
    const int xc = t & 7, xr = t >> 3;
    auto copy_x = [&](int kb, int s) {
      const int col = kb * kBK + xc * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int r = xr + 16 * j;
        const bool ok = m0 + r < M && col < K;
        cp_async16(a_tiles + s * kATile + swizzled(r, xc), ok ? x + (int64_t)(m0 + r) * K + col : x, ok);
      }
    };
    LaneWeights ring[2][Weights::kRows];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int i = 0; i < Weights::kRows; ++i) ring[p][i] = wts.load(i, p, K);
    // x copies run kXAhead stages ahead (an L2 round trip under load is about a stage's WGMMA time); the stages of
    // the first pass are free (their empty barriers open)
    constexpr int kXAhead = kStages - 2;
#pragma unroll
    for (int j = 0; j < kXAhead; ++j) {
      if (j < kblocks) copy_x(j, j);
      cp_async_commit();
    }
    for (int kb0 = 0; kb0 < kblocks; kb0 += 2) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {  // unrolled by the ring's depth: its slots are indexed statically
        const int kb = kb0 + p;
        if (kb >= kblocks) break;
        const int s = kb % kStages;
        // stage kb + kXAhead's previous round (kb - 2) has been consumed once the consumers are past stage kb - 1,
        // which this producer released last iteration: no wait on the consumers' current stage
        const int ahead = kb + kXAhead;
        if (ahead < kblocks) {
          mbar_wait(smem_addr(&empty[ahead % kStages]), ((ahead / kStages) & 1) ^ 1);
          copy_x(ahead, ahead % kStages);
        }
        cp_async_commit();
        // stage s is free: its empty barrier was waited on before its x copies were issued
#pragma unroll
        for (int i = 0; i < Weights::kRows; ++i) {
          uint32_t v[16];
          decode_lane<FMT>(ring[p][i], nullptr, tables, v);
          if (kb + 2 < kblocks) ring[p][i] = wts.load(i, kb + 2, K);  // (a slot past the end is not decoded again)
          const int row = (t >> 1) + 64 * i, c0 = 4 * (t & 1);
#pragma unroll
          for (int c = 0; c < 4; ++c)
            st_shared16(b_tiles + s * kBTile + swizzled(row, c0 + c), v[4 * c], v[4 * c + 1], v[4 * c + 2],
                        v[4 * c + 3]);
        }
        cp_async_wait<kXAhead>();  // this stage's x copies (the kXAhead newer groups may still fly)
        fence_proxy_async();
        mbar_arrive(smem_addr(&full[s]));
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumers: warpgroup wg - 1 owns tokens 64 (wg - 1) .. + 64 of the tile
  const int cw = wg - 1;
  constexpr int kAcc = BN / 2;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % kStages;
    mbar_wait(smem_addr(&full[s]), (kb / kStages) & 1);
    const uint32_t a = a_tiles + s * kATile + cw * 64 * 128, b = b_tiles + s * kBTile;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 16; ++k) wgmma_k16<BN>(acc, smem_desc(a + 32 * k), smem_desc(b + 32 * k));
    wgmma_commit();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) fence_operand(acc[i]);
    wgmma_wait<1>();  // the previous stage's WGMMAs are done: its tiles may be refilled
    if (kb > 0) mbar_arrive(smem_addr(&empty[(kb - 1) % kStages]));
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) fence_operand(acc[i]);

  // m64nBN fragment: acc[4j + 2h + e] at row 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + e
  const float g = FMT == kNVFP4 ? *gscale : 1.f;
  const int warp = t >> 5, lane = t & 31;
  const int row0 = m0 + cw * 64 + warp * 16 + (lane >> 2);
  const bool pairs = (N & 1) == 0;  // bf16x2 stores need an even row length
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int64_t col = n0 + 8 * j + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      if (row >= M || col >= N) continue;
      float v0 = acc[4 * j + 2 * h] * g, v1 = acc[4 * j + 2 * h + 1] * g;
      __nv_bfloat16* dst = y + (int64_t)row * N + col;
      const bool two = col + 1 < N;
      if (accumulate) {
        v0 += __bfloat162float(dst[0]);
        if (two) v1 += __bfloat162float(dst[1]);
      }
      if (pairs) {
        *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
      } else {
        dst[0] = __float2bfloat16_rn(v0);
        if (two) dst[1] = __float2bfloat16_rn(v1);
      }
    }
  }
#endif
}

constexpr int kMaxDevices = 64;

template <int FMT, int BN>
cudaError_t launch_tile(const void* x, const uint8_t* w, const uint8_t* scales, const float* gscale, void* y, int M,
                        int N, int K, bool accumulate, int dev, cudaStream_t stream) {
  static std::once_flag opted[kMaxDevices];
  cudaError_t err = cudaSuccess;
  std::call_once(opted[dev], [&] {
    err = cudaFuncSetAttribute(mixed_input_gemm_kernel<FMT, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Tile<BN>::kSmemBytes);
  });
  if (err != cudaSuccess) return err;
  const dim3 grid((unsigned)((N + BN - 1) / BN), (unsigned)((M + kBM - 1) / kBM));
  mixed_input_gemm_kernel<FMT, BN><<<grid, kThreads, Tile<BN>::kSmemBytes, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), w, scales, gscale, reinterpret_cast<__nv_bfloat16*>(y), M, N, K,
      accumulate);
  return cudaGetLastError();
}

// 256-row tiles where they make at least one full wave of CTAs (one per SM), else 128-row ones (twice the CTAs)
template <int FMT>
cudaError_t launch_fmt(const void* x, const uint8_t* w, const uint8_t* scales, const float* gscale, void* y, int M,
                       int N, int K, bool accumulate, int sms, int dev, cudaStream_t stream) {
  const int64_t wide = (int64_t)((N + 255) / 256) * ((M + kBM - 1) / kBM);
  if (wide >= sms) return launch_tile<FMT, 256>(x, w, scales, gscale, y, M, N, K, accumulate, dev, stream);
  return launch_tile<FMT, 128>(x, w, scales, gscale, y, M, N, K, accumulate, dev, stream);
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
                     cudaFuncGetAttributes(&attr, mixed_input_gemm_kernel<kNVFP4, 256>) == cudaSuccess &&
                     attr.sharedSizeBytes >= 2 * kStages * sizeof(uint64_t);
  });
  return supported[dev];
}

// y [M, N] bf16 (+)= x [M, K] bf16 @ deq(W)^T; fmt 0 NVFP4 (scales E4M3 [N, K/16], gscale the fp32 decode global),
// 1 MXFP4 (scales E8M0 [N, K/32]). K % 32 == 0, x and w 16-byte aligned, y contiguous (the caller checks,
// mixed_input_gemm_supported first).
cudaError_t launch_mixed_input_gemm(int fmt, const void* x, const uint8_t* w, const uint8_t* scales,
                                    const float* gscale, void* y, int M, int N, int K, bool accumulate, int sms,
                                    int dev, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  if (fmt == kNVFP4) return launch_fmt<kNVFP4>(x, w, scales, gscale, y, M, N, K, accumulate, sms, dev, stream);
  return launch_fmt<kMXFP4>(x, w, scales, gscale, y, M, N, K, accumulate, sms, dev, stream);
}

}  // namespace surogate
