"""HF Trainer: one callback next to TrainingArguments.

    python examples/recipe_trainer.py --recipe nvfp4 --steps 20
    python examples/recipe_trainer.py --recipe fp8-hybrid
"""

import argparse

import torch
from recipe_loss_curves import synthetic_batch, tiny_llama
from transformers import Trainer, TrainingArguments

from surogate_hf.integrations.trainer import SurogateRecipeCallback


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n=512):
        self.rows = synthetic_batch(0, batch=n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


ap = argparse.ArgumentParser()
ap.add_argument("--recipe", default="fp8-hybrid", help="bf16 | fp8-hybrid | nvfp4")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--output_dir", default="/tmp/surogate_recipe_trainer")
args = ap.parse_args()

training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
    logging_steps=10, save_steps=20, report_to=[], bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
)
callback = SurogateRecipeCallback(args.recipe, amax_history_len=16) if args.recipe == "fp8-hybrid" else SurogateRecipeCallback(args.recipe)
trainer = Trainer(model=tiny_llama(), args=training_args, train_dataset=Synthetic(), callbacks=[callback])
trainer.train()  # checkpoints carry the amax histories / SR counters; resume_from_checkpoint restores them
print("recipe:", getattr(trainer.model, "surogate_recipe", None))
