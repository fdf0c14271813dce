"""The nvfp4 recipe's precision switch: the last stretch of a run with some GEMMs in model_dtype.

NVIDIA's NVFP4 pretraining report (arXiv 2509.25149, "switching to higher precision") narrows the loss gap left at
the end of an NVFP4 run by moving the last part of training to BF16, and finds the forward pass's quantization
carries most of that gap. The recipe offers the same switch for every nvfp4 GEMM of a model (its RecipeLinears and
the base GEMMs of a quantized QLoRA model, recipes.qlora):

- passes="forward": y = x W^T runs in model_dtype on the (work) weight; dgrad and wgrad stay FP4 (stochastic
  rounding, RHT), so most of the FP4 backward's speed stays;
- passes="all": the layer computes as the bf16 recipe does (a quantized base: its format's own weight-only GEMMs).

The switch is a plain attribute of each layer, not model state: a resumed run switches again from its step (what
the Trainer callback does), and torch.compile recompiles once when it flips. Scheduling it:

- the knobs fp4_high_precision_tail (the last fraction of the optimizer steps; nvfp4's default 0.3) and
  fp4_high_precision_passes;
- SurogateRecipeCallback applies them from the Trainer's max_steps;
- a training loop of one's own calls schedule_precision(model, step, total_steps) before each step, or
  switch_to_high_precision(model) when it chooses.
A model whose recipe asks for the switch and whose first optimizer step comes before any schedule_precision call
gets a warning then (never a silent run in FP4 to the end).
"""

from __future__ import annotations

import math
import warnings
import weakref

from torch import nn

from .config import HIGH_PRECISION_PASSES
from .linear import RecipeLinear
from .nvfp4 import NVFP4Engine
from .qlora import BaseRecipeGemm


def _nvfp4_layers(model: nn.Module) -> list:
    """The RecipeLinears and BaseRecipeGemms of `model` that run nvfp4 GEMMs."""
    found = []
    for m in model.modules():
        if isinstance(m, RecipeLinear) and isinstance(m.engine, NVFP4Engine):
            found.append(m)
        gemm = m.__dict__.get("recipe_gemm")
        if isinstance(gemm, BaseRecipeGemm) and gemm.kind == "nvfp4":
            found.append(gemm)
    return found


def switch_to_high_precision(model: nn.Module, passes: str | None = "forward") -> int:
    """Run the `passes` ("forward" or "all") GEMMs of every nvfp4 layer of `model` in model_dtype from now on;
    passes=None switches back to FP4. Returns the number of layers switched; a model without nvfp4 GEMMs is an
    error (nothing would change)."""
    if passes is not None and passes not in HIGH_PRECISION_PASSES:
        raise ValueError(f"switch_to_high_precision: passes={passes!r} is unknown; choose one of {HIGH_PRECISION_PASSES}"
                         " or None (back to FP4)")
    n = _switch(_recipe_root(model), passes)
    if not n:
        raise ValueError("switch_to_high_precision: the model has no nvfp4 recipe GEMM; apply_recipe(model, 'nvfp4') "
                         "first")
    return n


def _switch(model: nn.Module, passes: str | None) -> int:
    layers = _nvfp4_layers(model)
    for layer in layers:
        if isinstance(layer, RecipeLinear):
            layer.fp4_high_precision = passes
        else:
            layer.high_precision = passes
    model.__dict__["surogate_high_precision"] = passes
    return len(layers)


_unscheduled: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models with a tail no schedule_precision has seen
_hook = None


def expect_schedule(model: nn.Module) -> None:
    """apply_recipe's call for a model whose recipe has a precision-switch tail: until schedule_precision sees the
    model, the first optimizer step that trains it warns (torch.optim's global step post-hook)."""
    global _hook
    _unscheduled.add(model)
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_warn_if_unscheduled)


def _warn_if_unscheduled(optimizer, args, kwargs) -> None:
    if not _unscheduled:
        return
    from .scaling import _trains

    for model in list(_unscheduled):
        cache = model.__dict__.setdefault("_surogate_switch_optimizers", weakref.WeakKeyDictionary())
        if _trains(optimizer, model, cache):
            _unscheduled.discard(model)
            tail = model.surogate_recipe.resolved_high_precision_tail()
            warnings.warn(
                f"surogate_hf: the nvfp4 recipe's fp4_high_precision_tail={tail} switches its GEMMs to model_dtype "
                "for the last steps only when something schedules it, and this model trained a step without: with "
                "the HF Trainer pass SurogateRecipeCallback; in a training loop of your own call "
                "surogate_hf.recipes.schedule_precision(model, step, total_steps) before each optimizer step; or "
                "apply the recipe with fp4_high_precision_tail=0 for FP4 to the end", RuntimeWarning, stacklevel=2)


def switch_step(total_steps: int, tail: float) -> int:
    """The first optimizer step (0-based) of the last `tail` of `total_steps`."""
    return total_steps - math.ceil(tail * total_steps - 1e-9) if tail > 0 else total_steps


def _recipe_root(model: nn.Module) -> nn.Module:
    """The module apply_recipe converted, under the wrappers a training loop may hold instead (DDP / FSDP's `module`,
    torch.compile's `_orig_mod`)."""
    seen = model
    while getattr(seen, "surogate_recipe", None) is None:
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        seen = inner
    return seen


def schedule_precision(model: nn.Module, step: int, total_steps: int) -> bool:
    """Apply the recipe's fp4_high_precision_tail at 0-based optimizer step `step` of `total_steps`: switch when the
    tail begins (and on a resume past it). Call it before each step; a no-op for other recipes and with tail 0.
    Returns whether the model runs switched."""
    model = _recipe_root(model)
    cfg = getattr(model, "surogate_recipe", None)
    tail = 0.0 if cfg is None else cfg.resolved_high_precision_tail()
    if not tail:
        return False
    _unscheduled.discard(model)
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"schedule_precision: total_steps must be an int >= 1 (the run's optimizer steps), got "
                         f"{total_steps!r}")
    if step < switch_step(total_steps, tail):
        return False
    if model.__dict__.get("surogate_high_precision") != cfg.fp4_high_precision_passes:
        _switch(model, cfg.fp4_high_precision_passes)  # (a model whose layers all stayed in model_dtype: nothing to do)
    return True
