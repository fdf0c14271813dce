"""Host time per decoder layer of a training step (CUDA): where a small model's step, bound by the host, spends it.

Each setup of bench_e2e.py is built twice, with `--few` and `--many` decoder layers, and stepped on one short
sequence (`--tokens`, at least the decode route's 512 tokens), so the GPU finishes each kernel before the host
issues the next one. (wall(many) - wall(few)) / (many - few) is then the host time one layer adds to a step:
its forward, backward and optimizer share, through whatever path the setup takes (eager modules, or dynamo's
guards, AOTAutograd's wrappers and inductor's wrapper code of a compiled layer). Median of `--rounds` blocks of
`--steps` steps. Written to results/host_layers.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bench_e2e as E
from common import table, train_step_fn, write_result


def step_ms(key: str, layers: int, tokens: int, steps: int, rounds: int) -> float:
    model = E.SETUPS[key][1](layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    ids = torch.randint(0, E.SHAPES[E.SHAPE][5], (1, tokens), device="cuda")
    step = train_step_fn(model, ids, opt)
    for _ in range(4):
        step()
    blocks = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        blocks.append((time.perf_counter() - t0) / steps * 1e3)
    del model, opt, params, step
    torch.cuda.empty_cache()
    return statistics.median(blocks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16,ours_nvfp4,peft_bf16_compiled,ours_nvfp4_compiled")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(E.SHAPES))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--few", type=int, default=2)
    ap.add_argument("--many", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="host_layers")
    args = ap.parse_args()
    E.SHAPE = args.shape
    rows, base = [], {}
    for key in args.setups.split(","):
        few = step_ms(key, args.few, args.tokens, args.steps, args.rounds)
        many = step_ms(key, args.many, args.tokens, args.steps, args.rounds)
        per_layer = (many - few) / (args.many - args.few) * 1e3
        peer = "peft_bf16_compiled" if key.endswith("_compiled") else "peft_bf16"
        base.setdefault(key, per_layer)
        note = (f"{base[peer] / per_layer:.2f}x {peer}'s host time per layer" if peer in base and key != peer else "")
        rows.append([E.SETUPS[key][0], f"{few:.2f}", f"{many:.2f}", f"{per_layer:.0f}", note])
        print(rows[-1], flush=True)
    body = (f"{args.shape} shape, 1 x {args.tokens} tokens, AdamW (fused); median of {args.rounds} blocks of "
            f"{args.steps} steps; host us per layer = (step({args.many} layers) - step({args.few} layers)) / "
            f"{args.many - args.few}\n\n")
    body += table(["setup", f"ms/step, {args.few} layers", f"ms/step, {args.many} layers", "host us per layer",
                   "note"], rows)
    write_result(args.name, "Host time per decoder layer of a training step", body)


if __name__ == "__main__":
    main()
