"""RecipeConfig: the precision recipe and its knobs, frozen and validated on creation.

Names follow Surogate's config (`recipe`, `matmul_dtype`, `gradient_dtype`, `model_dtype`,
`master_dtype`, `lora_dtype`, `fp8_amax_history`, `skip_quant_first_layers`, ...).

Fallback chain (Surogate's): model_dtype -> matmul_dtype -> gradient_dtype, and model_dtype ->
master_dtype. One addition: a matmul_dtype of e4m3 falls through to a gradient_dtype of e5m2
(E4M3 is not a gradient format). The fp8-hybrid and nvfp4 recipes fix the GEMM formats
(e4m3/e5m2 and e2m1/e2m1); setting matmul_dtype or gradient_dtype to anything else with them is
an error rather than a silent override.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

RECIPES = ("bf16", "fp8-hybrid", "nvfp4")
MATMUL_DTYPES = ("fp32", "bf16", "e4m3")
GRADIENT_DTYPES = ("fp32", "bf16", "e5m2")
FLOAT_DTYPES = ("fp32", "bf16")
AMAX_ALGOS = ("max", "most_recent")
FOUR_OVER_SIX_RULES = ("mse", "mae", "abs_max")

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_ALIASES = {
    "float32": "fp32", "torch.float32": "fp32", "fp32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "torch.float16": "fp16", "fp16": "fp16", "half": "fp16",
    "e4m3": "e4m3", "float8_e4m3fn": "e4m3", "torch.float8_e4m3fn": "e4m3",
    "e5m2": "e5m2", "float8_e5m2": "e5m2", "torch.float8_e5m2": "e5m2",
    "e2m1": "e2m1", "fp4": "e2m1",
}
# Knobs that only mean something under one recipe: passing them to another is a mistake, not a no-op.
_FP8_KNOBS = ("amax_history_len", "amax_compute_algo", "margin", "reduce_amax", "fp8_fast_accum", "fp8_scaling",
              "fp8_skip_small_linears")
# fp8_skip_small_linears: a linear stays in model_dtype when in_features <= 1024 and out_features <= 4096
FP8_SMALL_LINEAR = (1024, 4096)
_DELAYED_KNOBS = ("amax_history_len", "amax_compute_algo", "margin", "reduce_amax")
FP8_SCALINGS = ("delayed", "blockwise")
_FP4_KNOBS = ("four_over_six", "four_over_six_rule", "no_fp4_stochastic_rounding", "fp4_rht", "fp4_weight_blocks",
              "fp4_high_precision_tail", "fp4_high_precision_passes")
# the nvfp4 GEMMs a precision switch (recipes.switch) moves to model_dtype: the forward only, or all three
HIGH_PRECISION_PASSES = ("forward", "all")
# "1d" (default): 1x16 blocks along the reduction dim of each GEMM, the forward's W along K and the dgrad's along N (two
# quantizations of the weight); "2d": 16x16 weight tiles, W and W^T quantize alike (NVIDIA's NVFP4 pretraining
# recipe). Fine-tuning the convergence benchmark's pretrained model (H100, 200 steps, 2c44c9a): 1d +3.09% to bf16,
# 2d +3.83%; step-0 validation loss 4.958 vs 5.339 (bf16 4.832): one scale per 256 weights costs the pretrained
# forward most of its FP4 error
FP4_WEIGHT_BLOCKS = ("2d", "1d")
_KNOB_ALIASES = {"fp8_amax_history": "amax_history_len"}

# The nvfp4 recipe's default share of decoder layers kept in model_dtype, (first, last), rounded to whole layers.
# NVIDIA's NVFP4 pretraining recipe keeps ~16% of the linear layers in BF16, a few first and most of them last; these
# shares keep 2 first and 8 last of 62 blocks, 1 and 4 of 28, 1 and 2 of 18, none of 3 or fewer.
NVFP4_BF16_ENDS = (0.032, 0.129)

# The nvfp4 recipe's default precision switch: the last 30% of the optimizer steps with the forward GEMMs in
# model_dtype. Fine-tuning the convergence benchmark's pretrained Gemma-3-270M for 200 steps (H100) FP4 to the end
# left +3.43% to bf16; the last 10% / 20% / 30% in bf16 left +1.66% / +1.27-1.37% / +1.05%. On the held-out
# SmolLM2-135M on KJV: +6.78%, and +2.54-2.59% at 20%, +1.94% at 30%: 30% is the shortest share measured that keeps
# both under issue 16's 2%. (NVIDIA's pretraining report switches a shorter share; a short fine-tune of a pretrained
# model starts from a larger FP4 forward error.) docs/fidelity.md
NVFP4_HIGH_PRECISION_TAIL = 0.3

ENV_RECIPE = "SUROGATE_RECIPE"
ENV_KNOBS = "SUROGATE_RECIPE_KNOBS"


def dtype_name(value, knob: str) -> str | None:
    """Canonical short name ('fp32', 'bf16', 'e4m3', ...) of a dtype given as str or torch.dtype."""
    if value is None:
        return None
    key = str(value).lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"{knob}={value!r} is not a dtype surogate_hf knows")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class RecipeConfig:
    recipe: str = "bf16"
    # precision knobs (None = take the fallback chain)
    matmul_dtype: str | None = None
    gradient_dtype: str | None = None
    model_dtype: str | None = None  # None: the model's own parameter dtype, read by apply_recipe
    master_dtype: str | None = None
    lora_dtype: str | None = None  # applied through surogate_hf.integrations.peft.set_lora_dtype
    # fp8 delayed scaling (Transformer Engine DelayedScaling semantics)
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    reduce_amax: bool = True
    # the forward GEMM accumulates in the tensor cores' fast (reduced-precision, periodically promoted) mode,
    # as Transformer Engine's and torchao's fp8 recipes do; dgrad and wgrad always accumulate in fp32
    fp8_fast_accum: bool = True
    # "delayed": per-tensor scales from the amax history (TE DelayedScaling); "blockwise": DeepSeek-V3's fine-grained
    # current scaling, activations and gradients in 1x128 tiles, weights in 128x128 blocks (recipes.fp8_blockwise)
    fp8_scaling: str = "delayed"
    # leave the linears too small for FP8 GEMMs to pay in model_dtype: in_features <= 1024 and out_features <= 4096
    # (FP8_SMALL_LINEAR; torchao's tensorwise auto-filter thresholds, from H100 measurements). On a 576-wide model
    # every projection but down_proj stays in model_dtype
    fp8_skip_small_linears: bool = False
    # nvfp4
    four_over_six: bool = True
    four_over_six_rule: str = "mse"
    no_fp4_stochastic_rounding: bool = False
    fp4_rht: bool = True
    fp4_weight_blocks: str = "1d"
    # NVIDIA's precision switch: the last `fp4_high_precision_tail` of the run's optimizer steps run the nvfp4 layers'
    # `fp4_high_precision_passes` GEMMs in model_dtype (recipes.switch; scheduled by SurogateRecipeCallback, or by
    # recipes.schedule_precision in a training loop of one's own). None: the recipe's default (NVFP4_HIGH_PRECISION_TAIL
    # for nvfp4, 0 for the others); 0: FP4 to the end
    fp4_high_precision_tail: float | None = None
    fp4_high_precision_passes: str = "forward"
    seed: int = 0
    # swap transformers' RMSNorms for recipes.norm.FusedRMSNorm (one kernel each way; hands its FP8-cast output
    # to the FP8 linears it feeds); same weights, same state_dict keys, same formula
    fused_norms: bool = True
    # the LoRA adapter linears (lora_A / lora_B of a PEFT model) get the recipe's GEMMs too. Off by default: a
    # rank-r GEMM is bound by launches and bytes, not by the tensor cores, so FP8 / FP4 operands only add casts
    # (measured: 224 more FP8 linears per step at 8 layers, the step host-bound); the adapters then compute in
    # their own dtype (PEFT's, or lora_dtype)
    quantize_lora_adapters: bool = False
    # which linears are converted. None: the recipe's default, 0 for bf16 and fp8-hybrid; for nvfp4 the first ~3% and
    # the last ~13% of the decoder layers stay in model_dtype (NVFP4_BF16_ENDS), the ~16% of layers NVIDIA's NVFP4
    # pretraining recipe keeps in BF16. Give 0 to convert every layer.
    skip_quant_first_layers: int | None = None
    skip_quant_last_layers: int | None = None
    modules_to_not_convert: tuple = field(default=("lm_head",))

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass normalisation)
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r} is unknown; choose one of {RECIPES}")
        for knob in ("matmul_dtype", "gradient_dtype", "model_dtype", "master_dtype", "lora_dtype"):
            set_(knob, dtype_name(getattr(self, knob), knob))
        if self.matmul_dtype is not None and self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(
                f"matmul_dtype={self.matmul_dtype!r} is not supported: forward matmuls run in {MATMUL_DTYPES} "
                "(e5m2 is a gradient format, e2m1 only exists inside the nvfp4 recipe, fp16 is not supported)"
            )
        if self.gradient_dtype is not None and self.gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(
                f"gradient_dtype={self.gradient_dtype!r} is not supported: backward matmuls run in {GRADIENT_DTYPES} "
                "(e4m3 lacks the range gradients need; fp16 and e2m1 are not supported)"
            )
        for knob in ("model_dtype", "master_dtype", "lora_dtype"):
            v = getattr(self, knob)
            if v is not None and v not in FLOAT_DTYPES:
                raise ValueError(f"{knob}={v!r} is not supported; choose one of {FLOAT_DTYPES}")
        forced = {"fp8-hybrid": ("e4m3", "e5m2"), "nvfp4": ("e2m1", "e2m1")}.get(self.recipe)
        if forced is not None:
            for knob, want in zip(("matmul_dtype", "gradient_dtype"), forced):
                v = getattr(self, knob)
                if v is not None and v != want:
                    raise ValueError(
                        f"{knob}={v!r} conflicts with recipe={self.recipe!r}, which runs its matmuls in {want}; "
                        f"drop {knob} or use recipe='bf16'"
                    )
        if self.recipe == "bf16" and self.gradient_dtype == "e5m2" and self.resolved_matmul_dtype() != "e4m3":
            raise ValueError(
                "gradient_dtype='e5m2' needs matmul_dtype='e4m3': the FP8 backward multiplies E5M2 gradients "
                "with the E4M3 weight and activation of the forward (there is no bf16 x e5m2 GEMM)"
            )
        if self.model_dtype == "fp32" and self.master_dtype == "bf16":
            raise ValueError("master_dtype='bf16' below model_dtype='fp32' is not supported; masters must be at least as wide")
        if not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len (fp8_amax_history) must be an int >= 1, got {self.amax_history_len!r}")
        algo = str(self.amax_compute_algo).lower()
        if algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r} is unknown; choose one of {AMAX_ALGOS}")
        set_("amax_compute_algo", algo)
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling={self.fp8_scaling!r} is unknown; choose one of {FP8_SCALINGS}")
        if self.fp8_scaling == "blockwise":
            if self.recipe == "nvfp4":
                raise ValueError("fp8_scaling only applies to the FP8 recipes, not recipe='nvfp4'")
            for knob in _DELAYED_KNOBS:
                f = next(f for f in dataclasses.fields(self) if f.name == knob)
                if getattr(self, knob) != f.default:
                    raise ValueError(
                        f"{knob} is a delayed-scaling knob; fp8_scaling='blockwise' scales every tile by its own "
                        "amax (no history), drop it"
                    )
        for knob in ("fp8_fast_accum", "fused_norms", "quantize_lora_adapters", "fp8_skip_small_linears"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{knob} must be True or False, got {getattr(self, knob)!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if self.fp4_weight_blocks not in FP4_WEIGHT_BLOCKS:
            raise ValueError(f"fp4_weight_blocks={self.fp4_weight_blocks!r} is unknown; choose one of {FP4_WEIGHT_BLOCKS}")
        tail = self.fp4_high_precision_tail
        if tail is not None:
            if isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0.0 <= tail < 1.0:
                raise ValueError(f"fp4_high_precision_tail must be a fraction of the run in [0, 1), got {tail!r}")
            set_("fp4_high_precision_tail", float(tail))
        if tail and self.recipe != "nvfp4":
            raise ValueError(f"fp4_high_precision_tail only applies to recipe='nvfp4', not {self.recipe!r}")
        if self.fp4_high_precision_passes not in HIGH_PRECISION_PASSES:
            raise ValueError(f"fp4_high_precision_passes={self.fp4_high_precision_passes!r} is unknown; choose one of "
                             f"{HIGH_PRECISION_PASSES}")
        if self.four_over_six_rule not in FOUR_OVER_SIX_RULES:
            raise ValueError(f"four_over_six_rule={self.four_over_six_rule!r} is unknown; choose one of {FOUR_OVER_SIX_RULES}")
        for knob in ("skip_quant_first_layers", "skip_quant_last_layers"):
            v = getattr(self, knob)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{knob} must be an int >= 0 (or None for the recipe's default), got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        mods = self.modules_to_not_convert
        if isinstance(mods, str) or not all(isinstance(m, str) for m in mods):
            raise ValueError(f"modules_to_not_convert must be a list of module names, got {mods!r}")
        set_("modules_to_not_convert", tuple(mods))

    # ------------------------------------------------------------ construction
    @classmethod
    def from_recipe_name(cls, recipe: str, **knobs) -> "RecipeConfig":
        """The named preset with `knobs` on top; unknown knobs and knobs of another recipe are errors."""
        recipe = str(recipe).lower().replace("_", "-")
        if recipe in ("fp8", "fp8hybrid"):
            recipe = "fp8-hybrid"
        if recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r} is unknown; choose one of {RECIPES}")
        out = {}
        valid = {f.name for f in dataclasses.fields(cls)} - {"recipe"}
        for k, v in knobs.items():
            name = _KNOB_ALIASES.get(k, k)
            if name not in valid:
                raise ValueError(f"unknown recipe knob {k!r}; valid knobs: {sorted(valid | set(_KNOB_ALIASES))}")
            if name in _FP8_KNOBS and recipe == "nvfp4":
                raise ValueError(f"{k} is an FP8 recipe knob; recipe='nvfp4' has no FP8 GEMMs")
            if name in _FP4_KNOBS and recipe != "nvfp4":
                raise ValueError(f"{k} only applies to recipe='nvfp4', not {recipe!r}")
            out[name] = v
        return cls(recipe=recipe, **out)

    @classmethod
    def from_env(cls, environ=None) -> "RecipeConfig | None":
        """SUROGATE_RECIPE=<name> plus optional SUROGATE_RECIPE_KNOBS=<JSON object>; None when unset."""
        env = os.environ if environ is None else environ
        name = env.get(ENV_RECIPE, "").strip()
        raw = env.get(ENV_KNOBS, "").strip()
        if not name:
            if raw:
                raise ValueError(f"{ENV_KNOBS} is set but {ENV_RECIPE} is not; set {ENV_RECIPE} to one of {RECIPES}")
            return None
        knobs = {}
        if raw:
            try:
                knobs = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{ENV_KNOBS} must be a JSON object of knobs, got {raw!r}: {e}") from None
            if not isinstance(knobs, dict):
                raise ValueError(f"{ENV_KNOBS} must be a JSON object of knobs, got {raw!r}")
        return cls.from_recipe_name(name, **knobs)

    def to_dict(self) -> dict:
        """JSON-able {"recipe": ..., knob: value} of the knobs that differ from their defaults (from_dict reads it)."""
        out = {"recipe": self.recipe}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "recipe" and v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "RecipeConfig":
        d = dict(d)
        return cls.from_recipe_name(d.pop("recipe"), **d)

    def to_env(self) -> dict:
        """The environment variables from_env reads back into this config."""
        knobs = self.to_dict()
        env = {ENV_RECIPE: knobs.pop("recipe")}
        if knobs:
            env[ENV_KNOBS] = json.dumps(knobs)
        return env

    # ------------------------------------------------------------ resolution (the fallback chain)
    def resolved_model_dtype(self) -> str:
        if self.model_dtype is None:
            raise ValueError("model_dtype is unresolved: apply_recipe reads it from the model, or pass model_dtype")
        return self.model_dtype

    def resolved_matmul_dtype(self) -> str:
        if self.recipe == "fp8-hybrid":
            return "e4m3"
        if self.recipe == "nvfp4":
            return "e2m1"
        return self.matmul_dtype or self.model_dtype or "bf16"

    def resolved_gradient_dtype(self) -> str:
        if self.recipe == "fp8-hybrid":
            return "e5m2"
        if self.recipe == "nvfp4":
            return "e2m1"
        if self.gradient_dtype is not None:
            return self.gradient_dtype
        m = self.resolved_matmul_dtype()
        return "e5m2" if m == "e4m3" else m

    def resolved_master_dtype(self) -> str:
        return self.master_dtype or self.resolved_model_dtype()

    def resolved_high_precision_tail(self) -> float:
        """The share of the run's last optimizer steps under the nvfp4 precision switch (0: none)."""
        if self.fp4_high_precision_tail is not None:
            return self.fp4_high_precision_tail
        return NVFP4_HIGH_PRECISION_TAIL if self.recipe == "nvfp4" else 0.0

    def resolved_skip_layers(self, n_layers: int) -> tuple[int, int]:
        """(first, last) decoder layers kept in model_dtype for a model of n_layers: the knobs, or the recipe's
        default where they are None (NVFP4_BF16_ENDS for nvfp4, none otherwise)."""
        first, last = self.skip_quant_first_layers, self.skip_quant_last_layers
        if self.recipe == "nvfp4":
            f_share, l_share = NVFP4_BF16_ENDS
            first = int(f_share * n_layers + 0.5) if first is None else first
            last = int(l_share * n_layers + 0.5) if last is None else last
        return (first or 0), (last or 0)

    def uses_fp8(self) -> bool:
        return self.resolved_matmul_dtype() == "e4m3"

    def with_model_dtype(self, model_dtype) -> "RecipeConfig":
        return dataclasses.replace(self, model_dtype=dtype_name(model_dtype, "model_dtype"))


def as_recipe_config(recipe, **knobs) -> RecipeConfig:
    """A RecipeConfig from a name or a config, with `knobs` on top. Nothing is read from the environment here."""
    if isinstance(recipe, RecipeConfig):
        return dataclasses.replace(recipe, **{_KNOB_ALIASES.get(k, k): v for k, v in knobs.items()}) if knobs else recipe
    if recipe is None:
        raise ValueError(f"no recipe given: pass recipe= one of {RECIPES} or a RecipeConfig")
    return RecipeConfig.from_recipe_name(recipe, **knobs)


def recipe_from_launcher(environ=None) -> RecipeConfig | None:
    """The recipe `surogate-hf launch` (surogate_hf.integrations.accelerate.launch_main) hands to the processes it
    starts, as SUROGATE_RECIPE / SUROGATE_RECIPE_KNOBS; None when the process was not started that way. This is the
    one place the package reads those variables."""
    return RecipeConfig.from_env(environ)


CONFIG_ATTR = "surogate_recipe"  # the key under which a model's config.json records its recipe


def recorded_recipe(model) -> RecipeConfig | None:
    """The recipe recorded in `model.config` (by apply_recipe; saved with every checkpoint), or None."""
    record = getattr(getattr(model, "config", None), CONFIG_ATTR, None)
    if record is None:
        return None
    if not isinstance(record, dict) or "recipe" not in record:
        raise ValueError(f"model.config.{CONFIG_ATTR} must be a mapping with a 'recipe' key, got {record!r}")
    return RecipeConfig.from_dict(record)


def resolve_recipe(model, recipe=None, **knobs) -> RecipeConfig | None:
    """The recipe to apply, in this order: the explicit `recipe` argument; the launcher's (`recipe_from_launcher`);
    the one recorded in `model.config`; `knobs` go on top of whichever is found. None when there is none."""
    if recipe is not None:
        return as_recipe_config(recipe, **knobs)
    found = recipe_from_launcher() or recorded_recipe(model)
    return None if found is None else as_recipe_config(found, **knobs)


def check_skip_layers(cfg: RecipeConfig, n_layers: int) -> None:
    """Refuse skip_quant_first_layers / skip_quant_last_layers that select no decoder layer the model has (more
    than it has, or any on a model without a layer list): they would convert nothing and say nothing."""
    from ..nn.convert import check_skip_layers as check

    check(*cfg.resolved_skip_layers(n_layers), n_layers)


def check_device(cfg: RecipeConfig, device: torch.device) -> None:
    """Refuse an FP8 recipe on a CUDA GPU without FP8 tensor cores (below SM89)."""
    device = torch.device(device)
    if device.type != "cuda" or not cfg.uses_fp8():
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        knob = "recipe='fp8-hybrid'" if cfg.recipe == "fp8-hybrid" else "matmul_dtype='e4m3'"
        raise RuntimeError(
            f"{knob} needs FP8 tensor cores (SM89+: Ada, Hopper, Blackwell); {device} is SM{cap[0]}{cap[1]}. "
            "Use recipe='bf16' on this GPU"
        )
