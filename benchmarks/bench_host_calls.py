"""Host time of the calls one recipe linear makes, each on its own (CUDA): where a host-bound step spends its time.

Tiny operands (64 tokens, 256 wide), so the GPU finishes each kernel before the host issues the next one and the
figure is the host's issue cost per call. Best of 5 blocks of `--iters` calls, one synchronize per block. Printed
as microseconds per call, next to aten::mm's, and written to results/host_calls.md.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from common import table, write_result


def timed(fn, iters):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--qlora", action="store_true",
                    help="also time the QLoRA decode route's calls at a SmolLM2-135M linear (576 -> 1536, 512 tokens): "
                         "the graph ops a compiled layer issues, against the aten calls of PEFT's compiled LoRA")
    ap.add_argument("--cprofile", action="store_true",
                    help="also run the fp8-hybrid RecipeLinear and FusedRMSNorm loops under cProfile and write the "
                         "functions with the most own time (which Python line the host time goes to)")
    args = ap.parse_args()
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    import surogate_hf.recipes as R
    from surogate_hf.kernels import triton_recipe as TR
    from surogate_hf.recipes.norm import FusedRMSNorm

    m, k = args.tokens, args.width
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, k, device=dev, dtype=torch.bfloat16)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    scale_row = torch.ones(1, device=dev)
    amax_bits = torch.zeros(1, device=dev, dtype=torch.int32)
    rows = []
    profiled = {}

    def add(name, fn, us=None):
        us = timed(fn, args.iters) if us is None else us
        rows.append([name, us])
        print(f"{name}: {us:.1f} us", flush=True)

    add("aten::mm bf16", lambda: torch.mm(x, w.t()))
    add("torch._scaled_mm e4m3 (0-dim scales)", lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16))
    add("torch._scaled_mm e4m3, fast accum", lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16,
                                                                      use_fast_accum=True))
    add("torch.empty x2", lambda: (torch.empty(m, k, device=dev, dtype=torch.float8_e4m3fn),
                                   torch.empty(k, m, device=dev, dtype=torch.float8_e4m3fn)))
    add("Triton cast+transpose, kernel[grid](...)", lambda: TR.cast_fp8_into(x, scale_row, amax_bits, torch.float8_e4m3fn, True))
    from surogate_hf.kernels import ext, fp8_cast

    if ext.load(build=False) is not None:
        add("csrc cast+transpose (kernels.fp8_cast, torch.empty x2 included)",
            lambda: fp8_cast.cast_fp8_into(x, scale_row, amax_bits, torch.float8_e4m3fn, True))
    else:
        print(f"csrc cast: not timed, the extension is {ext.status()[1]}", flush=True)

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    xr = x.clone().requires_grad_(True)
    add("autograd.Function identity fwd+bwd", lambda: Ident.apply(xr).sum().backward())
    add("aten sum+backward alone", lambda: xr.sum().backward())

    lin = nn.Linear(k, k, bias=False, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    add("nn.Linear fwd+bwd", lambda: lin(xg).sum().backward())
    for recipe in ("bf16", "fp8-hybrid"):
        layer = R.RecipeLinear.from_linear(nn.Linear(k, k, bias=False, device=dev, dtype=torch.bfloat16),
                                           R.RecipeConfig(recipe=recipe, model_dtype="bf16"))
        layer(xg).sum().backward()
        if layer.scaling_state is not None:
            layer.scaling_state.update()
        add(f"RecipeLinear {recipe} fwd+bwd", lambda layer=layer: layer(xg).sum().backward())
        profiled[f"RecipeLinear {recipe} fwd+bwd"] = lambda layer=layer: layer(xg).sum().backward()
    norm = Qwen3RMSNorm(k).to(dev, torch.bfloat16)
    add("Qwen3RMSNorm fwd+bwd (stock)", lambda: norm(xg).sum().backward())
    fused = FusedRMSNorm(norm)
    add("FusedRMSNorm fwd+bwd", lambda: fused(xg).sum().backward())
    profiled["FusedRMSNorm fwd+bwd"] = lambda: fused(xg).sum().backward()
    from surogate_hf.nn.linear import FP8Linear

    base = FP8Linear.from_linear(nn.Linear(k, k, bias=False, device=dev, dtype=torch.bfloat16))
    t = base._tensors()
    add("surogate::dequantize_fp8_blocks op", lambda: torch.ops.surogate.dequantize_fp8_blocks(
        t[""], t["_scale_inv"], 128, 128, torch.bfloat16))
    if args.qlora:
        qlora_rows(add)
    body = table(["call", "host us/call"], rows)
    body = f"{m} tokens, {k} wide, best of 5 x {args.iters} calls\n\n" + body
    if args.cprofile:
        body += "\n\n" + profile_python(profiled, args.iters)
    write_result("host_calls", "Host time per call on the GPU machine", body)


def qlora_rows(add, tokens=512, k=576, n=1536, r=16, rounds=7, iters=300):
    """The host cost of one LoRA linear's calls in a compiled graph: PEFT's (the aten GEMMs inductor's wrapper issues,
    and one pointwise kernel for the scaled sum) against the extension's decode + GEMM graph ops, per format. The calls
    are timed round-robin (`rounds` rounds, the best block of each), so a drift of the host's speed over the run
    does not favour the calls timed first; inference mode leaves out the Python autograd kernel registered for the
    forward op (what a compiled forward graph still passes through)."""
    from surogate_hf.kernels import ext
    from surogate_hf.nn import linear as L

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf)
    dy = torch.randn(tokens, n, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    a = torch.randn(r, k, device=dev, dtype=bf) / k ** 0.5
    b = torch.randn(n, r, device=dev, dtype=bf) / r ** 0.5
    h = x @ a.t()

    def peft_fwd():
        y = torch.mm(x, w.t())
        z = torch.mm(torch.mm(x, a.t()), b.t())
        return y.add_(z, alpha=2.0)

    def peft_bwd():
        dz = torch.mm(dy, b).mul_(2.0)
        dx = torch.mm(dy, w)
        dx.addmm_(dz, a)
        return dx, torch.mm(dz.t(), x), torch.mm(dy.t(), h).mul_(2.0)

    calls = {"PEFT LoRA fwd, as a compiled graph issues it (3 mm + 1 pointwise)": peft_fwd,
             "PEFT LoRA bwd, as a compiled graph issues it (4 mm + addmm_ + 2 pointwise)": peft_bwd}
    if ext.load(build=False) is None:
        print(f"decode graph ops: not timed, the extension is {ext.status()[1]}", flush=True)
    else:
        fwd_op = torch.ops.surogate.ext_decoded_linear_fwd.default
        bwd_op = torch.ops.surogate.ext_decoded_linear_bwd.default
        for fmt in ("nvfp4", "mxfp4", "nf4", "fp8"):
            base = L.linear_class(fmt).from_linear(torch.nn.Linear(k, n, bias=False, device=dev, dtype=bf))
            ops = base.graph_decode_operands()
            if ops is None:
                print(f"{fmt}: no decode route at [{n}, {k}]", flush=True)
                continue
            wq, s, g, lv, f, nn_, kk, blk, nested = ops
            nested = nested or ()  # an NF4 base's double-quantization operands, which the ops de-nest

            def fwd(wq=wq, s=s, g=g, lv=lv, f=f, nn_=nn_, kk=kk, blk=blk, nested=nested):
                return fwd_op(x, None, wq, s, g, lv, None, a, b, 2.0, f, nn_, kk, blk, *nested)

            def fwd_inference(fwd=fwd):
                with torch.inference_mode():
                    return fwd()

            if not nested:  # (ext_dequantize takes no nested operands)
                calls[f"{fmt} ext_dequantize alone"] = (
                    lambda wq=wq, s=s, g=g, lv=lv, f=f, nn_=nn_, kk=kk, blk=blk:
                    torch.ops.surogate.ext_dequantize(wq, s, g, lv, f, nn_, kk, blk, bf))
            calls[f"{fmt} ext_decoded_linear_fwd (decode + 3 GEMMs)"] = fwd
            calls[f"{fmt} ext_decoded_linear_fwd, inference mode (no Python autograd kernel)"] = fwd_inference
            calls[f"{fmt} ext_decoded_linear_bwd (decode + 5 GEMMs)"] = (
                lambda wq=wq, s=s, g=g, lv=lv, f=f, nn_=nn_, kk=kk, blk=blk, nested=nested:
                bwd_op(dy, x, h, wq, s, g, lv, a, b, 2.0, f, nn_, kk, blk, False, True, False, True, True, *nested))
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], timed(fn, iters))
    for name, us in best.items():
        add(name, None, us)


def profile_python(loops: dict, iters: int, top: int = 25) -> str:
    """cProfile of each loop (after its timed runs): the functions with the most own time. The backward runs on the
    calling thread here (autograd multithreading off), so cProfile, which sees one thread, sees it too."""
    import cProfile
    import io
    import pstats

    out = []
    for name, fn in loops.items():
        if name.startswith("RecipeLinear bf16"):
            continue
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out.append(f"### cProfile: {name}, {iters} calls (times are totals over the calls)\n\n```\n"
                   + buf.getvalue().strip() + "\n```")
    return "\n\n".join(out)


if __name__ == "__main__":
    main()
