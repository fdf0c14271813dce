"""How fast can a weight-only GEMM at a few tokens be? The bytes it must read, read and nothing else, against bf16
cuBLAS and our route, on the linears of real models, side by side in one process (GPU machine).

At <= 64 tokens a weight-only GEMM has to stream its weight once: the packed codes and their scales. A kernel that
only reads those bytes (XOR-reduces them into one word per program, so nothing is optimized away) bounds what such a
GEMM can take, launch and DRAM latency included, and bf16 cuBLAS's time over that read's time bounds the "x bf16" a
4-bit kernel can reach at that shape (the issue 13 target is 1.5x at M <= 64). The same read of the bf16 weight checks
the read kernel itself: where cuBLAS is faster than it, it is no floor. (A faster read kernel would only raise the
ceiling: one of at least 1.5x says the target is within reach, not that it is the limit.)

Timing as bench_large_m.py: a CUDA graph replay of CHAIN distinct weights of the shape back to back (together larger
than L2, as a model's layers are), L2 flushed between replays, per call.
    python benchmarks/bench_read_floor.py --models Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M --tokens 1,8,16,32,64
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench_large_m import _quantize, bf16_chain_ms, dense_chain, distinct_linears
from bench_shapes import graph_replay
from common import bench_ms, table, write_result

import surogate_hf.kernels  # noqa: F401
from surogate_hf.kernels import ext
from surogate_hf.ops import ext as E

_BLOCK = 1024  # 32-bit words a program loads per iteration: 4 KiB, 32 bytes a thread at 4 warps


@triton.jit
def _read_kernel(a_ptr, a_words, b_ptr, b_words, out_ptr, a_programs, per_program, BLOCK: tl.constexpr):
    """Programs [0, a_programs) read a (per_program words each), the rest read b; each XORs its words into one."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if pid < a_programs:
        start = pid * per_program
        for off in range(start, start + per_program, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            acc ^= tl.load(a_ptr + offs, mask=offs < a_words, other=0, cache_modifier=".cg")
    else:
        start = (pid - a_programs) * per_program
        for off in range(start, start + per_program, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            acc ^= tl.load(b_ptr + offs, mask=offs < b_words, other=0, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as int32 words (zero-padded to a whole word: a copy only where the byte count is not a multiple of
    4, which no shapes-table weight has)."""
    b = t.detach().contiguous().view(torch.uint8).reshape(-1)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return b.view(torch.int32)


class ReadAll:
    """One launch that reads every byte of tensors a and b (b may be None): about 8 programs per SM, each a run of
    whole 4 KiB iterations, split between a and b by their sizes."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor | None, sms: int):
        self.a = _words(a)
        self.b = _words(b) if b is not None else self.a[:0]
        total = self.a.numel() + self.b.numel()
        programs = max(1, min(8 * sms, -(-total // _BLOCK)))
        self.per = -(-total // programs // _BLOCK) * _BLOCK  # words a program, whole iterations
        self.a_programs = -(-self.a.numel() // self.per)
        self.programs = self.a_programs + -(-self.b.numel() // self.per)
        self.out = torch.empty(self.programs, dtype=torch.int32, device=self.a.device)

    def __call__(self):
        b = self.b if self.b.numel() else self.a
        _read_kernel[(self.programs,)](self.a, self.a.numel(), b, self.b.numel(), self.out, self.a_programs, self.per,
                                       BLOCK=_BLOCK, num_warps=4)


def chain_ms(fns) -> float:
    def run():
        for f in fns:
            f()

    return bench_ms(graph_replay(run)) / len(fns)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M")
    ap.add_argument("--tokens", default="1,8,16,32,64")
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--name", default="read_floor")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = [int(t) for t in args.tokens.split(",")]
    assert all(1 <= m <= 64 for m in tokens), "the read floor bounds GEMMs of <= 64 tokens (memory-bound ones)"
    rows = []
    for model, proj, k, n in distinct_linears(args.models):
        dense = dense_chain(n, k, args.chain)
        t_read_bf16 = chain_ms([ReadAll(w, None, sms) for w in dense])
        for f in args.formats.split(","):
            qs = [_quantize(w, f) for w in dense]
            # the bytes the kernels read: codes and per-block scales (NF4: the de-nested fp32 absmax the few-token
            # kernel reads; NVFP4's global is one word)
            t_read_q = chain_ms([ReadAll(q["dense"][0][0], q["dense"][0][1], sms) for q in qs])
            q_bytes = sum(t.numel() * t.element_size() for t in qs[0]["dense"][0][:2])
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_bf16 = bf16_chain_ms(x, dense)

                def few_token(qs=qs, x=x):
                    for q in qs:
                        ops, block = q["dense"]
                        E.ext_few_token_gemm(x, *ops, n, k, block)

                t_route = bench_ms(graph_replay(few_token)) / args.chain
                ceiling = t_bf16 / t_read_q
                rows.append([f"{k}->{n}", f"{model} {proj}", m, f, f"{q_bytes / 2**20:.2f}", t_bf16, t_read_bf16,
                             t_read_q, t_route, t_bf16 / t_route, ceiling, (t_bf16 / t_route) / ceiling,
                             "yes" if ceiling >= 1.5 else "no"])
                print(rows[-1], flush=True)
            del qs
        del dense
        torch.cuda.empty_cache()
    body = table(["shape (in->out)", "linear", "M", "format", "4-bit bytes MiB", "bf16 cuBLAS ms",
                  "bf16 weight read ms", "4-bit read ms", "route ms", "route x bf16",
                  "ceiling x bf16 (bf16 / 4-bit read)", "route / ceiling", "1.5x reachable"], rows)
    body += ("\n4-bit read: one kernel that reads the weight's codes and scales and nothing else (no x, no output, no "
             "decode): the least time a weight-only GEMM at these token counts can take. ceiling: bf16 cuBLAS's time "
             "over it, the highest x bf16 any such kernel can reach. bf16 weight read: the same read of the bf16 "
             "weight, against which bf16 cuBLAS's own time shows how close cuBLAS runs to that floor. route: the "
             "few-token op (ext_few_token_gemm), what a module's forward runs at these token counts.\n")
    write_result(args.name, "Weight-only GEMM at <= 64 tokens: the weight-read floor against bf16 cuBLAS and our route",
                 body)


if __name__ == "__main__":
    main()
