"""Profile of end-to-end training steps (bench_e2e.py and bench_lora_dtype.py setups): wall time, GPU kernel
time and CPU time per step, GPU time by kernel category, and the top kernels. A wall time well above the GPU
kernel time means the step is bound by host-side work (Python, dispatch, launches), not by the GPU."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import bench_e2e as E
import bench_lora_dtype as LD
from common import time_train_steps, train_step_fn

# (category, regex on the kernel name), first match wins
CATEGORIES = [
    ("attention", r"flash|fmha|attention|sdpa"),
    ("nvfp4 operands + epilogue", r"qdq_kernel|amax_kernel|nvfp4|rht|scale_bias_cast"),
    ("fp8 gemm", r"qqtst|f8f8|e4m3.*gemm"),  # cuBLASLt's FP8 kernels (nvjet_sm90_qqtst...)
    ("fp8 quantize", r"quantize|fp8|cast_amax|cast_transpose|transpose_bytes"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas|splitK|matmul"),
    ("cross-entropy/softmax", r"softmax|nll|cross_entropy|log_softmax"),
    ("triton (ours)", r"^_|triton"),
    ("optimizer", r"adam|multi_tensor"),
    ("copy/cast", r"copy|cast|convert|to_copy"),
    ("reduce", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]

EXTRA = {
    "lora_stock": ("0.6B fp8 base, stock PEFT lora.Linear (fp32)", lambda L: LD.build("fp8", False, L)[0]),
    "lora_ours": ("0.6B fp8 base, surogate LoRA lora_dtype fp32", lambda L: LD.build("fp8", True, L)[0]),
}


def categorize(name: str) -> str:
    low = name.lower()
    for cat, rx in CATEGORIES:
        if re.search(rx, low):
            return cat
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16,ours_fp8")
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(E.SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--recipe-knobs", default="{}", help="JSON knobs for apply_recipe (bench_e2e.py's flag)")
    ap.add_argument("--kernels-json", default=None,
                    help="also write every GPU kernel's calls and time per step here, per setup (to diff two setups)")
    args = ap.parse_args()
    kernels = {}
    E.SHAPE = args.shape
    E.RECIPE_KNOBS.update(json.loads(args.recipe_knobs))
    layers = args.layers or E.SHAPES[args.shape][6]
    for key in args.setups.split(","):
        label, build = EXTRA[key] if key in EXTRA else E.SETUPS[key][:2]
        vocab = E.SHAPES[args.shape][5]
        model = build(layers)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        ids = torch.randint(0, vocab, (args.batch, 2048), device="cuda")

        step = train_step_fn(model, ids, opt)
        wall_plain = time_train_steps(step, 2, 3)[0] / 3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        ka = p.key_averages()
        gpu = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) / 2e3
        cpu = sum(e.self_cpu_time_total for e in ka) / 2e3
        cats, counts = defaultdict(float), defaultdict(int)
        for e in ka:
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
                c = categorize(e.key)
                cats[c] += e.self_device_time_total / 2e3
                counts[c] += e.count // 2
        print(f"\n### {label}: wall {wall_plain * 1e3:.1f} ms/step (unprofiled), GPU kernels {gpu:.1f} ms/step, "
              f"CPU self {cpu:.1f} ms/step\n")
        print("| category | GPU ms/step | kernels/step |\n|---|---|---|")
        for c, v in sorted(cats.items(), key=lambda kv: -kv[1]):
            print(f"| {c} | {v:.1f} | {counts[c]} |")
        n_launch = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                           "cuLaunchKernelEx")) // 2
        print(f"\nkernel launches/step: {n_launch}\n")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
        kernels[key] = {"wall_ms": wall_plain * 1e3, "gpu_ms": gpu, "kernels": {
            e.key: {"calls": e.count / 2, "us": e.self_device_time_total / 2}
            for e in ka if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0}}
        del model, opt, params
        torch.cuda.empty_cache()
    if args.kernels_json:
        with open(args.kernels_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "layers": layers,
                       "setups": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
