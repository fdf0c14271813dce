"""Probe: can a Triton kernel decode the weight in its main loop and keep up with bf16 cuBLAS at training token
counts? A weight-only nvfp4 GEMM with the decoded weight as the LEFT operand of the tensor-core op (y^T = W x^T), so
that Hopper's wgmma may take it from registers, timed against bf16 cuBLAS and against a plain Triton bf16 GEMM in the
same orientation and tiling (what Triton reaches without the decode). Two decodes: the route's exact bit-pattern one
(`exact`), and a cheaper one (`cheap`: the E2M1 bits placed at bf16's exponent / mantissa, i.e. the value times
2^-126, with 2^118 folded into the block scale and 2^8 into the epilogue). Kernel time by CUDA events, GPU only.

    python benchmarks/probe_mixed_input_triton.py      (a CUDA GPU with Triton; prints one line per config)

Measured (H100, session 20, docs/kernels.md "Weight-only GEMMs at large token counts"): the fused kernel reaches
0.48-0.51x cuBLAS at its best tiling, where the plain Triton GEMM reaches 0.87-0.91x.
"""
import torch
import triton
import triton.language as tl

import surogate_hf.kernels  # noqa: F401  (the quantize ops' CUDA kernels)
from surogate_hf import formats as F
from surogate_hf.kernels.triton_gemm import _e2m1_bf16  # the route's exact E2M1 decode

ops = torch.ops.surogate


@triton.jit
def _cheap_e2m1_bf16(p):
    """The probe's cheap decode of packed E2M1 bytes [R, C/2] -> [R, C/2, 2]: the bits (s << 15) | (e1 e0 m << 6),
    i.e. the value times 2^-126 (0.5 lands on a bf16 subnormal); the caller folds 2^118 into the block scale and 2^8
    into the epilogue. Same values as the route's decode (triton_gemm._e2m1_bf16) after those factors."""
    c = tl.join((p & 0xF).to(tl.int16), (p >> 4).to(tl.int16))
    bits = ((c & 7) << 6) | ((c & 8) << 12)
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile(M, N, BN: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr):
    """(weight rows, token rows) of this program: GROUP weight tiles walk the token tiles together (L2 reuse)."""
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    n_m = tl.cdiv(M, BM)
    width = GROUP * n_m
    first_n = (pid // width) * GROUP
    gsz = min(n_n - first_n, GROUP)
    pid_n = first_n + (pid % width) % gsz
    pid_m = (pid % width) // gsz
    return pid_n * BN + tl.arange(0, BN), pid_m * BM + tl.arange(0, BM)


# (no masks: the probe's shapes are multiples of every tile below)
@triton.jit
def k_swap(x_ptr, p_ptr, s_ptr, y_ptr, M, N, K, gscale, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
           GROUP: tl.constexpr, CHEAP: tl.constexpr):
    rn, rm = _tile(M, N, BN, BM, GROUP)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        p = tl.load(p_ptr + rn[:, None].to(tl.int64) * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :])
        s8 = tl.load(s_ptr + rn[:, None].to(tl.int64) * (K // 16) + (k0 // 16 + tl.arange(0, BK // 16))[None, :])
        if CHEAP:
            w = tl.reshape(_cheap_e2m1_bf16(p), (BN, BK))
            sc = (s8.to(tl.float32) * 3.3230699894622904e+35).to(tl.bfloat16)  # scale * 2^118
        else:
            w = _e2m1_bf16(tl.reshape(tl.join(p & 0xF, p >> 4), (BN, BK)))
            sc = s8.to(tl.bfloat16)
        w = tl.reshape(tl.reshape(w, (BN, BK // 16, 16)) * sc[:, :, None], (BN, BK)).to(tl.bfloat16)
        xt = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :])
        acc = tl.dot(w, tl.trans(xt), acc)
    if CHEAP:
        acc = acc * (256.0 * gscale)
    else:
        acc = acc * gscale
    tl.store(y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], acc.to(tl.bfloat16))


@triton.jit
def k_plain(x_ptr, w_ptr, y_ptr, M, N, K, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    rn, rm = _tile(M, N, BN, BM, GROUP)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :])
        xt = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :])
        acc = tl.dot(w, tl.trans(xt), acc)
    tl.store(y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], acc.to(tl.bfloat16))


def bench(f, reps=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    st.record()
    for _ in range(reps):
        f()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) / reps * 1e3


CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 128, 64, 4, 4),
           (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]


def main():
    for (n, k, m) in [(4096, 4096, 2048), (14336, 4096, 2048), (4096, 14336, 2048), (4096, 4096, 8192)]:
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02).cuda()
        args = tuple(ops.quantize_nvfp4(w, False, True, "mse", False, 0, None))
        p, s8, g = args[0], args[1], args[2]
        wd = F.dequantize_nvfp4(*args, torch.float32).to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ wd.float().t()
        flop = 2 * m * n * k
        t_cublas = bench(lambda: torch.nn.functional.linear(x, wd))
        print(f"[{n},{k}] M={m}: cuBLAS bf16 {t_cublas:.1f} us ({flop / t_cublas / 1e6:.0f} TF/s)", flush=True)
        gs = float(g.float().item()) if torch.is_tensor(g) else float(g)
        for (bn, bm, bk, warps, stages) in CONFIGS:
            grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            res = []
            for cheap in (False, True):
                try:
                    def fused():
                        k_swap[grid](x, p, s8, y, m, n, k, gs, BN=bn, BM=bm, BK=bk, GROUP=8, CHEAP=cheap,
                                     num_warps=warps, num_stages=stages)

                    t = bench(fused)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    res.append(f"{'cheap' if cheap else 'exact'} {t:.1f} us {t_cublas / t:.2f}x err {err:.1e}")
                except Exception as e:
                    res.append(f"{'cheap' if cheap else 'exact'} failed: {type(e).__name__}: {str(e)[:120]}")
            yp = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            try:
                tp = bench(lambda: k_plain[grid](x, wd, yp, m, n, k, BN=bn, BM=bm, BK=bk, GROUP=8, num_warps=warps, num_stages=stages))
                plain = f"plain bf16 {tp:.1f} us {t_cublas / tp:.2f}x"
            except Exception as e:
                plain = f"plain failed {type(e).__name__}"
            print(f"  BN {bn} BM {bm} BK {bk} w{warps} s{stages}: {'; '.join(res)}; {plain}", flush=True)


if __name__ == "__main__":
    main()
