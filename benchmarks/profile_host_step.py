"""Where the host (Python) time of an eager training step goes: cProfile over a few steps of bench_e2e.py setups,
after warm-up, with the top functions by own time and by cumulative time. The companion of profile_e2e.py (GPU
kernel time): a step whose wall time is well above its GPU time is bound by what this table lists."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import bench_e2e as E
from common import train_step_fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16,ours_nf4")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(E.SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    E.SHAPE = args.shape
    layers = args.layers or E.SHAPES[args.shape][6]
    for key in args.setups.split(","):
        label, build = E.SETUPS[key][:2]
        model = build(layers)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        ids = torch.randint(0, E.SHAPES[args.shape][5], (args.batch, 2048), device="cuda")
        step = train_step_fn(model, ids, opt)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
        print(f"\n### {label} ({args.shape}, {layers} layers): wall {wall * 1e3:.1f} ms/step unprofiled\n")
        for order in ("tottime", "cumtime"):
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.total_tt /= args.steps
            st.sort_stats(order).print_stats(args.rows)
            print(f"#### by {order} (seconds over {args.steps} steps)\n```\n{buf.getvalue().strip()}\n```")
        del model, opt, params, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
