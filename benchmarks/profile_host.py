"""Where the host time of one fp8 QLoRA base call goes: each piece of the fp8 block-scaled forward / dgrad
timed alone on tiny tensors (the GPU work is negligible, so the figure is the host cost of issuing it).
Diagnostic companion of bench_overhead.py; CUDA only."""

from __future__ import annotations

import os
import time

os.environ.setdefault("SUROGATE_HF_AUTOTUNE", "0")

import torch  # noqa: E402
import torch.nn.functional as Fn  # noqa: E402

import surogate_hf.kernels  # noqa: E402,F401
from surogate_hf.kernels import fp8_gemm as G  # noqa: E402
from surogate_hf.kernels import triton_quant as TQ  # noqa: E402
from surogate_hf.nn import linear as L  # noqa: E402


def timed(fn, iters=2000) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters // 5):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / (iters // 5) * 1e6)
    return best


def main():
    m, k, n = 16, 256, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    q = L.FP8Linear.from_linear(dense)
    w, s = q.weight, q.weight_scale_inv
    ws_mm = G.mm_scales(s)
    aq, as_ = TQ.quantize_fp8_tiles(x, 128, scale_colmajor=True)
    recipes_a = [int(Fn.ScalingType.BlockWise1x128.value)]
    recipes_b = [int(Fn.ScalingType.BlockWise128x128.value)]
    wt = w.t()
    wst = ws_mm.t()
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    plan = q._cuda_plan()
    rows = {
        "empty_like (one ATen op)": lambda: torch.empty_like(x),
        "bf16 torch.mm": lambda: torch.mm(x, dense.weight.t()),
        "triton quantize_fp8_tiles": lambda: TQ.quantize_fp8_tiles(x, 128, scale_colmajor=True),
        "triton transpose_2d(w)": lambda: TQ.transpose_2d(w),
        "F.scaled_mm (blockwise)": lambda: Fn.scaled_mm(aq, wt, as_, Fn.ScalingType.BlockWise1x128, wst,
                                                         Fn.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "torch._scaled_mm_v2 direct": lambda: torch._scaled_mm_v2(aq, wt, [as_], recipes_a, [], [wst], recipes_b, [],
                                                                  None, torch.bfloat16, [], False),
        "plan fwd (no grad)": lambda: plan.fwd(x, *plan.args),
        "plan dgrad": lambda: plan.dgrad(dy, *plan.args),
        "module fwd+bwd": lambda: q(xg).backward(dy),
        "nn.Linear fwd+bwd": lambda: dense(xg).backward(dy),
    }
    try:
        from surogate_hf.kernels import ext

        mod = ext.load(build=True)
        if mod is not None:
            sc = torch.ones((), device="cuda")
            qb = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
            am = torch.zeros(1, dtype=torch.int32, device="cuda")
            rows["csrc fp8_cast_amax (pybind)"] = lambda: mod.fp8_cast_amax(x, sc, qb, am)
            ra, rb = G._RECIPE_1X128, G._RECIPE_128X128
            rows["csrc fp8_block_gemm fwd"] = lambda: mod.fp8_block_gemm(x, w, ws_mm, False, ra, rb)
            rows["csrc fp8_block_gemm dgrad"] = lambda: mod.fp8_block_gemm(dy, w, G.mm_scales(s.t()), True, ra, rb)
    except Exception as exc:  # diagnostic script: say why the extension rows are missing
        print("extension rows skipped:", exc)
    print("| piece | host us/call |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {timed(fn):.1f} |", flush=True)




def cprofile_module(iters: int = 300):
    """cProfile of the fp8 module's fwd+bwd: which Python functions the host time goes to."""
    import cProfile
    import pstats

    dense = torch.nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    q = L.FP8Linear.from_linear(dense)
    xg = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        q(xg).backward(dy)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        q(xg).backward(dy)
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
    cprofile_module()
