"""`surogate-hf sft` config: Surogate's SFT YAML keys, their checks and the combinations that cannot run.

The whole config is validated before anything is loaded: unknown keys, bad values and impossible combinations
(two qlora formats, a qlora flag on a pre-quantized checkpoint, qlora without LoRA, ...) stop the command with
a message naming the keys. With no config file the embedded default (surogate_hf/configs/default_sft.yaml) runs.
"""

from __future__ import annotations

import difflib
import importlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-llama",)
QLORA_FLAGS = {"qlora_fp8": "fp8", "qlora_fp4": "nvfp4", "qlora_mxfp4": "mxfp4", "qlora_bnb": "nf4"}
PREQUANTIZED_METHODS = ("fp8", "mxfp4", "modelopt", "surogate", "bitsandbytes", "gptq", "awq", "compressed-tensors",
                        "fbgemm_fp8", "torchao", "hqq", "quanto", "eetq", "aqlm", "nvfp4", "mxfp8")
OPTIMIZERS = {"adamw_8bit": "adamw_bnb_8bit", "adamw_bnb_8bit": "adamw_bnb_8bit", "adamw": "adamw_torch",
              "adamw_torch": "adamw_torch"}
# QLoRA options of one format: set with another (or none), they would be ignored, so they are an error
QLORA_FORMAT_KEYS = {"qlora_block_size": "qlora_fp8", "qlora_four_over_six": "qlora_fp4",
                     "qlora_bnb_block_size": "qlora_bnb", "qlora_bnb_double_quant": "qlora_bnb"}
RECIPE_KNOBS = ("matmul_dtype", "gradient_dtype", "master_dtype", "fp8_amax_history")


class ConfigError(ValueError):
    """A config problem found before anything was loaded."""


def require_cli_extra(module: str, what: str):
    """Import an optional dependency of the command line (the `[cli]` extra), or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"surogate-hf: {what} needs the {module.split('.')[0]!r} package: "
            "pip install 'surogate_hf[cli]' (the [cli] extra: pyyaml, matplotlib)"
        ) from e


def _yaml():
    return require_cli_extra("yaml", "reading YAML configs")


# ------------------------------------------------------------------ schema
def _bool(v):
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _int(lo=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("must be an integer")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}")
        return v
    return check


def _float(lo=None, hi=None, lo_open=False):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("must be a number")
        v = float(v)
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise ValueError(f"must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}")
        return v
    return check


def _choice(*choices):
    def check(v):
        if v not in choices:
            raise ValueError(f"must be one of {list(choices)}")
        return v
    return check


def _str(v):
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    return v


def _opt_str(v):
    return None if v is None else _str(v)


def _targets(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ValueError("must be a list of module names (or [all])")
    return v


def _resume(v):
    if isinstance(v, bool) or (isinstance(v, str) and v):
        return v
    raise ValueError("must be true, false or a checkpoint directory")


def _datasets(v):
    if not isinstance(v, list) or not v or not all(isinstance(d, dict) for d in v):
        raise ValueError("must be a non-empty list of dataset entries (each a mapping with at least `type`)")
    return [validate_dataset(d, i) for i, d in enumerate(v)]


@dataclass(frozen=True)
class Opt:
    default: Any
    check: Callable[[Any], Any]


SCHEMA: dict[str, Opt] = {
    # model / output
    "model": Opt(None, _str),
    "torch_dtype": Opt("auto", _choice("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")),
    "sequence_len": Opt(1024, _int(8)),
    "output_dir": Opt("output", _str),
    "run_name": Opt(None, _opt_str),
    "save_steps": Opt(50, _int(0)),
    "save_total_limit": Opt(5, _int(1)),
    "resume_from_checkpoint": Opt(True, _resume),
    # loop
    "num_epochs": Opt(3, _float(0, lo_open=True)),
    "max_steps": Opt(-1, _int(-1)),
    "per_device_train_batch_size": Opt(2, _int(1)),
    "gradient_accumulation_steps": Opt(4, _int(1)),
    "eval_steps": Opt(100, _int(0)),
    "logging_steps": Opt(10, _int(1)),
    "recompute": Opt(True, _bool),
    # compile (the Trainer's torch_compile: the whole model, inductor); use_cuda_graphs adds CUDA graphs
    # (torch_compile_mode="reduce-overhead"), which a small model's host-bound QLoRA step needs (docs/qlora.md)
    "torch_compile": Opt(False, _bool),
    "use_cuda_graphs": Opt(False, _bool),
    # optimizer
    "optimizer": Opt("adamw_8bit", _choice(*OPTIMIZERS)),
    "learning_rate": Opt(2e-4, _float(0, lo_open=True)),
    "lr_scheduler_type": Opt("linear", _choice("linear", "cosine", "constant", "constant_with_warmup")),
    "warmup_ratio": Opt(0.0, _float(0, 0.999)),
    "warmup_steps": Opt(0, _int(0)),
    "weight_decay": Opt(0.1, _float(0)),
    "max_grad_norm": Opt(1.0, _float(0)),
    "adamw_beta1": Opt(0.9, _float(0, 1)),
    "adamw_beta2": Opt(0.999, _float(0, 1)),
    "adamw_epsilon": Opt(1e-8, _float(0, lo_open=True)),
    # data
    "datasets": Opt(None, _datasets),
    "validation_split_ratio": Opt(0.1, _float(0, 0.9)),
    "train_seed": Opt(1234, _int(0)),
    "eval_seed": Opt(1234, _int(0)),
    "dataloader_num_workers": Opt(0, _int(0)),
    "sample_packing": Opt(False, _bool),
    "report_to": Opt(None, lambda v: _targets(v) if v is not None else None),
    # LoRA
    "lora": Opt(True, _bool),
    "lora_rank": Opt(16, _int(1)),
    "lora_alpha": Opt(32, _float(0, lo_open=True)),
    "lora_dropout": Opt(0.05, _float(0, 0.99)),
    "lora_dtype": Opt("fp32", _choice("fp32", "bf16", "float32", "bfloat16")),
    "lora_target_modules": Opt(["all"], _targets),
    "merge_adapter": Opt(False, _bool),
    # QLoRA (qlora_mxfp4 is a surogate-hf addition: MXFP4 bases, e.g. GPT-OSS-style)
    "qlora_fp8": Opt(False, _bool),
    "qlora_fp4": Opt(False, _bool),
    "qlora_mxfp4": Opt(False, _bool),
    "qlora_bnb": Opt(False, _bool),
    "qlora_block_size": Opt(128, _choice(64, 128, 256)),
    "qlora_bnb_block_size": Opt(64, _int(1)),
    "qlora_bnb_double_quant": Opt(True, _bool),
    "qlora_four_over_six": Opt(True, _bool),
    # surogate-hf additions: the adapters' initialisation on a QLoRA base (surogate_hf.loftq_init)
    "qlora_init": Opt("zero", _choice("zero", "loftq", "activation_aware")),
    "qlora_init_iters": Opt(1, _int(1)),
    "qlora_init_windows": Opt(8, _int(1)),
    # precision recipe (surogate_hf.recipes)
    "recipe": Opt("bf16", _str),
    "matmul_dtype": Opt(None, _opt_str),
    "gradient_dtype": Opt(None, _opt_str),
    "master_dtype": Opt(None, _opt_str),
    "fp8_amax_history": Opt(None, lambda v: None if v is None else _int(1)(v)),
    # None: the default of what reads it (the QLoRA quantizer: 0; the nvfp4 recipe: its bf16 ends, RecipeConfig)
    "skip_quant_first_layers": Opt(None, lambda v: None if v is None else _int(0)(v)),
    "skip_quant_last_layers": Opt(None, lambda v: None if v is None else _int(0)(v)),
}

# Keys of Surogate's own config that this command does not implement: named as such, not as typos.
SUROGATE_ONLY = {
    "model_type", "max_model_len", "rope_scaling", "apply_recommended_values", "checkpoint_dir", "from_scratch",
    "cpu_training", "offload_residual", "offload_master", "offload_quants", "offload_optimizer", "offload_grads",
    "persistent_quants", "use_zero_copy", "use_write_combined", "zero_level", "shard_weights", "shard_gradients",
    "use_all_to_all_reduce", "memcpy_all_gather", "memcpy_send_recv", "distributed", "gpus",
    "use_fused_rope", "fp4_backend", "cooldown_steps", "final_lr_fraction", "normuon_momentum", "normuon_beta2",
    "normuon_cautious_wd", "train_vision", "validation_datasets", "lmhead_chunks", "attn_bwd_chunks",
    "long_context", "init_projections_to_zero", "train_router", "adapter_path", "router_aux_loss_coef",
    "router_z_loss_coef", "qlora_selective_expert_dequant", "qlora_offload_experts", "use_chat_template",
    "template", "system", "max_length", "truncation_strategy", "padding_side", "padding_free", "loss_scale",
    "sequence_parallel_size", "response_prefix", "max_pixels", "norm_bbox", "agent_template", "log_file",
    "log_gpu_util", "wandb_project", "wandb_name", "aim_experiment", "aim_repo", "aim_name",
    "debug_time_breakdown", "debug_memory_breakdown", "auto_lr_reduction", "early_stop", "epoch_adjustment",
}

DATASET_KEYS = {
    "synthetic": {"type", "task", "alphabet", "min_len", "max_len", "samples", "eval_samples"},
    "text": {"type", "path", "text_field", "split", "subset", "samples"},
    "instruction": {"type", "path", "instruction_field", "input_field", "output_field", "prompt_format",
                    "split", "subset", "samples"},
}


def validate_dataset(d: dict, i: int) -> dict:
    where = f"datasets[{i}]"
    kind = d.get("type")
    if kind not in DATASET_KEYS:
        raise ValueError(f"{where}.type must be one of {sorted(DATASET_KEYS)}, got {kind!r}")
    unknown = sorted(set(d) - DATASET_KEYS[kind])
    if unknown:
        raise ValueError(f"{where} (type {kind}): unknown key(s) {unknown}; allowed: {sorted(DATASET_KEYS[kind])}")
    out = dict(d)
    if kind == "synthetic":
        from ..data import TaskSpec

        spec = {k: d[k] for k in ("task", "alphabet", "min_len", "max_len") if k in d}
        try:
            TaskSpec(**spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        out.setdefault("samples", 20000)
        out.setdefault("eval_samples", 512)
    else:
        if not isinstance(d.get("path"), str) or not d["path"]:
            raise ValueError(f"{where} (type {kind}): `path` (a local .jsonl/.json file or a Hub dataset) is required")
        if kind == "instruction" and not (d.get("instruction_field") and d.get("output_field")):
            raise ValueError(f"{where} (type instruction): instruction_field and output_field are required")
    for k in ("samples", "eval_samples"):
        if k in out and (isinstance(out[k], bool) or not isinstance(out[k], int) or out[k] < 1):
            raise ValueError(f"{where}.{k} must be a positive integer")
    return out


# ------------------------------------------------------------------ loading and checking a config
def default_config_text() -> str:
    return resources.files("surogate_hf").joinpath("configs/default_sft.yaml").read_text()


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    key, value = item.split("=", 1)
    return key.strip(), _yaml().safe_load(value)


def load_config(path: str | None, overrides: list[str] = ()) -> dict:
    yaml = _yaml()
    if path is None:
        raw = yaml.safe_load(default_config_text())
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of Surogate config keys, got {type(raw).__name__}")
    for item in overrides:
        k, v = parse_override(item)
        raw[k] = v
    return check_config(raw)


def check_config(raw: dict) -> dict:
    """Validate every key and combination; return the full config with defaults filled in."""
    unknown = sorted(set(raw) - set(SCHEMA))
    if unknown:
        not_here = [k for k in unknown if k in SUROGATE_ONLY]
        typos = [k for k in unknown if k not in SUROGATE_ONLY]
        msgs = []
        if typos:
            hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, SCHEMA, 1)) else k
                     for k in typos]
            msgs.append(f"unknown key(s): {', '.join(hints)}")
        if not_here:
            msgs.append(f"Surogate option(s) not supported by surogate-hf sft: {', '.join(not_here)}")
        raise ConfigError("; ".join(msgs))
    cfg, errors = {}, []
    for key, opt in SCHEMA.items():
        if key not in raw:
            cfg[key] = opt.default
            continue
        try:
            cfg[key] = opt.check(raw[key])
        except ValueError as e:
            errors.append(f"{key}: {e} (got {raw[key]!r})")
    if errors:
        raise ConfigError("invalid value(s): " + "; ".join(errors))
    check_combinations(cfg)
    return cfg


def qlora_format(cfg: dict) -> str | None:
    on = [k for k in QLORA_FLAGS if cfg[k]]
    return QLORA_FLAGS[on[0]] if on else None


def checkpoint_quant_method(model: str) -> str | None:
    """quant_method of a checkpoint's config.json (local dir or Hub id), read without loading weights."""
    p = Path(model)
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model directory {model} has no config.json")
        legacy = p / "hf_quant_config.json"  # older ModelOpt exports keep the quantization here
        if legacy.is_file():
            return "modelopt"
    else:
        from transformers.utils import cached_file

        try:
            cfg_file = cached_file(model, "config.json")
        except OSError as e:
            raise ConfigError(f"model {model!r}: cannot read its config.json ({e})") from None
    qc = json.loads(Path(cfg_file).read_text()).get("quantization_config")
    return None if not qc else str(qc.get("quant_method", "unknown"))


def check_combinations(cfg: dict) -> None:
    errs = []
    on = [k for k in QLORA_FLAGS if cfg[k]]
    if len(on) > 1:
        errs.append(f"{' and '.join(on)} are set together; choose one QLoRA format")
    if on and not cfg["lora"]:
        errs.append(f"{on[0]} quantizes the frozen base for LoRA; it needs lora: true")
    if not cfg["lora"] and cfg["merge_adapter"]:
        errs.append("merge_adapter: true needs lora: true")
    if cfg["model"] is None:
        errs.append("model is required (a local directory, a Hub id, or builtin:tiny-llama)")
    if cfg["sample_packing"]:
        errs.append("sample_packing: true is not supported by surogate-hf sft; set sample_packing: false")
    if cfg["max_steps"] == 0:
        errs.append("max_steps: 0 trains nothing; use -1 (derive from num_epochs) or a positive number")
    fmt = QLORA_FLAGS[on[0]] if len(on) == 1 else None
    for key, owner in QLORA_FORMAT_KEYS.items():
        if cfg[key] != SCHEMA[key].default and fmt != QLORA_FLAGS[owner]:
            errs.append(f"{key}: {cfg[key]!r} only applies with {owner}: true and would be ignored; drop it")
    if cfg["qlora_init"] != "zero" and not on:
        errs.append(f"qlora_init: {cfg['qlora_init']} compensates the quantization error of a QLoRA base; it needs "
                    f"one of {sorted(QLORA_FLAGS)}")
    if cfg["qlora_init_iters"] > 5:
        errs.append(f"qlora_init_iters: {cfg['qlora_init_iters']} is above 5 (loftq_init alternates 1 to 5 times)")
    for key, needs in (("qlora_init_iters", ("loftq", "activation_aware")), ("qlora_init_windows", ("activation_aware",))):
        if cfg[key] != SCHEMA[key].default and cfg["qlora_init"] not in needs:
            errs.append(f"{key}: {cfg[key]!r} only applies with qlora_init: {' or '.join(needs)} and would be "
                        "ignored; drop it")
    if cfg["qlora_bnb"] and cfg["qlora_bnb_block_size"] not in (64, 128):
        errs.append(f"qlora_bnb_block_size: {cfg['qlora_bnb_block_size']} is not supported; use 64 or 128")
    if cfg["datasets"] is None:
        errs.append("datasets is required")
    builtin = isinstance(cfg["model"], str) and cfg["model"].startswith(BUILTIN_PREFIX)
    if builtin and cfg["model"][len(BUILTIN_PREFIX):] not in BUILTIN_MODELS:
        errs.append(f"model: {cfg['model']!r} is not a built-in model; built-ins: "
                    f"{[BUILTIN_PREFIX + m for m in BUILTIN_MODELS]}")
    for i, d in enumerate(cfg["datasets"] or []):
        if builtin and d["type"] != "synthetic":
            errs.append(f"datasets[{i}]: {cfg['model']} has a character vocabulary and only trains on "
                        "type: synthetic data")
        if not builtin and d["type"] == "synthetic":
            errs.append(f"datasets[{i}]: type: synthetic data needs model: builtin:tiny-llama")
    if cfg["optimizer"] in ("adamw_8bit", "adamw_bnb_8bit"):
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means the optimizer cannot run
            errs.append(f"optimizer: {cfg['optimizer']} needs bitsandbytes ({e}); install it or use optimizer: adamw")
    errs += recipe_problems(cfg)
    if errs:
        raise ConfigError("; ".join(errs))
    if cfg["model"] and not builtin and on:
        method = checkpoint_quant_method(cfg["model"])
        if method is not None:
            raise ConfigError(
                f"model {cfg['model']!r} is pre-quantized (quant_method: {method}) and {on[0]} asks to quantize it "
                f"again; drop {on[0]}: a pre-quantized base is trained in its own format"
            )


def recipe_config(cfg: dict):
    """The RecipeConfig the config asks for, or None for plain bf16 with no precision knobs."""
    knobs = {k: cfg[k] for k in RECIPE_KNOBS if cfg[k] is not None}
    for k in ("skip_quant_first_layers", "skip_quant_last_layers"):
        if cfg[k] is not None:  # an explicit 0 too: it overrides the nvfp4 recipe's bf16 ends
            knobs[k] = cfg[k]
    if cfg["recipe"].lower().replace("_", "-") == "bf16" and not any(k in knobs for k in RECIPE_KNOBS):
        return None
    from ..recipes import RecipeConfig

    if cfg["lora"]:
        knobs["lora_dtype"] = "bf16" if cfg["lora_dtype"] in ("bf16", "bfloat16") else "fp32"
    return RecipeConfig.from_recipe_name(cfg["recipe"], **knobs)


def recipe_problems(cfg: dict) -> list[str]:
    try:
        recipe_config(cfg)
    except ImportError as e:
        return [f"recipe: {cfg['recipe']!r} needs surogate_hf.recipes ({e})"]
    except ValueError as e:
        return [f"recipe: {e}"]
    return []
