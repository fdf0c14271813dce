"""Recipes with plain accelerate: apply the recipe to the model, keep Accelerator in "bf16" or "no".

    model = surogate_hf.apply_recipe(model, "fp8-hybrid", margin=0)   # before the optimizer and prepare
    accelerator = Accelerator(mixed_precision="bf16")                  # or "no"
    model, opt, dl = accelerator.prepare(model, opt, dl)

or, in one call that also checks the Accelerator:

    model, opt, dl = surogate_hf.integrations.accelerate.prepare(accelerator, model, opt, dl, recipe="nvfp4")

The recipe lives in surogate_hf's own modules, so accelerate's mixed_precision must not swap or
autocast them: "fp8" would hand every nn.Linear (ours included) to Transformer Engine / torchao,
"fp16" would autocast around bf16 work weights. Both are refused. recipe=None takes the recipe
`surogate-hf launch` started the process with, else the one recorded in the model's config
(apply_recipe's resolution order).
"""

from __future__ import annotations

from ..recipes import apply_recipe

ALLOWED_MIXED_PRECISION = ("no", "bf16")


def check_accelerator(accelerator) -> None:
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp not in ALLOWED_MIXED_PRECISION:
        raise ValueError(
            f"Accelerator(mixed_precision={mp!r}) cannot run a surogate_hf recipe: use mixed_precision='bf16' or "
            "'no' and select the recipe with apply_recipe (mixed_precision='fp8' would replace the recipe's "
            "linears with Transformer Engine / torchao ones, 'fp16' autocasts around the bf16 work weights)"
        )


def prepare(accelerator, model, *objects, recipe=None, **knobs):
    """apply_recipe(model, recipe, **knobs) (unless already applied), check the Accelerator, then
    accelerator.prepare(model, *objects). Build the optimizer on the model before calling: the recipe
    keeps the same Parameter objects, so the optimizer stays valid."""
    check_accelerator(accelerator)
    if getattr(model, "surogate_recipe", None) is None:
        apply_recipe(model, recipe, **knobs)
    elif recipe is not None or knobs:
        raise ValueError("the model already has a recipe applied; drop recipe= / knobs from prepare()")
    return accelerator.prepare(model, *objects)


# ------------------------------------------------------------------ launcher
LAUNCH_USAGE = """usage: python -m surogate_hf.integrations.accelerate [--recipe NAME] [--recipe_knobs JSON]
       [--recipe_config recipe.yaml] <accelerate launch arguments> train.py [script args]

Validates the recipe, exports it as SUROGATE_RECIPE / SUROGATE_RECIPE_KNOBS and runs
`accelerate launch` with the remaining arguments; every launched process inherits the variables.
recipe.yaml holds Surogate-style keys: `recipe: fp8-hybrid` plus knobs (margin, skip_quant_first_layers, ...).
"""


def build_launch(argv):
    """(env additions, command) for the launcher; raises ValueError on a bad recipe before anything runs."""
    import json

    import yaml

    from ..recipes import RecipeConfig

    argv, recipe, knobs, rest = list(argv), None, {}, []
    it = iter(argv)
    for a in it:
        key, eq, val = a.partition("=")
        if key in ("--recipe", "--recipe_knobs", "--recipe_config"):
            val = val if eq else next(it, None)
            if val is None:
                raise ValueError(f"{key} needs a value")
            if key == "--recipe":
                recipe = val
            elif key == "--recipe_knobs":
                knobs.update(json.loads(val))
            else:
                with open(val, encoding="utf-8") as f:
                    data = yaml.safe_load(f) or {}
                if not isinstance(data, dict) or "recipe" not in data:
                    raise ValueError(f"{val}: a recipe config is a mapping with a 'recipe' key")
                recipe = recipe or data.pop("recipe")
                knobs = {**data, **knobs}
        else:
            rest.append(a)
    if recipe is None:
        raise ValueError("no recipe: pass --recipe NAME or --recipe_config recipe.yaml")
    if not rest:
        raise ValueError("nothing to launch: give accelerate launch arguments and the training script")
    import sys

    cfg = RecipeConfig.from_recipe_name(recipe, **knobs)
    return cfg.to_env(), [sys.executable, "-m", "accelerate.commands.launch", *rest]


def launch_main(argv=None) -> int:
    import os
    import subprocess
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_USAGE)
        return 0
    env, cmd = build_launch(argv)
    return subprocess.call(cmd, env={**os.environ, **env})


if __name__ == "__main__":
    raise SystemExit(launch_main())
