"""Plain accelerate: apply the recipe, keep Accelerator in "bf16" (GPU) or "no", train.

    python examples/recipe_accelerate.py --recipe fp8-hybrid --steps 30
"""

import argparse

import torch
from accelerate import Accelerator
from recipe_loss_curves import synthetic_batch, tiny_llama

from surogate_hf.recipes import apply_recipe, schedule_precision

ap = argparse.ArgumentParser()
ap.add_argument("--recipe", default="fp8-hybrid", choices=["bf16", "fp8-hybrid", "nvfp4"])
ap.add_argument("--steps", type=int, default=30)
args = ap.parse_args()

model = tiny_llama()
# fp32 masters, bf16 work weights and activations; the recipe's GEMMs inside the linears
model = apply_recipe(model, args.recipe, model_dtype="bf16", master_dtype="fp32")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after apply_recipe
accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
model, optimizer = accelerator.prepare(model, optimizer)

for step in range(args.steps):
    # nvfp4: the recipe's precision switch, the last 30% of the steps with the forward in bf16 (a no-op otherwise)
    schedule_precision(model, step, args.steps)
    ids = synthetic_batch(step).to(accelerator.device)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0 or step == args.steps - 1:
        accelerator.print(f"step {step:4d}  loss {loss.item():.4f}")
