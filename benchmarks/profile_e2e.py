"""Profile of end-to-end training steps (bench_e2e.py setups): top GPU kernels by CUDA time, GPU busy
time vs wall time (a large gap means the step is bound by CPU-side launches, not the GPU)."""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_e2e as E


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16,ours_fp8,full_fp8")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    for key in args.setups.split(","):
        model = E.SETUPS[key][1](args.layers)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        ids = torch.randint(0, 151936, (4, 2048), device="cuda")

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            t0 = time.perf_counter()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 2
        ka = p.key_averages()
        gpu = sum(e.self_device_time_total for e in ka) / 2 / 1e3
        print(f"\n### {E.SETUPS[key][0]}: wall {wall * 1e3:.1f} ms/step, GPU kernel time {gpu:.1f} ms/step\n")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        del model, opt, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
