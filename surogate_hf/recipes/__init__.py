"""Training precision recipes (bf16, fp8-hybrid, nvfp4): config, state, GEMM engines, module swap."""

from .config import RECIPES, RecipeConfig, as_recipe_config
from .delayed import DelayedScaling
from .linear import RecipeLinear, apply_recipe, recipe_state

__all__ = ["RECIPES", "RecipeConfig", "as_recipe_config", "DelayedScaling", "RecipeLinear", "apply_recipe", "recipe_state"]
