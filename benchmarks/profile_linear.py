"""Where the time of one fp8-hybrid linear step and one fp8/nvfp4 QLoRA linear step goes (torch.profiler,
GPU kernels sorted by total CUDA time). Diagnostic companion of bench_linear.py / bench_qlora.py."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import bench_linear
from common import layer_step_fn
import bench_qlora

import surogate_hf.kernels  # noqa: F401


def prof(name, m, x, dy, rows=14):
    f = layer_step_fn(m, x, dy)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
    print(f"\n### {name} (5 steps)\n")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def main():
    k, n = 4096, 14336
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8192, n, device="cuda", dtype=torch.bfloat16)
    prof("ours fp8-hybrid RecipeLinear 4096->14336", bench_linear.ours(lin), x, dy)
    for fmt in ("fp8", "nvfp4"):
        m, _ = bench_qlora.ours(lin, fmt)
        prof(f"ours {fmt} QLoRA 4096->14336", m, x, dy)


if __name__ == "__main__":
    main()
