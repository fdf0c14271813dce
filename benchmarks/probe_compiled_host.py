"""Probe: what a compiled small-model QLoRA step does on the host that PEFT's does not.

For each bench_e2e setup (compiled decoder layers), on the shape's config cut to a few layers: dynamo's counters after
the warm-up (graph breaks and their reasons, unique graphs, frames), then torch.profiler (CPU activities only) over
a few steps: the number of compiled-region entries per step, and the ops by host self time per step. The difference
between two setups' tables is the host work one adds. --guards: also the share of dynamo's guard evaluation, by
timing steps with torch.compiler.set_stance(skip_guard_eval_unsafe=True) (only the guards that tell cache entries
apart are checked) against normal steps, alternating, in one process.
    python benchmarks/probe_compiled_host.py --shape smollm2-135m --layers 4 \
        --setups peft_bf16_compiled,ours_mxfp4_compiled,ours_nf4_compiled
The whole model compiled (`_compiled_model` setups; --use-cache: transformers' default use_cache=True, which lets a
whole-model graph skip SDPA's causal mask, see bench_e2e.USE_CACHE):
    python benchmarks/probe_compiled_host.py --shape smollm2-135m --layers 30 --use-cache \
        --setups peft_bf16_compiled_model,ours_mxfp4_compiled_model,ours_nf4_compiled_model
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch

import bench_e2e as E
from probe_host_step import plain_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16_compiled,ours_mxfp4_compiled,ours_nf4_compiled")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(E.SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--guards", action="store_true", help="time steps without full guard evaluation too")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cuda-activity", action="store_true",
                    help="profile CUDA activity too: the table then lists the CUDA runtime / driver calls (kernel "
                         "launches and their host time) beside the ops")
    E.add_attention_mask_args(ap)
    args = ap.parse_args()
    E.SHAPE = args.shape
    E.apply_attention_mask_args(args)
    from torch._dynamo.utils import counters

    for key in args.setups.split(","):
        label, build = E.SETUPS[key][:2]
        counters.clear()
        model = build(args.layers)
        E.causal_mask_policy()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        ids = torch.randint(0, E.SHAPES[args.shape][5], (args.batch, args.seq), device="cuda")
        step = plain_step(model, ids, opt)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"=== {key}: {label}")
        print("  graph breaks:", sum(counters["graph_break"].values()))
        for reason, n in list(counters["graph_break"].items())[:10]:
            print(f"    {n} x {reason[:300]}")
        print("  stats:", dict(counters["stats"]))
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        if args.guards:
            timed = {False: [], True: []}
            for _ in range(3):
                for skip in (False, True):
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            step()
                        torch.cuda.synchronize()
                    timed[skip].append((time.perf_counter() - t0) / args.steps * 1e3)
            full, skipped = min(timed[False]), min(timed[True])
            print(
                f"  guards: {full:.2f} ms/step with full guard evaluation, {skipped:.2f} without "
                f"(best of 3 alternating blocks of {args.steps} steps): {full - skipped:.2f} ms/step, "
                f"{(full - skipped) / args.layers * 1e3:.0f} us per decoder layer"
            )
        if args.no_profile:
            del model, opt, params, step
            gc.collect()
            torch.cuda.empty_cache()
            continue
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.cuda_activity:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        self_us = collections.Counter()
        calls = collections.Counter()
        for ev in events:
            self_us[ev.key] += ev.self_cpu_time_total
            calls[ev.key] += ev.count
        total = sum(self_us.values()) / args.steps
        print(f"  wall {wall * 1e3:.2f} ms/step unprofiled; profiled host self time {total / 1e3:.2f} ms/step")
        print(f"  {'op':70s} {'calls/step':>10s} {'self us/step':>12s} {'us/call':>8s}")
        for name, us in self_us.most_common(args.rows):
            c = calls[name] / args.steps
            print(f"  {name[:70]:70s} {c:10.1f} {us / args.steps:12.1f} {us / max(calls[name], 1):8.2f}")
        del model, opt, params, step
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
