"""A train.py for `accelerate launch`: it never names a recipe; the launcher (or the model's recorded one) picks it.

    surogate-hf launch --recipe fp8-hybrid --recipe_knobs '{"margin": 0}' \
        --config_file examples/recipe_launch_cpu.yaml examples/recipe_launch_train.py
    surogate-hf launch --recipe_config examples/recipe_fp8.yaml \
        --config_file examples/recipe_launch_cpu.yaml examples/recipe_launch_train.py

Started by plain `accelerate launch` (no launcher recipe) the callback does nothing and this is ordinary training.
"""

import torch
from recipe_loss_curves import synthetic_batch, tiny_llama
from transformers import Trainer, TrainingArguments

from surogate_hf.integrations.trainer import SurogateRecipeCallback


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n=256):
        self.rows = synthetic_batch(0, batch=n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


args = TrainingArguments(output_dir="/tmp/surogate_recipe_launch", max_steps=20, per_device_train_batch_size=8,
                         learning_rate=3e-3, logging_steps=5, report_to=[], save_strategy="no")
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Synthetic(), callbacks=[SurogateRecipeCallback()])
trainer.train()
print("recipe:", getattr(trainer.model, "surogate_recipe", None))
