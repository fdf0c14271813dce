"""Recipes with the HF Trainer: one callback next to TrainingArguments, no Trainer subclass.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SurogateRecipeCallback("fp8-hybrid", margin=0)])

`SurogateRecipeCallback()` without a recipe takes the one the launcher started the process with
(`surogate-hf launch --recipe nvfp4 --config_file cfg.yaml train.py`, read by
surogate_hf.recipes.recipe_from_launcher), else the one recorded in the model's config (apply_recipe
writes `config.surogate_recipe`, so a checkpoint trained with a recipe carries it); with neither the
callback does nothing, i.e. plain training. An explicit recipe always wins.

With the nvfp4 recipe's `fp4_high_precision_tail` knob, `on_step_begin` switches the nvfp4 GEMMs named by
`fp4_high_precision_passes` to model_dtype for the last share of `max_steps` (recipes.switch), again after a resume.

The recipe is applied in `on_init_end`, which the Trainer calls at the end of __init__ with the
model, before it builds its optimizer and before accelerator.prepare. Recipe state (amax
histories, scales, stochastic-rounding counters) are buffers, so Trainer checkpoints carry them
and resume_from_checkpoint restores them.
"""

from __future__ import annotations

from transformers import TrainerCallback

from ..recipes import apply_recipe, as_recipe_config, recipe_from_launcher, recorded_recipe, schedule_precision


class SurogateRecipeCallback(TrainerCallback):
    def __init__(self, recipe=None, **knobs):
        if recipe is None and knobs:
            raise ValueError(f"SurogateRecipeCallback: knobs {sorted(knobs)} given without a recipe")
        # explicit, else the launcher's; the model's own record is looked at in on_init_end
        self.config = as_recipe_config(recipe, **knobs) if recipe is not None else recipe_from_launcher()

    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.config is None and model is not None:
            self.config = recorded_recipe(model)
        if self.config is None:
            return
        if model is None:
            raise RuntimeError("SurogateRecipeCallback: the Trainer passed no model to on_init_end")
        if args.fp16:
            raise ValueError("TrainingArguments(fp16=True) cannot run a surogate_hf recipe; use bf16=True or neither")
        if optimizer is not None:
            # An optimizer built before the recipe still holds the same Parameters, but its state
            # would have been created for the old dtypes; refuse rather than train on mixed state.
            if any(len(s) for s in optimizer.state.values()):
                raise ValueError("SurogateRecipeCallback: the optimizer passed to Trainer already has state")
        applied = getattr(model, "surogate_recipe", None)
        if applied is not None:
            wanted = self.config if self.config.model_dtype else self.config.with_model_dtype(applied.model_dtype)
            if wanted != applied:
                raise ValueError(f"the model already has a different recipe applied ({applied}); the callback asks for {wanted}")
            return
        apply_recipe(model, self.config)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Trainer(model_init=...) builds a fresh model inside train(), after on_init_end: it would
        # train without the recipe, so refuse instead of silently running plain precision.
        if self.config is not None and model is not None and getattr(model, "surogate_recipe", None) is None:
            raise RuntimeError(
                "SurogateRecipeCallback: the model being trained has no recipe applied (Trainer(model_init=...) "
                "replaces the model after on_init_end); call surogate_hf.recipes.apply_recipe inside model_init"
            )

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        # the nvfp4 recipe's precision switch (recipes.switch) over the last fp4_high_precision_tail of max_steps;
        # a resumed run past the switch step switches again here
        if self.config is not None and self.config.resolved_high_precision_tail() and model is not None:
            schedule_precision(model, state.global_step, state.max_steps)
