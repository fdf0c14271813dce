"""Train a tiny Llama on CPU with each recipe and print the loss curves (start / end / fp8-vs-bf16 gap).

    python examples/recipe_loss_curves.py --steps 300

The data is a deterministic synthetic language (each token a fixed permutation of the previous one,
with 10% noise), so the loss has somewhere to go; everything is built from a config, nothing is
downloaded. The recipes run as exact emulation on CPU (one warning each says so).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import surogate_hf.recipes as R


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg)


def synthetic_batch(step: int, batch: int = 8, seq: int = 32, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, :2] = torch.randint(0, vocab, (batch, 2), generator=g)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    for t in range(2, seq):
        nxt = perm[ids[:, t - 1]]
        noise = torch.rand(batch, generator=g) < 0.1
        ids[:, t] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=g), nxt)
    return ids


def train(recipe: str, steps: int, lr: float = 3e-3, seed: int = 0, **knobs) -> list[float]:
    """bf16 activations and work weights, fp32 masters (the usual mixed-precision setup)."""
    model = tiny_llama(seed)
    knobs = {"model_dtype": "bf16", "master_dtype": "fp32", **knobs}
    R.apply_recipe(model, recipe, **knobs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        R.schedule_precision(model, step, steps)  # nvfp4's precision switch over the last steps (no-op otherwise)
        ids = synthetic_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def mean(xs):
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default="bf16,fp8-hybrid,nvfp4")
    args = ap.parse_args()
    curves = {}
    for r in args.recipes.split(","):
        t0 = time.time()
        curves[r] = train(r, args.steps)
        c = curves[r]
        print(f"{r:>10}: start {mean(c[:10]):.4f}  end {mean(c[-20:]):.4f}  ({time.time() - t0:.1f}s)")
    if "bf16" in curves:
        for r, c in curves.items():
            if r != "bf16":
                gap = mean(c[-20:]) - mean(curves["bf16"][-20:])
                print(f"{r} - bf16 final-loss gap (mean of last 20 steps): {gap:+.4f}")


if __name__ == "__main__":
    main()
