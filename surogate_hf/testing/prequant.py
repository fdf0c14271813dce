"""Tiny pre-quantized checkpoints written on CPU, in the layouts real exports use.

Producers (the oracles of tests/integrations/test_prequantized.py):
- fine-grained FP8 (quant_method "fp8"): transformers' own `Fp8Quantize` (integrations/finegrained_fp8.py);
- ModelOpt NVFP4 / FP8 / MIXED_PRECISION (quant_method "modelopt"): surogate_hf.formats, following the
  layout in shared/notes/formats.md (weight_scale_2 = amax / (6 * 448), i.e. no Four-Over-Six);
- GPT-OSS MXFP4 experts and MXFP4 dense linears (quant_method "mxfp4"): surogate_hf.formats.quantize_mxfp4;
  transformers' `convert_moe_packed_tensors` is the independent decode oracle in the tests;
- bitsandbytes NF4 (quant_method "bitsandbytes"): bitsandbytes' own quantize_4bit, decoded by its dequantize_4bit.
Each writer returns the dense bf16 model it started from, so tests can compare against it.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
import tempfile

from transformers import AutoModelForCausalLM, FineGrainedFP8Config, GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from surogate_hf import formats as F

ARCHS = ("llama", "qwen3")
MOE_ARCH = "qwen3_moe"
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config(arch: str, **overrides):
    # Every linear dimension is a multiple of 128, the block of real fine-grained FP8 exports.
    cfg = _tiny_config(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _tiny_config(arch: str):
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    if arch == "gpt_oss":
        return GptOssConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            max_position_embeddings=64,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
            tie_word_embeddings=False,
            dtype="bfloat16",
        )
    raise ValueError(f"unknown arch {arch!r}")


def dense_model(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random weights with a few outliers so block scales differ from block to block.
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.05)
            if p.dim() >= 2:
                p.view(-1)[:: max(1, p.numel() // 7)] *= 8
    return model.eval()


def _write(path: str, config, tensors: dict, quant_config: dict | None, legacy_modelopt: dict | None = None):
    os.makedirs(path, exist_ok=True)
    config = config.__class__.from_dict(config.to_dict())
    if quant_config is not None:
        config.quantization_config = quant_config
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"), {"format": "pt"})
    if legacy_modelopt is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(legacy_modelopt, f, indent=2)
    return path


def checkpoint_state_dict(model) -> dict:
    """The model's tensors under checkpoint names (e.g. MoE experts split per expert, as save_pretrained writes)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_file(os.path.join(d, "model.safetensors"))


def linear_names(sd: dict) -> list[str]:
    """Checkpoint names of the linear projections (dense layers and per-expert MoE projections)."""
    return [k[: -len(".weight")] for k in sd if k.endswith(".weight") and k.split(".")[-2] in LINEAR_SUFFIXES]


# ---------------------------------------------------------------- fine-grained FP8
def write_fp8(path: str, arch: str, *, block=(128, 128), scale_fmt: str = "float", skip=("lm_head",), seed: int = 0):
    """quant_method "fp8" checkpoint produced by transformers' Fp8Quantize."""
    model = dense_model(arch, seed)
    qcfg = FineGrainedFP8Config(
        weight_block_size=None if block is None else list(block), scale_fmt=scale_fmt, modules_to_not_convert=list(skip)
    )
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=qcfg))
    sd = checkpoint_state_dict(model)
    for name in linear_names(sd):
        out = quantize._quantize_one(f"{name}.weight", sd[f"{name}.weight"])
        assert out[f"{name}.weight"].dtype == torch.float8_e4m3fn, f"{name} was not quantized by the producer"
        sd.update(out)
    _write(path, model.config, sd, qcfg.to_dict())
    return model


# ---------------------------------------------------------------- ModelOpt
def modelopt_nvfp4_tensors(w: torch.Tensor, amax: torch.Tensor | None = None) -> dict:
    qt = F.quantize_nvfp4(w, four_over_six=False, amax=amax)
    return {"weight": qt.packed, "weight_scale": qt.block_scale, "weight_scale_2": qt.global_scale.reshape(())}


def modelopt_fp8_tensors(w: torch.Tensor) -> dict:
    q, scale_inv = F.quantize_fp8_tensorwise(w)
    return {"weight": q, "weight_scale": scale_inv.reshape(())}


def write_modelopt(
    path: str,
    arch: str,
    algo: str = "NVFP4",
    *,
    exclude=("lm_head",),
    legacy: bool = False,
    mixed: dict | None = None,
    seed: int = 0,
    config_overrides: dict | None = None,
    fused_amax: bool = False,
):
    """ModelOpt export. `algo` NVFP4, FP8 or MIXED_PRECISION (then `mixed` maps a suffix like 'q_proj'
    to 'NVFP4' / 'FP8'; linears not named stay bf16 and are absent from quantized_layers).
    `legacy` writes hf_quant_config.json and no quantization_config in config.json. A linear whose in_features
    the format cannot block (config_overrides) is written dense, as no exporter could have quantized it.
    `fused_amax`: MoE gate_proj / up_proj of one expert share their NVFP4 global scale (ModelOpt unifies the
    amax of layers that inference engines fuse), else each has its own."""
    model = dense_model(arch, seed, **(config_overrides or {}))
    sd = checkpoint_state_dict(model)
    dense_sd = dict(sd)
    layers = {}
    for name in linear_names(sd):
        if any(name == e or name.startswith(e + ".") for e in exclude):
            continue
        layer_algo = algo if algo != "MIXED_PRECISION" else (mixed or {}).get(name.rsplit(".", 1)[-1])
        if layer_algo is None or (layer_algo == "NVFP4" and sd[f"{name}.weight"].shape[1] % 16):
            continue
        w = sd.pop(f"{name}.weight")
        amax = None
        if fused_amax and name.endswith(("gate_proj", "up_proj")) and ".experts." in name:
            base = name.rsplit(".", 1)[0]
            amax = torch.stack([dense_sd[f"{base}.{c}.weight"].float().abs().amax() for c in ("gate_proj", "up_proj")]).amax()
        parts = modelopt_nvfp4_tensors(w, amax) if layer_algo == "NVFP4" else modelopt_fp8_tensors(w)
        # Static activation global scale from a calibration-like amax.
        parts["input_scale"] = torch.tensor(3.0 / (6 * 448.0) if layer_algo == "NVFP4" else 3.0 / 448.0)
        sd.update({f"{name}.{k}": v for k, v in parts.items()})
        layers[name] = {"quant_algo": layer_algo, **({"group_size": 16} if layer_algo == "NVFP4" else {})}
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": list(exclude)}
    if algo == "NVFP4":
        quant["group_size"] = 16
    if algo == "MIXED_PRECISION":
        quant["quantized_layers"] = layers
    if legacy:
        _write(path, model.config, sd, None, {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant})
    else:
        _write(path, model.config, sd, {"quant_method": "modelopt", **quant})
    return model


# ---------------------------------------------------------------- GPT-OSS MXFP4
def write_gpt_oss_mxfp4(path: str, seed: int = 0):
    """GPT-OSS layout: experts `{base}_blocks` uint8 [E, rows, K/32, 16] and `{base}_scales` uint8 [E, rows, K/32].

    rows index the projection's output features, K its input features (the module keeps [E, K, rows])."""
    model = dense_model("gpt_oss", seed)
    sd = dict(model.state_dict())
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(key).transpose(1, 2)  # [E, rows, K]
        packed, scales = F.quantize_mxfp4(w)
        e, rows, k = w.shape
        sd[f"{key}_blocks"] = packed.reshape(e, rows, k // 32, 16)
        sd[f"{key}_scales"] = scales
    skip = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    _write(path, model.config, sd, {"quant_method": "mxfp4", "modules_to_not_convert": skip})
    return model


# ---------------------------------------------------------------- MXFP4 dense linears
def write_mxfp4_linears(path: str, arch: str, *, only=LINEAR_SUFFIXES, skip=("lm_head",), seed: int = 0):
    """quant_method "mxfp4" with dense linears packed as weight uint8 [N, K/2] + weight_scale E8M0 uint8 [N, K/32]
    (surogate_hf.formats.quantize_mxfp4). Linears whose suffix is not in `only` are stored bf16 and not listed in
    modules_to_not_convert: transformers' reading of "mxfp4" quantizes packed tensors only."""
    model = dense_model(arch, seed)
    sd = checkpoint_state_dict(model)
    for name in linear_names(sd):
        if name.rsplit(".", 1)[-1] not in only:
            continue
        packed, scales = F.quantize_mxfp4(sd[f"{name}.weight"])
        sd[f"{name}.weight"], sd[f"{name}.weight_scale"] = packed, scales
    _write(path, model.config, sd, {"quant_method": "mxfp4", "modules_to_not_convert": list(skip)})
    return model


# ---------------------------------------------------------------- bitsandbytes NF4
def write_bnb_nf4(path: str, arch: str, *, double_quant: bool = True, block: int = 64, skip=("lm_head",), seed: int = 0):
    """quant_method "bitsandbytes" (load_in_4bit, nf4) produced by bitsandbytes' own quantize_4bit / QuantState.as_dict,
    as transformers saves Linear4bit. Only nn.Linear modules are quantized (MoE experts stay bf16, as with stock
    transformers); `skip=None` writes no llm_int8_skip_modules."""
    import bitsandbytes.functional as bnbf
    from transformers import BitsAndBytesConfig

    model = dense_model(arch, seed)
    sd = checkpoint_state_dict(model)
    for name in linear_names(sd):
        if ".experts." in name:
            continue
        packed, state = bnbf.quantize_4bit(sd[f"{name}.weight"], blocksize=block, compress_statistics=double_quant,
                                           quant_type="nf4")
        sd[f"{name}.weight"] = packed
        sd.update({f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=None if skip is None else list(skip))
    _write(path, model.config, sd, json.loads(json.dumps(qcfg.to_dict(), default=str)))
    return model


# ---------------------------------------------------------------- editing a written checkpoint
def read_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def rewrite_tensors(path: str, edit) -> None:
    """Apply `edit(tensors) -> tensors` to the checkpoint's safetensors file in place."""
    sd = edit(read_tensors(path))
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"), {"format": "pt"})


def rewrite_quant_config(path: str, edit) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = edit(cfg["quantization_config"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
