"""One weight-only GEMM call per path, for Nsight Compute (diagnostic companion of bench_large_m.py): bf16 cuBLAS, the
mixed-input kernel, decode + cuBLAS and the few-token op (at most
64 tokens), each run --warmup times
first so that ncu's --launch-skip can pick the last call. Example (GPU machine):
    ncu --kernel-name regex:mixed_input_gemm_rs --launch-skip 3 --launch-count 1 --set full --import-source yes \
        -o rs python3 benchmarks/profile_mixed_input.py --k 4096 --n 4096 --m 8192 --fmt nvfp4
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
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--paths", default="bf16,mixed,dense")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    assert ext.load(build=True) is not None, ext.status()[1]
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    q = _quantize(w, args.fmt)
    calls = {
        "bf16": lambda: torch.nn.functional.linear(x, w),
        "mixed": lambda: E.ext_mixed_input_gemm(x, *q["mixed"][0], args.n, args.k, q["mixed"][1], *q["mixed"][2]),
        "dense": lambda: torch.nn.functional.linear(
            x, E.ext_dequantize(*q["dense"][0], args.n, args.k, q["dense"][1], torch.bfloat16)),
        "few": lambda: E.ext_few_token_gemm(x, *q["dense"][0], args.n, args.k, q["dense"][1]),
    }
    for path in args.paths.split(","):
        for _ in range(args.warmup + 1):
            calls[path]()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
