"""The dense decode of a frozen 4-bit or FP8 weight into bf16 (surogate::ext_dequantize, csrc/weight_only/decode.cu),
the first half of the weight-only route (decode, then cuBLAS: 4-bit bases above 64 tokens, FP8 bases of small
weights), against the Triton decodes it replaced (kernels.triton_gemm.dequantize, kernels.registry.
dequantize_fp8_blocks), bitsandbytes' dequantize_4bit (NF4, the peer QLoRA users run) and a bf16 copy of the output's
size (what HBM moves: the decode's bandwidth as a fraction of it), side by side in one process.

Each timing is a CUDA graph replay of CHAIN distinct weights decoded back to back (more than L2 holds, as a model's
layers), per call; bytes moved = codes + scales read + bf16 written.
    python benchmarks/bench_decode.py --models Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M
"""

from __future__ import annotations

import argparse

import torch

from bench_large_m import _quantize, dense_chain, distinct_linears
from bench_shapes import graph_replay
from common import bench_ms, table, write_result

import surogate_hf.kernels  # noqa: F401
from surogate_hf.kernels import ext
from surogate_hf.kernels import registry, triton_gemm
from surogate_hf.ops import ext as E


def _quantized(w, fmt):
    """ext_dequantize's operands after w and the block (bench_large_m's for the 4-bit formats; FP8 in 128x128 blocks)."""
    if fmt != "fp8":
        return _quantize(w, fmt)["dense"]
    import surogate_hf.formats as F

    q, scale_inv = F.quantize_fp8_blocks(w, (128, 128))
    return (q, scale_inv.float().contiguous(), None, None, 3), 128


def _bnb_nf4(w):
    """bitsandbytes' own NF4 tensor of w (double-quantized, block 64, as QLoRA stores it) and its QuantState."""
    import bitsandbytes.functional as BF

    return BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M")
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4,fp8")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="decode")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    try:
        import bitsandbytes.functional as BF
    except ImportError:
        BF = None
    rows = []
    for model, proj, k, n in distinct_linears(args.models):
        dense = dense_chain(n, k, args.chain)
        src = [torch.empty_like(w) for w in dense]

        def copy(dense=dense, src=src):
            for w, s in zip(dense, src):
                s.copy_(w)

        t_copy = bench_ms(graph_replay(copy)) / args.chain
        copy_tbs = 4 * n * k / t_copy / 1e9
        for f in args.formats.split(","):
            qs = [_quantized(w, f) for w in dense]
            (_, s0, _, _, code), block = qs[0]
            read = n * k // (1 if f == "fp8" else 2) + s0.numel() * s0.element_size()

            def ours(qs=qs):
                for ops, block in qs:
                    E.ext_dequantize(*ops, n, k, block, torch.bfloat16)

            def triton(qs=qs):
                for (packed, s, g, lv, code), block in qs:
                    if code == 3:
                        registry.dequantize_fp8_blocks(packed, s, block, block, torch.bfloat16)
                        continue
                    s = s.view(torch.float8_e4m3fn) if code == 0 else s  # the Triton decode takes E4M3 typed
                    triton_gemm.dequantize(code, packed, s, g, lv, n, k, block, torch.bfloat16)

            t_ours = bench_ms(graph_replay(ours)) / args.chain
            t_triton = bench_ms(graph_replay(triton)) / args.chain
            t_bnb = float("nan")
            if f == "nf4" and BF is not None:
                bq = [_bnb_nf4(w) for w in dense]

                def bnb(bq=bq):
                    for packed, st in bq:
                        BF.dequantize_4bit(packed, st)

                t_bnb = bench_ms(graph_replay(bnb)) / args.chain
            tbs = (read + 2 * n * k) / t_ours / 1e9
            rows.append([f"{k}->{n}", f"{model} {proj}", f, t_ours * 1e3, t_triton * 1e3, t_bnb * 1e3,
                         t_copy * 1e3, tbs, copy_tbs, tbs / copy_tbs, t_triton / t_ours, t_bnb / t_ours])
        del dense, src
    headers = ["shape (in->out)", "linear", "format", "ours us", "Triton decode us", "bnb dequantize_4bit us",
               "bf16 copy us", "ours TB/s", "copy TB/s", "ours / copy bandwidth", "ours x Triton", "ours x bnb"]
    write_result(args.name, "Dense decode of a 4-bit or FP8 weight into bf16: ours vs Triton vs bitsandbytes vs a bf16 "
                 "copy",
                 table(headers, rows))


if __name__ == "__main__":
    main()
