"""Probe: the decode + cuBLAS route with the weight decoded chunk by chunk of output rows, each chunk's GEMM right
after its decode, so that the chunk's bf16 weight is still in L2 when the GEMM reads it (the route today decodes the
whole weight first: 117 MB of bf16 on the 8B MLP, far past the 50 MB L2, written to DRAM and read back).

Side by side in one process, CUDA graph replays of CHAIN distinct layers back to back (as bench_large_m):
bf16 cuBLAS; the route (ext_dequantize of the whole weight, then F.linear); the chunked route at several chunk
heights (ext_dequantize of rows [n0, n1), then mm into y[:, n0:n1], a strided view cuBLAS writes in place); the GEMM
alone on the decoded weight. Prints whether each chunked output equals the route's bit for bit (cuBLAS may pick
another kernel for a chunk's shape).
    python benchmarks/probe_chunked_route.py --models Llama-3.1-8B,Qwen3-1.7B --tokens 2048,8192
"""

from __future__ import annotations

import argparse

import torch

from bench_large_m import _quantize, bf16_chain_ms, dense_chain, distinct_linears, route_chain_ms
from bench_shapes import graph_replay
from common import bench_ms, table, write_result

import surogate_hf.kernels  # noqa: F401
from surogate_hf.kernels import ext
from surogate_hf.ops import ext as E


def row_chunk(ops, block, n0, n1, n, k):
    """ext_dequantize's operands of weight rows [n0, n1): contiguous slices of the codes and the scales."""
    w, s, g, levels, fmt = ops
    if fmt in (0, 1):  # [N, K/2] codes, [N, K/block] scales
        return (w[n0:n1], s[n0:n1], g, levels, fmt)
    # nf4: flat codes and one fp32 absmax per `block` elements of the flattened weight
    assert (n0 * k) % block == 0 and (n1 * k) % block == 0
    flat = w.reshape(-1)
    return (flat[n0 * k // 2:n1 * k // 2], s[n0 * k // block:n1 * k // block], g, levels, fmt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Llama-3.1-8B,Qwen3-1.7B")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--formats", default="nvfp4,nf4")
    ap.add_argument("--chunks", default="1024,2048,4096")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="probe_chunked_route")
    ap.add_argument("--dgrad", action="store_true", help="time the input gradient dx = dy W instead, chunked by "
                    "column slabs of W (each slab quantized as its own weight: the timing a strided decode would give)")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    if args.dgrad:
        return dgrad_probe(args)
    heights = [int(c) for c in args.chunks.split(",")]
    rows = []
    for model, proj, k, n in distinct_linears(args.models):
        dense = dense_chain(n, k, args.chain)
        quant = {f: [_quantize(w, f)["dense"] for w in dense] for f in args.formats.split(",")}
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            t_bf16 = bf16_chain_ms(x, dense)
            for f, ws in quant.items():
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                t_route = route_chain_ms(x, ws, n, k, outs)
                ref = [y.clone() for y in outs]
                decoded = [E.ext_dequantize(*ops, n, k, block, torch.bfloat16) for ops, block in ws]

                def gemm(decoded=decoded):
                    for w in decoded:
                        torch.nn.functional.linear(x, w)

                t_gemm = bench_ms(graph_replay(gemm)) / args.chain
                del decoded
                row = [f"{k}->{n}", f"{model} {proj}", m, f, t_bf16, t_gemm, t_route, t_bf16 / t_route]
                for h in heights:
                    if h >= n:
                        row += [float("nan"), float("nan"), ""]
                        continue
                    bounds = [(n0, min(n, n0 + h)) for n0 in range(0, n, h)]
                    chunks = [[row_chunk(ops, block, n0, n1, n, k) + (block,) for n0, n1 in bounds]
                              for ops, block in ws]

                    def chunked(chunks=chunks, outs=outs, bounds=bounds):
                        for parts, y in zip(chunks, outs):
                            for (n0, n1), (*ops, block) in zip(bounds, parts):
                                wc = E.ext_dequantize(*ops, n1 - n0, k, block, torch.bfloat16)
                                torch.mm(x, wc.t(), out=y[:, n0:n1])

                    for y in outs:
                        y.zero_()
                    chunked()
                    same = all(torch.equal(a, b) for a, b in zip(outs, ref))
                    t = bench_ms(graph_replay(chunked)) / args.chain
                    row += [t, t_bf16 / t, "equal" if same else "DIFFERS"]
                rows.append(row)
                print(row, flush=True)
        del dense, quant
        torch.cuda.empty_cache()
    head = ["shape (in->out)", "linear", "M", "format", "bf16 ms", "GEMM on decoded ms", "route ms", "route x bf16"]
    for h in heights:
        head += [f"chunk {h} ms", f"chunk {h} x bf16", f"chunk {h} bits"]
    write_result(args.name, "Probe: the decode route chunked by output rows (L2-resident bf16 chunks)", table(head, rows))


def dgrad_probe(args):
    """dx [M, k] = dy [M, n] W [n, k]: the route (whole W decoded, then mm) against column slabs of W decoded and
    multiplied one after the other into dx[:, k0:k1]."""
    widths = [int(c) for c in args.chunks.split(",")]
    rows = []
    for model, proj, k, n in distinct_linears(args.models):
        dense = dense_chain(n, k, args.chain)
        for f in args.formats.split(","):
            whole = [_quantize(w, f)["dense"] for w in dense]
            slabs = {c: [[_quantize(w[:, k0:k0 + c].contiguous(), f)["dense"] for k0 in range(0, k, c)] for w in dense]
                     for c in widths if c < k}
            for m in (int(t) for t in args.tokens.split(",")):
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in dense]

                def bf16(dense=dense, outs=outs):
                    for w, dx in zip(dense, outs):
                        torch.mm(dy, w, out=dx)

                def route(ws=whole, outs=outs):
                    for (ops, block), dx in zip(ws, outs):
                        torch.mm(dy, E.ext_dequantize(*ops, n, k, block, torch.bfloat16), out=dx)

                t_bf16 = bench_ms(graph_replay(bf16)) / args.chain
                t_route = bench_ms(graph_replay(route)) / args.chain
                row = [f"{k}->{n}", f"{model} {proj}", m, f, t_bf16, t_route, t_bf16 / t_route]
                for c in widths:
                    if c not in slabs:
                        row += [float("nan"), float("nan")]
                        continue

                    def chunked(parts=slabs[c], outs=outs, c=c):
                        for ps, dx in zip(parts, outs):
                            for i, (ops, block) in enumerate(ps):
                                k0 = i * c
                                k1 = min(k, k0 + c)
                                torch.mm(dy, E.ext_dequantize(*ops, n, k1 - k0, block, torch.bfloat16),
                                         out=dx[:, k0:k1])

                    t = bench_ms(graph_replay(chunked)) / args.chain
                    row += [t, t_bf16 / t]
                rows.append(row)
                print(row, flush=True)
            del whole, slabs
        del dense
        torch.cuda.empty_cache()
    head = ["shape (in->out)", "linear", "M", "format", "bf16 ms", "route ms", "route x bf16"]
    for c in widths:
        head += [f"slab {c} ms", f"slab {c} x bf16"]
    write_result(args.name + "_dgrad", "Probe: the input gradient's decode route chunked by column slabs of W",
                 table(head, rows))


if __name__ == "__main__":
    main()
