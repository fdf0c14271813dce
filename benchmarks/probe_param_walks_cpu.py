"""Probe, on a CPU: the HF Trainer's walks over a QLoRA model's parameters, per setup, without a GPU.

Every Trainer step walks the model's parameters three times on the host: the FLOPs count
(`model.num_parameters(exclude_embeddings=True)`, named_modules + named_parameters), the clip
(`clip_grad_norm_(model.parameters())`) and `model.zero_grad()`. Through the Trainer, which waits for the GPU every
step, that host time is exposed. Our quantized linears hold each slot (codes, scales, NF4's tables) as a frozen
Parameter (FSDP2 shards only parameters), so a format with more slots walks more parameters than PEFT's one weight a
linear. This builds the model of a shape (LlamaForCausalLM from SmolLM2-135M's config, random weights, the target
linears converted, PEFT LoRA r=8, the adapters' grads set) and times each walk (best of repeats).
    python benchmarks/probe_param_walks_cpu.py --setups peft,nf4,mxfp4,nvfp4,fp8
"""

from __future__ import annotations

import argparse
import time

import torch

from common import table, write_result
from probe_guard_time_cpu import build


def _best_ms(fn, repeats: int, inner: int = 10) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def probe(setup: str, layers: int, repeats: int) -> dict:
    model = build(setup, layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)

    def zero_grad():
        model.zero_grad()
        for p in trainable:  # (set_to_none: give the clip and the next zero_grad grads to see again)
            p.grad = torch.zeros_like(p)

    refill = _best_ms(lambda: [setattr(p, "grad", torch.zeros_like(p)) for p in trainable], repeats)
    return {
        "params": sum(1 for _ in model.parameters()),
        "num_parameters": _best_ms(lambda: model.num_parameters(exclude_embeddings=True), repeats),
        "clip": _best_ms(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), repeats),
        "zero_grad": _best_ms(zero_grad, repeats) - refill,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="peft,nf4,mxfp4,nvfp4,fp8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--name", default=None, help="write results/<name>.md")
    a = ap.parse_args()
    rows, base = [], None
    for setup in a.setups.split(","):
        got = probe(setup, a.layers, a.repeats)
        total = got["num_parameters"] + got["clip"] + got["zero_grad"]
        base = total if setup == "peft" else base
        rows.append([setup, got["params"], got["num_parameters"], got["clip"], got["zero_grad"], total,
                     f"{total - base:+.2f}" if base is not None else "-"])
        print(setup, got, flush=True)
    body = table(["setup", "parameters", "num_parameters ms", "clip ms", "zero_grad ms", "the three ms",
                  "vs PEFT ms"], rows)
    print(body)
    if a.name:
        write_result(a.name, "The Trainer's per-step parameter walks over a QLoRA model (CPU)",
                     f"SmolLM2-135M linears, {a.layers} layers, PEFT LoRA r=8; each walk timed alone, best of "
                     f"{a.repeats} x 10.\n\n" + body)


if __name__ == "__main__":
    main()
