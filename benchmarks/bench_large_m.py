"""Weight-only forward GEMM at many tokens: the mixed-input WGMMA kernel (csrc/weight_only/mixed_input_gemm.cu, the
weight decoded inside the GEMM by the consumer warpgroups into register operands: "rs") against the dense route it
would replace (surogate::ext_dequantize into a bf16 buffer, then cuBLAS) and against bf16 cuBLAS itself, on the
linears of real models, side by side in one process.

Each timing is a CUDA graph replay of CHAIN distinct layers back to back (their weights exceed L2 as a model's do),
per call. Targets (issue 13): >= 0.9x bf16 cuBLAS at M >= 2048 and >= 1.5x at M <= 64, judged for every path (the
route's default: decode + cuBLAS, or the few-token kernel at <= 64 tokens; the mixed-input kernel runs in the route
with SUROGATE_HF_MIXED_INPUT=1; at <= 64 tokens the few-token op runs its K-split variant for large 4-bit weights
from 33 tokens, wide ones from 17, kernels.paths.few_token_wgmma). (Results before session 25 also have a "mixed smem" column:
a first mixed-input kernel that decoded into shared memory, since removed; results/large_m_s21.md judges it alone.)
    python benchmarks/bench_large_m.py --models Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M --tokens 16,64,2048,8192
"""

from __future__ import annotations

import argparse

import torch

from bench_shapes import graph_replay
from common import bench_ms, table, write_result

import surogate_hf.kernels  # noqa: F401
from surogate_hf.kernels import ext
from surogate_hf.kernels import model_shapes as S
from surogate_hf.kernels import paths
from surogate_hf.ops import ext as E


def _quantize(w, fmt):
    """w quantized where it lies, as dict(mixed=ext_mixed_input_gemm's operands after x up to k, with the block and
    NF4's nested operands after n, k; dense=ext_dequantize's). NF4: double-quantized, as QLoRA stores it; the mixed
    kernel de-nests the absmax itself, the dense decode is given the de-nested fp32 absmax."""
    import surogate_hf.formats as F

    if fmt == "nvfp4":
        packed, s, g = F.quantize_nvfp4(w)
        ops = (packed, s.view(torch.uint8), g.float().reshape(()), None, 0)
        return {"mixed": (ops, 16, ()), "dense": (ops, 16)}
    if fmt == "mxfp4":
        packed, s = F.quantize_mxfp4(w)
        ops = (packed, s, None, None, 1)
        return {"mixed": (ops, 32, ()), "dense": (ops, 32)}
    packed, st = F.quantize_nf4(w, 64, True)
    levels = st.code.float().contiguous()
    nested = (st.state2.absmax.float().contiguous(), st.state2.code.float().contiguous(),
              torch.as_tensor(st.offset, dtype=torch.float32, device=w.device).reshape(1))
    return {"mixed": ((packed, st.absmax.contiguous(), None, levels, 2), 64, nested),
            "dense": ((packed, F.nf4_absmax(st).float().contiguous(), None, levels, 2), 64)}


def distinct_linears(models: str):
    """(model, projection, in_features, out_features) of each distinct weight shape of the comma-separated models, in
    order (a shape two models share is timed once)."""
    done = set()
    for model in models.split(","):
        for proj, (k, n) in S.linears(model).items():
            if (k, n) not in done:
                done.add((k, n))
                yield model, proj, k, n


def dense_chain(n: int, k: int, chain: int) -> list[torch.Tensor]:
    """`chain` distinct bf16 [n, k] weights (seeded), to be called back to back: together they exceed L2 as a model's
    layers do."""
    torch.manual_seed(0)
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(chain)]


def bf16_chain_ms(x: torch.Tensor, dense: list[torch.Tensor]) -> float:
    """bf16 cuBLAS, x @ w.T for each weight of the chain back to back in one CUDA graph: ms per call."""
    def bf16():
        for w in dense:
            torch.nn.functional.linear(x, w)

    return bench_ms(graph_replay(bf16)) / len(dense)


def route_chain_ms(x: torch.Tensor, ws: list, n: int, k: int, outs: list[torch.Tensor]) -> float:
    """The decode route over the chain (ws: each weight's ext_dequantize operands and block): decode into a bf16
    buffer, then cuBLAS into outs, in one CUDA graph; ms per call."""
    def route():
        for (ops, block), y in zip(ws, outs):
            torch.mm(x, E.ext_dequantize(*ops, n, k, block, torch.bfloat16).t(), out=y)

    return bench_ms(graph_replay(route)) / len(ws)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="large_m")
    ap.add_argument("--skip-rs", action="store_true", help="leave out the mixed-input kernel's column: device_run.sh "
                    "passes it when that kernel's GPU tests failed")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    capability, sm90a = torch.cuda.get_device_capability(), ext.sm90a_built() and not args.skip_rs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for model, proj, k, n in distinct_linears(args.models):
        dense = dense_chain(n, k, args.chain)
        quant = {f: [_quantize(w, f) for w in dense] for f in args.formats.split(",")}
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            t_bf16 = bf16_chain_ms(x, dense)
            for f, ws in quant.items():
                def mixed(ws=ws):
                    for q in ws:
                        ops, block, nested = q["mixed"]
                        E.ext_mixed_input_gemm(x, *ops, n, k, block, *nested)

                t_rs = float("nan") if args.skip_rs else bench_ms(graph_replay(mixed)) / args.chain

                def dense_route(ws=ws):
                    for q in ws:
                        ops, block = q["dense"]
                        torch.nn.functional.linear(x, E.ext_dequantize(*ops, n, k, block, torch.bfloat16))

                def few_token(ws=ws):
                    for q in ws:
                        ops, block = q["dense"]
                        E.ext_few_token_gemm(x, *ops, n, k, block)

                # (at <= 64 tokens the route's kernel is the few-token one, timed in the "decode + cuBLAS" column's place)
                t_dense = bench_ms(graph_replay(few_token if m <= 64 else dense_route)) / args.chain
                # the route's GEMM alone, on the decoded weights (not bf16's random ones: a GEMM's time can depend
                # on its operands' values): the route's time less this is what the decode costs inside the chain
                t_gemm_decoded = float("nan")
                if m > 64:
                    decoded = [E.ext_dequantize(*q["dense"][0], n, k, q["dense"][1], torch.bfloat16) for q in ws]

                    def gemm_decoded(decoded=decoded):
                        for w in decoded:
                            torch.nn.functional.linear(x, w)

                    t_gemm_decoded = bench_ms(graph_replay(gemm_decoded)) / args.chain
                    del decoded
                target = 0.9 if m >= 2048 else 1.5 if m <= 64 else None
                # what a module's forward runs for these tokens (above 64: the decode route's rule, which takes the
                # mixed-input kernel for large NVFP4 / MXFP4 weights up to 2048 tokens)
                takes_rs = m > 64 and paths.mixed_input_kernel(f, m, n, k, torch.bfloat16, capability, sm90a, sms=sms)
                t_default = t_rs if takes_rs else t_dense

                def verdict(speed, target=target):
                    if target is None or speed != speed:
                        return ""
                    return "meets" if speed >= target else f"misses by {target - speed:.2f}x"

                # (times in us: the table prints 3 decimals, and a small GEMM's ms would keep only whole us)
                rows.append([f"{k}->{n}", f"{model} {proj}", m, f, 1e3 * t_bf16, 1e3 * t_gemm_decoded, 1e3 * t_dense,
                             1e3 * t_rs, t_bf16 / t_dense, t_bf16 / t_rs, t_dense / t_rs, "mixed rs" if takes_rs else "route",
                             t_bf16 / t_default, target, verdict(t_bf16 / t_default)])
                print(rows[-1], flush=True)
        del dense, quant
        torch.cuda.empty_cache()
    body = table(["shape (in->out)", "linear", "M", "format", "bf16 cuBLAS us", "cuBLAS on the decoded weight us",
                  "route us", "mixed rs us", "route x bf16", "mixed rs x bf16", "rs vs route", "default path",
                  "default x bf16", "target", "default"], rows)
    body += ("\nroute: decode + cuBLAS from 512 tokens, the few-token op (ext_few_token_gemm) at <= 64 (from 33 tokens, "
             "17 on wide weights, it runs large 4-bit weights through the register-operand kernel's K-split variant: "
             "kernels.paths.few_token_wgmma); mixed rs: the mixed-input kernel (ext_mixed_input_gemm), at <= 64 tokens "
             "that K-split variant. default path: what a module's forward runs (from 512 tokens "
             "kernels.paths.mixed_input_kernel picks between the two; SUROGATE_HF_MIXED_INPUT overrides it); the "
             "target is judged on it. cuBLAS on the decoded weight: the route's GEMM alone (from 512 tokens), on the "
             "weights the decode gives.\n")
    write_result(args.name, "Weight-only GEMM at many tokens: mixed-input kernel vs decode + cuBLAS vs bf16", body)


if __name__ == "__main__":
    main()
