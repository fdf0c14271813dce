"""Run-to-run equality of the weight-only few-token paths under repetition (diagnostic, GPU machine): each op called
REPEAT times on one input must give the same bits every time. The mma few-token kernel and the register-operand
kernel's K-split variant (through the few-token op from 33 tokens on large weights, 17 on wide ones, and called
directly, ext_mixed_input_gemm, at any token count) sum fixed K ranges in a fixed order, so any difference is a
race. Prints the mismatching calls per (path, format, shape, tokens).
    python benchmarks/stress_determinism.py --repeat 50
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_large_m import _quantize  # noqa: E402

import surogate_hf.kernels  # noqa: F401,E402
from surogate_hf.kernels import ext  # noqa: E402
from surogate_hf.ops import ext as E  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--shapes", default="1536x8960,4096x14336,14336x4096,4096x4096,2048x1024")
    ap.add_argument("--tokens", default="17,33,39,40,48,64")
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4")
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    bad_total = 0
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt in args.formats.split(","):
            q = _quantize(w, fmt)
            ops, block = q["dense"]
            for m in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                calls = {}
                if m <= 64:  # (the few-token op's range)
                    calls["few_token_op"] = lambda: E.ext_few_token_gemm(x, *ops, n, k, block)
                calls["rs_k_split"] = lambda: E.ext_mixed_input_gemm(x, *q["mixed"][0], n, k, q["mixed"][1],
                                                                     *q["mixed"][2])
                for path, call in calls.items():
                    first = call()
                    bad = sum(not torch.equal(first, call()) for _ in range(args.repeat))
                    bad_total += bad
                    print(f"{path:13s} {fmt} [{n}, {k}] M={m}: {bad} of {args.repeat} calls differ", flush=True)
    print("TOTAL mismatching calls:", bad_total)
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
