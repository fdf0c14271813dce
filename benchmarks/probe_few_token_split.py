"""The few-token op's K split rule against forced splits (SUROGATE_HF_FEW_TOKEN_SPLIT=1..8), and bf16 cuBLAS.

The few-token launches (csrc/fp4/few_token_gemm.cu, and the register-operand WGMMA kernel from 33 tokens on large
weights, from 17 on wide ones: kernels.paths.few_token_wgmma) split each tile's K over a thread-block cluster;
csrc/weight_only/mixed_input_gemm.h (few_token_multi_wave_split) states the rule and these measurements. Per
weight, format and token count: bf16 cuBLAS, the op under its rule, and the op with every forced split; eight
distinct weights back to back in one CUDA graph, us per call. Session 34's figures:
benchmarks/results/decode/few_tokens_multi_wave_split_h200.md. Example (GPU machine):
    python benchmarks/probe_few_token_split.py --shapes "Qwen2.5-7B gate_up:3584:18944" --tokens 1,16,40
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_large_m import _quantize, bf16_chain_ms, dense_chain
from bench_shapes import graph_replay
from common import bench_ms, table, write_result

from surogate_hf.kernels import ext
from surogate_hf.ops import ext as E

SPLIT_ENV = "SUROGATE_HF_FEW_TOKEN_SPLIT"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="Qwen2.5-7B gate_up:3584:18944,Llama-3.1-8B gate_up:4096:14336,"
                    "Gemma-2-2B gate_up:2304:9216", help="comma-separated name:in_features:out_features")
    ap.add_argument("--tokens", default="1,8,16,32,40,64")
    ap.add_argument("--formats", default="nvfp4,nf4")
    ap.add_argument("--splits", default="0,1,2,3,4,5,6,7,8", help="0: the rule")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="probe_few_token_split")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    assert SPLIT_ENV not in os.environ, f"unset {SPLIT_ENV}: this probe sets it per timing"
    splits = [int(s) for s in args.splits.split(",")]
    rows = []
    for spec in args.shapes.split(","):
        name, k, n = spec.split(":")
        k, n = int(k), int(n)
        dense = dense_chain(n, k, args.chain)
        for fmt in args.formats.split(","):
            ws = [_quantize(w, fmt)["dense"] for w in dense]
            for m in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_bf16 = bf16_chain_ms(x, dense) * 1e3
                times = {}
                for split in splits:
                    os.environ[SPLIT_ENV] = str(split)  # (read by the op at each call, so at the graph's capture)

                    def few(ws=ws):
                        for ops, block in ws:
                            E.ext_few_token_gemm(x, *ops, n, k, block)

                    times[split] = bench_ms(graph_replay(few)) / args.chain * 1e3
                del os.environ[SPLIT_ENV]
                forced = [s for s in splits if s > 0]
                best = min(forced, key=times.get) if forced else None
                row = [name, f"{k}->{n}", m, fmt, t_bf16] + [times[s] for s in splits]
                row += [f"s{best}" if best else "", times[0] / times[best] if best and 0 in times else float("nan"),
                        t_bf16 / times[0] if 0 in times else float("nan")]
                rows.append(row)
                print(row, flush=True)
        del dense
        torch.cuda.empty_cache()
    heads = ["linear", "shape", "M", "format", "bf16 cuBLAS us"] + [
        "rule us" if s == 0 else f"split {s} us" for s in splits] + ["best forced", "best x rule", "rule x bf16"]
    body = table(heads, rows)
    body += (f"\nrule: the launch's own split; split s: {SPLIT_ENV}=s (capped at the K steps). Times per call of a "
             f"chain of {args.chain} distinct weights in one CUDA graph.\n")
    write_result(args.name, "The few-token op's K split: the rule against forced splits", body)


if __name__ == "__main__":
    main()
