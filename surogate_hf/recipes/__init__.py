"""Training precision recipes (bf16, fp8-hybrid, nvfp4): config, state, GEMM engines, module swap."""

from .config import RECIPES, RecipeConfig, as_recipe_config, recipe_from_launcher, recorded_recipe, resolve_recipe
from .linear import RecipeLinear, apply_recipe, recipe_state
from .scaling import Fp8ScalingState, recipe_step
from .switch import schedule_precision, switch_to_high_precision

__all__ = ["RECIPES", "RecipeConfig", "as_recipe_config", "Fp8ScalingState", "RecipeLinear", "apply_recipe", "recipe_state",
           "recipe_step", "recipe_from_launcher", "recorded_recipe", "resolve_recipe", "schedule_precision",
           "switch_to_high_precision"]
