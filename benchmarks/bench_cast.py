"""GPU time of the eager fp8 recipe's per-tensor cast (+ transpose + amax) on real linear shapes: the csrc kernel
(kernels.fp8_cast, `surogate::ext_fp8_cast_transpose_amax`) next to the Triton kernel it replaces, and the
effective bandwidth (bytes read + written per second, TB/s). Needs the extension built
(`python -m surogate_hf.kernels.build`). Writes results/fp8_cast.md.
"""

from __future__ import annotations

import argparse

import torch

from common import bench_ms, table, write_result

# (tokens, width): activations and gradients of SmolLM2-135M (576, 1536), Qwen3-1.7B (2048, 6144), Gemma-3-1B (1152),
# GPT-OSS (2880) at the batch sizes bench_e2e trains
SHAPES = [(16384, 576), (16384, 1536), (8192, 2048), (8192, 6144), (8192, 1152), (8192, 2880), (333, 960)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from surogate_hf.kernels import ext, fp8_cast
    from surogate_hf.kernels import triton_recipe as TR

    if ext.load(build=False) is None:
        raise SystemExit(f"the extension is {ext.status()[1]}")
    dt = getattr(torch, args.dtype)
    rows = []
    for transpose in (True, False):
        for r, c in SHAPES:
            x = torch.randn(r, c, device="cuda", dtype=dt)
            scale = torch.ones(1, device="cuda")
            bits = torch.zeros(1, device="cuda", dtype=torch.int32)
            moved = r * c * (x.element_size() + (2 if transpose else 1))
            t_ext = bench_ms(lambda: fp8_cast.cast_fp8_into(x, scale, bits, torch.float8_e4m3fn, transpose))
            t_tri = bench_ms(lambda: TR.cast_fp8_into(x, scale, bits, torch.float8_e4m3fn, transpose))
            rows.append([f"{r}x{c}", "yes" if transpose else "no", t_ext * 1e3, moved / t_ext / 1e9,
                         t_tri * 1e3, moved / t_tri / 1e9, t_tri / t_ext])
            print(rows[-1], flush=True)
    body = (f"x {args.dtype}, E4M3, GPU time per call (median, CUDA events)\n\n"
            + table(["shape", "transpose", "csrc us", "csrc TB/s", "Triton us", "Triton TB/s", "Triton / csrc"], rows))
    write_result("fp8_cast", "Eager fp8 cast: csrc vs Triton", body)


if __name__ == "__main__":
    main()
