"""Probe: does the decode's bf16 write stay in L2 when every chunk of rows is decoded into the same scratch buffer?

The route (decode the whole weight to bf16, then cuBLAS) writes 2 bytes per element to DRAM that the GEMM reads back:
at 2048 tokens that is ~15% of a 4096x4096 GEMM on the H100, the gap to the issue's 0.9x. If a chunk of rows decoded
into a buffer that the previous chunk's GEMM just read (same addresses, lines still in L2) overwrote those lines in
L2 instead of going to DRAM, the decode would cost its 0.56 bytes of codes per element only.

Side by side in one process, CUDA graph replays of CHAIN distinct layers (their codes exceed L2), per layer:
  dec_full     decode of the whole weight (the route's)
  dec_same_h   the weight decoded in chunks of h rows, every chunk into one scratch buffer
  dec_dist_h   the same chunks into distinct buffers
  gemm_h       the chunks' GEMMs alone (into y[:, n0:n1]), on chunks decoded beforehand
  route_h      decode chunk -> GEMM, one scratch buffer (the route chunked)
and bf16 cuBLAS and the whole-weight route for reference.
    python benchmarks/probe_l2_decode.py --models Llama-3.1-8B,Qwen3-1.7B --tokens 2048
"""

from __future__ import annotations

import argparse

import torch

from bench_large_m import _quantize, bf16_chain_ms, dense_chain, distinct_linears, route_chain_ms
from bench_shapes import graph_replay
from common import bench_ms, table, write_result
from probe_chunked_route import row_chunk

import surogate_hf.kernels  # noqa: F401
from surogate_hf.kernels import ext
from surogate_hf.ops import ext as E


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Llama-3.1-8B,Qwen3-1.7B")
    ap.add_argument("--tokens", default="2048")
    ap.add_argument("--formats", default="nvfp4")
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="probe_l2_decode")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
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

                def dec_full(ws=ws):
                    for ops, block in ws:
                        E.ext_dequantize(*ops, n, k, block, torch.bfloat16)

                t_dec = bench_ms(graph_replay(dec_full)) / args.chain
                t_route = route_chain_ms(x, ws, n, k, outs)
                row = [f"{k}->{n}", f"{model} {proj}", m, f, t_bf16, t_route, t_bf16 / t_route, t_dec]
                for h in heights:
                    if h >= n or n % h:
                        row += [float("nan")] * 5
                        continue
                    bounds = [(n0, n0 + h) for n0 in range(0, n, h)]
                    chunks = [
                        [row_chunk(ops, block, n0, n1, n, k) + (block,) for n0, n1 in bounds] for ops, block in ws
                    ]
                    ptrs = set()

                    def dec_same(chunks=chunks, ptrs=ptrs):
                        # each chunk's buffer is freed before the next is allocated: the (graph) pool hands the same
                        # block back (checked below on the eager calls' addresses)
                        for parts in chunks:
                            for *ops, block in parts:
                                ptrs.add(E.ext_dequantize(*ops, h, k, block, torch.bfloat16).data_ptr())

                    held = []

                    def dec_dist(chunks=chunks, held=held):
                        held.clear()  # every chunk kept alive: distinct addresses
                        for parts in chunks:
                            for *ops, block in parts:
                                held.append(E.ext_dequantize(*ops, h, k, block, torch.bfloat16))

                    def gemm(held=held, outs=outs, bounds=bounds):
                        i = 0
                        for y in outs:
                            for n0, n1 in bounds:
                                torch.mm(x, held[i].t(), out=y[:, n0:n1])
                                i += 1

                    def route_same(chunks=chunks, outs=outs, bounds=bounds):
                        for parts, y in zip(chunks, outs):
                            for (n0, n1), (*ops, block) in zip(bounds, parts):
                                torch.mm(x, E.ext_dequantize(*ops, h, k, block, torch.bfloat16).t(), out=y[:, n0:n1])

                    dec_same()
                    print(
                        f"  {model} {proj} {f} chunk {h}: {len(ptrs)} scratch address(es) in the eager calls",
                        flush=True,
                    )
                    t_same = bench_ms(graph_replay(dec_same)) / args.chain
                    t_dist = bench_ms(graph_replay(dec_dist)) / args.chain
                    dec_dist()
                    saved = list(held)
                    t_gemm = bench_ms(graph_replay(lambda saved=saved: gemm(held=saved))) / args.chain
                    t_rs = bench_ms(graph_replay(route_same)) / args.chain
                    row += [t_same, t_dist, t_gemm, t_rs, t_bf16 / t_rs]
                    del held, saved
                rows.append(row)
                print(row, flush=True)
        del dense, quant
        torch.cuda.empty_cache()
    head = ["shape (in->out)", "linear", "M", "format", "bf16 ms", "route ms", "route x bf16", "decode whole ms"]
    for h in heights:
        head += [f"dec same {h} ms", f"dec distinct {h} ms", f"gemm {h} ms", f"route same {h} ms", f"route {h} x bf16"]
    write_result(args.name, table(head, rows), "Probe: chunked decode into one L2-resident scratch buffer")


if __name__ == "__main__":
    main()
