"""End-to-end training step on a model built from a real config (random weights; --shape picks a row of
shared/notes/shapes.md, each with its own architecture; default the Qwen3-1.7B shape), batch 4 x 2048, LoRA r=16
on all seven projections; plus full fine-tuning. tokens/s and peak memory; every surogate_hf warning a setup
raised (a slower path taken) goes into its row.
Targets: each QLoRA format >= 1.0x PEFT LoRA on a bf16 base with bf16 adapters, eager and compiled (issue 13),
fp8 QLoRA + fp8-hybrid >= 1.25x (issue 12); our nf4 QLoRA >= 1.5x PEFT + bitsandbytes NF4 QLoRA (stock); full
fine-tune fp8-hybrid >= 1.15x bf16 and >= 1.10x torchao float8 under torch.compile. Every setup runs in this one
process; failures are reported. Compiled setups: `_compiled` compiles each decoder layer, `_compiled_model` the whole
model (as TrainingArguments(torch_compile=True) does); --compile-mode reduce-overhead adds CUDA graphs, which a small
model's host-bound step needs, and --use-cache keeps SDPA's causal mask out of a whole-model graph (USE_CACHE):
    python benchmarks/bench_e2e.py --shape smollm2-135m --compile-mode reduce-overhead --use-cache --gc-off \
        --setups peft_bf16_compiled_model,ours_nf4_compiled_model,ours_mxfp4_compiled_model"""

from __future__ import annotations

import argparse
import contextlib
import os
import json
import gc
import time
import warnings

import torch
from torch import nn

from common import attempt, speed_knobs, table, time_train_steps_cpu, train_step_fn, write_result

import surogate_hf.kernels  # noqa: F401

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


SHAPES = {
    # name: (hidden, intermediate, heads, kv heads, head_dim, vocab, layers, architecture); the rows of
    # shared/notes/shapes.md (up to 8B) with each model's own architecture, plus a 14B for the one-GPU QLoRA rows.
    # qwen3-1.7b / smollm2-135m / llama-3.1-8b results before 2026-11-24 used the qwen3 architecture for all three.
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152, 30, "llama"),
    "smollm2-360m": (960, 2560, 15, 5, 64, 49152, 32, "llama"),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936, 24, "qwen2"),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936, 28, "qwen2"),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936, 28, "qwen3"),
    "qwen3-1.7b": (2048, 6144, 16, 8, 128, 151936, 28, "qwen3"),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256, 16, "llama"),
    "gemma-3-1b": (1152, 6912, 4, 1, 256, 262144, 26, "gemma3"),
    "gemma-2-2b": (2304, 9216, 8, 4, 256, 256000, 26, "gemma2"),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064, 28, "qwen2"),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256, 32, "llama"),
    "qwen3-14b": (5120, 17408, 40, 8, 128, 151936, 40, "qwen3"),
}
UNTIED = ("qwen2.5-7b", "llama-3.1-8b", "qwen3-14b")  # the others tie lm_head to the embedding
SHAPE = "qwen3-1.7b"


def config(layers: int):
    import transformers

    hidden, inter, heads, kv, head_dim, vocab, _, arch = SHAPES[SHAPE]
    cls = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig", "gemma3": "Gemma3TextConfig",
           "gemma2": "Gemma2Config"}[arch]
    return getattr(transformers, cls)(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=SHAPE not in UNTIED,
        max_position_embeddings=4096)


def _attention() -> str:
    # Gemma-2's soft-capped attention has no SDPA path in transformers (HF recommends eager for it)
    return "eager" if SHAPES[SHAPE][7] == "gemma2" else "sdpa"


def base_model(layers: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(config(layers), dtype=torch.bfloat16, attn_implementation=_attention())
    m.config.use_cache = bool(USE_CACHE)
    return m


# --use-cache: keep transformers' default use_cache=True. Under a whole-model compile that decides SDPA's mask: without
# a cache, create_causal_mask checks position_ids for packed sequences, a check a graph cannot run, so it builds the
# [batch, 1, seq, seq] mask and SDPA runs non-causal kernels over it; with a cache it skips the mask (on torch < 2.13
# with surogate_hf.integrations.causal_mask). Eager and per-layer compiles build the mask outside any graph either way.
USE_CACHE = []


def _targets(model):
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in PROJ]


def _lora(model, bf16_adapters: bool):
    from peft import LoraConfig, get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=PROJ, lora_dropout=0.0)
    return get_peft_model(model, cfg, autocast_adapter_dtype=not bf16_adapters)


def peft_bf16(layers, bf16_adapters=True):
    return _lora(base_model(layers), bf16_adapters)


def bnb_nf4(layers, bf16_adapters=False):
    import bitsandbytes as bnb

    model = base_model(layers)
    for name, lin in _targets(model):
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                              compress_statistics=True, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.detach().cpu(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True).cuda()
        model.set_submodule(name, q)
    torch.cuda.empty_cache()
    return _lora(model, bf16_adapters=bf16_adapters)  # stock PEFT QLoRA: fp32 adapters unless asked


def _explicit_operands(model):
    """The model's quantized linears with their decode operands unregistered (nn.linear.set_registered_graph_route):
    compiled, each hands its graph ops every operand instead of its codes alone."""
    from surogate_hf.nn.linear import set_registered_graph_route

    set_registered_graph_route(model, False)
    return model


def ours_qlora(layers, fmt, recipe=None, fused_norms=True, lora_dtype=torch.bfloat16):
    """The user's path: quantized bases, surogate_hf.prepare_for_training (no checkpointing here; it fuses the
    RMSNorms unless fused_norms=False), PEFT LoRA with bf16 adapters, optionally a recipe."""
    from surogate_hf.integrations.peft import set_lora_dtype
    from surogate_hf.nn import linear as L
    from surogate_hf.training import prepare_for_training

    cls = {"fp8": L.FP8Linear, "nvfp4": L.NVFP4Linear, "mxfp4": L.MXFP4Linear, "nf4": L.NF4Linear}[fmt]
    model = base_model(layers)
    for name, lin in _targets(model):
        model.set_submodule(name, cls.from_linear(lin))
    torch.cuda.empty_cache()
    prepare_for_training(model, gradient_checkpointing=False, fused_norms=fused_norms)
    model = _lora(model, lora_dtype == torch.bfloat16)
    set_lora_dtype(model, lora_dtype)
    if recipe is not None:  # QLoRA x recipe: the base GEMMs (and the adapters) in the recipe's precision
        from surogate_hf.recipes.linear import apply_recipe

        apply_recipe(model, recipe, **{**speed_knobs(recipe), **RECIPE_KNOBS})
    return model


RECIPE_KNOBS = {}  # --recipe-knobs: extra apply_recipe knobs for the recipe setups (ablations)
COMPILE_KWARGS = {}  # --compile-mode: torch.compile's mode for the compiled setups (e.g. reduce-overhead: CUDA graphs)


def full(layers, recipe=None, compiled=False, torchao=False, fused_norms_only=False, knobs=None):
    model = base_model(layers)
    if fused_norms_only:  # stock bf16 linears, FusedRMSNorm only: the norm fusion's own share of a recipe's speed-up
        from surogate_hf.recipes.norm import fuse_norms

        fuse_norms(model, None)
    if recipe is not None:
        from surogate_hf.recipes.linear import apply_recipe

        apply_recipe(model, recipe, **{**speed_knobs(recipe), **RECIPE_KNOBS, **(knobs or {})})
    if torchao:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn,
                                   config=Float8LinearConfig.from_recipe_name("tensorwise"))
    if compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * layers)
        for layer in model.model.layers:
            layer.compile(**COMPILE_KWARGS)
    return model


def compiled(build, graph_route=True):
    """The setup with every decoder layer under torch.compile (inductor fuses the norms, RoPE, SwiGLU and the
    LoRA glue around the GEMMs; our quantized linears run as custom ops inside the compiled graph). graph_route=False:
    the quantized bases' decode traced into the graph instead of the extension's decode + GEMM ops
    (nn.linear.COMPILED_DECODED_ROUTE), for the A/B of the `_traced` setups."""

    def make(layers):
        from surogate_hf.nn import linear as L

        torch._dynamo.reset()  # each setup traces its own graphs (the same layer code would reuse another's)
        L.COMPILED_DECODED_ROUTE = graph_route
        # one compiled graph serves every layer; raise the recompile limit in case per-layer guards differ
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * layers)
        model = build(layers)
        for layer in _decoder_layers(model):
            layer.compile(**COMPILE_KWARGS)
        return model

    return make


def compiled_model(build):
    """The whole model under one torch.compile, as TrainingArguments(torch_compile=True) and accelerate's
    TorchDynamoPlugin compile it (torch.compile(model)): one dynamo frame a step instead of one per decoder layer, so
    the frame entry (guard evaluation) and AOTAutograd's runtime wrappers run once, not once a layer."""

    def make(layers):
        from surogate_hf.nn import linear as L

        torch._dynamo.reset()
        L.COMPILED_DECODED_ROUTE = True
        return torch.compile(build(layers), **COMPILE_KWARGS)

    return make


def _decoder_layers(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


SETUPS = {
    "peft_bf16": ("PEFT LoRA, bf16 base, bf16 adapters", lambda L: peft_bf16(L, True), "lora"),
    "peft_bf16_compiled": ("PEFT LoRA, bf16 base, bf16 adapters, compiled layers",
                           compiled(lambda L: peft_bf16(L, True)), "lora"),
    "bnb_nf4": ("PEFT + bitsandbytes NF4 QLoRA (stock, fp32 adapters)", bnb_nf4, "lora"),
    "ours_fp8": ("ours fp8 QLoRA, bf16 adapters", lambda L: ours_qlora(L, "fp8"), "lora"),
    "ours_fp8_compiled": ("ours fp8 QLoRA, bf16 adapters, compiled layers", compiled(lambda L: ours_qlora(L, "fp8")),
                          "lora"),
    "ours_fp8_fp8_hybrid": ("ours fp8 QLoRA + fp8-hybrid recipe, bf16 adapters",
                            lambda L: ours_qlora(L, "fp8", "fp8-hybrid"), "lora"),
    "ours_fp8_bf16": ("ours fp8 QLoRA + bf16 recipe (weight-only: the fp8 base decoded to bf16, bf16 activations), "
                      "bf16 adapters", lambda L: ours_qlora(L, "fp8", "bf16"), "lora"),
    "ours_nf4_fp8_hybrid": ("ours nf4 QLoRA + fp8-hybrid recipe, bf16 adapters",
                            lambda L: ours_qlora(L, "nf4", "fp8-hybrid"), "lora"),
    "ours_nvfp4_nvfp4": ("ours nvfp4 QLoRA + nvfp4 recipe, bf16 adapters (Hopper: exact FP4 operands on bf16 tensor "
                         "cores)", lambda L: ours_qlora(L, "nvfp4", "nvfp4"), "lora"),
    "ours_nf4": ("ours nf4 QLoRA, bf16 adapters", lambda L: ours_qlora(L, "nf4"), "lora"),
    "ours_nf4_fp32_adapters": ("ours nf4 QLoRA, fp32 adapters", lambda L: ours_qlora(L, "nf4", lora_dtype=torch.float32),
                               "lora"),
    "bnb_nf4_bf16_adapters": ("PEFT + bitsandbytes NF4 QLoRA, bf16 adapters", lambda L: bnb_nf4(L, True), "lora"),
    "ours_nf4_stock_norms": ("ours nf4 QLoRA, bf16 adapters, stock RMSNorms (prepare_for_training(fused_norms=False))",
                             lambda L: ours_qlora(L, "nf4", fused_norms=False), "lora"),
    "ours_nf4_compiled": ("ours nf4 QLoRA, bf16 adapters, compiled layers", compiled(lambda L: ours_qlora(L, "nf4")),
                          "lora"),
    "ours_nvfp4": ("ours nvfp4 QLoRA, bf16 adapters", lambda L: ours_qlora(L, "nvfp4"), "lora"),
    "ours_mxfp4": ("ours mxfp4 QLoRA, bf16 adapters", lambda L: ours_qlora(L, "mxfp4"), "lora"),
    **{f"ours_{f}_decode_route": (f"ours {f} QLoRA, bf16 adapters, every forward by decode + cuBLAS "
                                  "(SUROGATE_HF_MIXED_INPUT=0)", lambda L, f=f: ours_qlora(L, f), "lora")
       for f in ("nvfp4", "mxfp4")},
    "ours_nvfp4_compiled": ("ours nvfp4 QLoRA, bf16 adapters, compiled layers",
                            compiled(lambda L: ours_qlora(L, "nvfp4")), "lora"),
    "ours_mxfp4_compiled": ("ours mxfp4 QLoRA, bf16 adapters, compiled layers",
                            compiled(lambda L: ours_qlora(L, "mxfp4")), "lora"),
    **{f"ours_{f}_compiled_traced": (f"ours {f} QLoRA, bf16 adapters, compiled layers, decode traced into the graph",
                                      compiled(lambda L, f=f: ours_qlora(L, f), graph_route=False), "lora")
       for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    **{f"ours_{f}_triton_norms": (f"ours {f} QLoRA, bf16 adapters, FusedRMSNorm on its Triton kernels (the Python "
                                  "autograd.Function, not the extension's C++ op)", lambda L, f=f: ours_qlora(L, f), "lora")
       for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    "peft_bf16_compiled_model": ("PEFT LoRA, bf16 base, bf16 adapters, whole model compiled",
                                 compiled_model(lambda L: peft_bf16(L, True)), "lora"),
    **{f"ours_{f}_compiled_model": (f"ours {f} QLoRA, bf16 adapters, whole model compiled",
                                     compiled_model(lambda L, f=f: ours_qlora(L, f)), "lora")
       for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    # the forward's base GEMM on the mixed-input kernel at every token count (SETUP_ENV): one decode launch and one
    # dense-weight allocation fewer per linear and forward, for host-bound steps (results/host/no_graph_step_s39.md)
    **{f"ours_{f}_compiled_model_mixed_input": (f"ours {f} QLoRA, bf16 adapters, whole model compiled, forward GEMMs "
                                                 "on the mixed-input kernel (SUROGATE_HF_MIXED_INPUT=1)",
                                                 compiled_model(lambda L, f=f: ours_qlora(L, f)), "lora")
       for f in ("nvfp4", "mxfp4", "nf4")},
    # every forward GEMM on decode + cuBLAS (SUROGATE_HF_MIXED_INPUT=0): the A/B side against the default or the
    # `_mixed_input` setups where the rule would take the kernel (results/host/host_bound_default_ab_s40.md)
    **{f"ours_{f}_compiled_model_decode_route": (f"ours {f} QLoRA, bf16 adapters, whole model compiled, forward GEMMs "
                                                  "on decode + cuBLAS (SUROGATE_HF_MIXED_INPUT=0)",
                                                  compiled_model(lambda L, f=f: ours_qlora(L, f)), "lora")
       for f in ("nvfp4", "mxfp4")},
    # the registered-operands route off (nn.linear.set_registered_graph_route): each linear hands the compiled graph
    # every decode operand instead of its codes alone, the A/B side of the default `_compiled_model` setups
    **{f"ours_{f}_compiled_model_explicit": (f"ours {f} QLoRA, bf16 adapters, whole model compiled, every decode "
                                              "operand in the graph (registration off)",
                                              compiled_model(lambda L, f=f: _explicit_operands(ours_qlora(L, f))),
                                              "lora")
       for f in ("nvfp4", "mxfp4", "nf4")},
    "full_bf16": ("full fine-tune bf16, eager", lambda L: full(L), "full"),
    "full_bf16_fused_norms": ("full fine-tune bf16, eager, our FusedRMSNorm only (stock linears)",
                              lambda L: full(L, fused_norms_only=True), "full"),
    "full_fp8": ("full fine-tune ours fp8-hybrid, eager", lambda L: full(L, "fp8-hybrid"), "full"),
    "full_nvfp4": ("full fine-tune ours nvfp4 recipe, eager (Hopper: exact FP4 operands on bf16 tensor cores)",
                   lambda L: full(L, "nvfp4"), "full"),
    "full_fp8_compiled": ("full fine-tune ours fp8-hybrid, compiled layers", lambda L: full(L, "fp8-hybrid", True), "full"),
    "full_nvfp4_compiled": ("full fine-tune ours nvfp4 recipe, compiled layers (Hopper: exact FP4 operands on bf16 "
                            "tensor cores)", lambda L: full(L, "nvfp4", True), "full"),
    "full_fp8_skip_small": ("full fine-tune ours fp8-hybrid, fp8_skip_small_linears (small projections in bf16), eager",
                            lambda L: full(L, "fp8-hybrid", knobs={"fp8_skip_small_linears": True}), "full"),
    "full_fp8_blockwise": ("full fine-tune ours fp8-hybrid, fp8_scaling=blockwise (1x128/128x128), eager",
                           lambda L: full(L, "fp8-hybrid", knobs={"fp8_scaling": "blockwise"}), "full"),
    "full_fp8_blockwise_compiled": ("full fine-tune ours fp8-hybrid, fp8_scaling=blockwise, compiled layers",
                                    lambda L: full(L, "fp8-hybrid", True, knobs={"fp8_scaling": "blockwise"}), "full"),
    "full_bf16_compiled": ("full fine-tune bf16, compiled layers", lambda L: full(L, compiled=True), "full"),
    "full_torchao_compiled": ("full fine-tune torchao float8 tensorwise, compiled layers",
                              lambda L: full(L, compiled=True, torchao=True), "full"),
}
# setup -> [(peer, target ratio), ...]: the first pair measured in the run fills the ratio column, every
# measured pair goes into the note. The peers are eager; compiled peers are listed for honesty.
TARGETS = {
    "ours_fp8": [("peft_bf16", 1.0)],
    "ours_fp8_compiled": [("peft_bf16_compiled", 1.0), ("peft_bf16", 1.0)],
    "ours_nf4": [("bnb_nf4", 1.5), ("bnb_nf4_bf16_adapters", 1.5), ("peft_bf16", 1.0)],
    "ours_nf4_fp32_adapters": [("bnb_nf4", 1.5)],
    "ours_nf4_stock_norms": [("peft_bf16", 1.0)],
    "ours_fp8_fp8_hybrid": [("peft_bf16", 1.25)],
    "ours_fp8_bf16": [("peft_bf16", 1.0), ("ours_fp8", 1.0)],
    "ours_nf4_fp8_hybrid": [("peft_bf16", 1.0)],
    "ours_nvfp4_nvfp4": [("peft_bf16", 0.8), ("ours_nvfp4", 0.8)],
    "ours_nf4_compiled": [("peft_bf16_compiled", 1.0), ("bnb_nf4", 1.5)],
    "ours_nvfp4": [("peft_bf16", 1.0), ("ours_nvfp4_decode_route", 1.0)],
    "ours_mxfp4": [("peft_bf16", 1.0), ("ours_nvfp4", 1.0), ("ours_mxfp4_decode_route", 1.0)],
    "ours_nvfp4_decode_route": [("peft_bf16", 1.0)],
    "ours_mxfp4_decode_route": [("peft_bf16", 1.0)],
    "ours_nvfp4_compiled": [("peft_bf16_compiled", 1.0)],
    "ours_mxfp4_compiled": [("peft_bf16_compiled", 1.0), ("ours_nvfp4_compiled", 1.0)],
    **{f"ours_{f}_compiled_traced": [("peft_bf16_compiled", 1.0), (f"ours_{f}_compiled", 1.0)]
       for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    **{f"ours_{f}_triton_norms": [("peft_bf16", 1.0), (f"ours_{f}", 1.0)] for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    **{f"ours_{f}_compiled_model": [("peft_bf16_compiled_model", 1.0), (f"ours_{f}_compiled", 1.0)]
       for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
    **{f"ours_{f}_compiled_model_mixed_input": [("peft_bf16_compiled_model", 1.0), (f"ours_{f}_compiled_model", 1.0)]
       for f in ("nvfp4", "mxfp4", "nf4")},
    **{f"ours_{f}_compiled_model_decode_route": [("peft_bf16_compiled_model", 1.0)] for f in ("nvfp4", "mxfp4")},
    **{f"ours_{f}_compiled_model_explicit": [("peft_bf16_compiled_model", 1.0)] for f in ("nvfp4", "mxfp4", "nf4")},
    "full_fp8": [("full_bf16", 1.15), ("full_bf16_fused_norms", 1.15)],
    "full_nvfp4": [("full_bf16", 0.8)],
    "full_nvfp4_compiled": [("full_bf16_compiled", 0.8), ("full_nvfp4", 1.0)],
    "full_fp8_compiled": [("full_bf16_compiled", 1.15), ("full_torchao_compiled", 1.10), ("full_bf16", 1.15)],
    "full_fp8_blockwise": [("full_bf16", 1.15), ("full_fp8", 1.0)],
    "full_fp8_blockwise_compiled": [("full_bf16_compiled", 1.15), ("full_fp8_compiled", 1.0)],
}

# a small model with real dims: the fp8-hybrid step must be no slower than the bf16 step (issue 12)
SMALL_MODEL_TARGETS = {
    "full_fp8": [("full_bf16", 1.0), ("full_bf16_fused_norms", 1.0)],
    "full_fp8_skip_small": [("full_bf16", 1.0), ("full_bf16_fused_norms", 1.0)],
    "full_fp8_compiled": [("full_bf16_compiled", 1.0), ("full_bf16", 1.0)],
}


GRAD_CKPT = []  # --grad-ckpt: activation checkpointing on every setup (what fits a big model on one GPU)
PYSPY = {}  # --pyspy: {"dir": where each setup run's samples go, "exe": the py-spy executable, "runs": count per setup}


def pyspy_file(key):
    """The py-spy output of this run of setup `key` under --pyspy (spy_<setup>.txt, then _r2, _r3 for later rounds),
    else None."""
    if not PYSPY:
        return None
    n = PYSPY["runs"][key] = PYSPY["runs"].get(key, 0) + 1
    return os.path.join(PYSPY["dir"], f"spy_{key}{'' if n == 1 else f'_r{n}'}.txt")


# environment a setup runs under (read per call by the extension: an A/B of a path choice in one process, interleaved)
SETUP_ENV = {
    **{f"ours_{f}{c}_decode_route": {"SUROGATE_HF_MIXED_INPUT": "0"} for f in ("nvfp4", "mxfp4")
       for c in ("", "_compiled_model")},
    **{f"ours_{f}_compiled_model_mixed_input": {"SUROGATE_HF_MIXED_INPUT": "1"} for f in ("nvfp4", "mxfp4", "nf4")},
}


@contextlib.contextmanager
def setup_env(key):
    """The process state setup `key` runs under: its SETUP_ENV variables (restored afterwards) and the norm path."""
    from surogate_hf.recipes import norm

    # FusedRMSNorm's eager CUDA path: the extension's C++ op, except in the `_triton_norms` A/B setups
    norm.EXT_RMSNORM = not key.endswith("_triton_norms")
    saved = {name: os.environ.get(name) for name in SETUP_ENV.get(key, {})}
    os.environ.update(SETUP_ENV.get(key, {}))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_setup(key, layers, batch, seq, warmup, steps):
    with setup_env(key):
        return _run_setup(key, layers, batch, seq, warmup, steps)


STOCK_CAUSAL_MASK = []  # --stock-causal-mask


def causal_mask_policy():
    """Every setup, the peers included, runs with surogate_hf's compiled causal-mask skip (integrations/causal_mask.py;
    our entry points install it for our models, so it is installed here for PEFT's too: attention then costs the same
    on both sides), or with transformers' stock mask function under --stock-causal-mask. A no-op on torch >= 2.13."""
    from surogate_hf.integrations import causal_mask as CM

    if STOCK_CAUSAL_MASK:
        CM.uninstall_compiled_causal_mask_skip()
    else:
        CM.install_compiled_causal_mask_skip()


def add_attention_mask_args(ap):
    """--use-cache and --stock-causal-mask (this script's and bench_trainer's): what decides SDPA's mask in a
    whole-model graph."""
    ap.add_argument("--use-cache", action="store_true",
                    help="the models keep use_cache=True (transformers' default; see USE_CACHE)")
    ap.add_argument("--stock-causal-mask", action="store_true",
                    help="transformers' own SDPA mask function on every setup (before torch 2.13 a whole-model compile "
                         "then materializes the causal mask: surogate_hf.integrations.causal_mask)")


def apply_attention_mask_args(args):
    if args.stock_causal_mask:
        STOCK_CAUSAL_MASK.append(True)
    if args.use_cache:
        USE_CACHE.append(True)


class Prepared:
    """A setup's model, optimizer and step, built once (--keep-models: timed again each round without a rebuild)."""

    def __init__(self, key, layers, batch, seq):
        self.model, self.opt, self.step, self.ntrain = _prepare(key, layers, batch, seq)

    def time(self, key, warmup, steps, batch, seq):
        dt, peak, loss, cpu = time_train_steps_cpu(self.step, warmup, steps, pyspy_file(key),
                                                   PYSPY.get("exe", "py-spy"), PYSPY.get("native", False))
        return batch * seq * steps / dt, peak, self.ntrain, float(loss), 1e3 * cpu / steps, 1e3 * dt / steps


def _run_setup(key, layers, batch, seq, warmup, steps):
    return Prepared(key, layers, batch, seq).time(key, warmup, steps, batch, seq)


def _prepare(key, layers, batch, seq):
    model = SETUPS[key][1](layers)
    causal_mask_policy()
    if GRAD_CKPT:
        model.train()
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    ids = torch.randint(0, SHAPES[SHAPE][5], (batch, seq), device="cuda")
    return model, opt, train_step_fn(model, ids, opt), sum(p.numel() for p in params)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16,bnb_nf4,ours_fp8,ours_nf4,full_bf16,full_fp8")
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--traced-gemm", default=None, choices=["aten", "op"],
                    help="how the fp8 recipe's GEMM enters a compiled graph (recipes.fp8_hybrid.TRACED_GEMM)")
    ap.add_argument("--traced-cast", default=None, choices=["inductor", "op"],
                    help="how the fp8 recipe's casts enter a compiled graph (recipes.fp8_hybrid.TRACED_CAST)")
    ap.add_argument("--recipe-knobs", default="{}", help='JSON knobs for apply_recipe, e.g. \'{"fp8_fast_accum": false}\'')
    ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                    help="torch.compile mode of the *_compiled setups (reduce-overhead replays CUDA graphs: no host "
                         "time per kernel, what a host-bound eager step lacks)")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing (non-reentrant) on every setup")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps (default 2; 4 with --compile-mode reduce-overhead: the fp8 recipe recompiles "
                         "once after step 1, when first-step scaling hands over to the history, and CUDA graph trees "
                         "then warm up and record again; measured: recording inside the timed steps read 5,945 tok/s)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every setup this many times, the setups interleaved round by round, and report the "
                         "median tok/s with the spread: host-bound rows (small models) vary by 10-20%% between runs of "
                         "one process, which one round cannot tell from a real difference")
    ap.add_argument("--keep-models", action="store_true",
                    help="build (and compile) every setup's model once, keep them all in memory, and time them round "
                         "by round without a rebuild: one compile per setup however many rounds (each round's block "
                         "after one more untimed step); the peak memory column then counts every kept model")
    add_attention_mask_args(ap)
    ap.add_argument("--gc-off", action="store_true",
                    help="freeze the objects alive after the warm-up and turn Python's garbage collector off for the "
                         "timed steps (common.GC_OFF), in every setup alike")
    ap.add_argument("--pyspy", default=None, metavar="DIR",
                    help="sample each setup run's timed steps with py-spy (attached after the warm-up, so no compile is "
                         "sampled) into DIR/spy_<setup>.txt for analyze_pyspy.py; the sampler slows the timed steps")
    ap.add_argument("--pyspy-exe", default="py-spy", help="the py-spy executable (a name on PATH or a path)")
    ap.add_argument("--pyspy-native", action="store_true", help="--pyspy with C/C++ frames (py-spy --native)")
    ap.add_argument("--name", default="e2e_qwen3_1.7b")
    args = ap.parse_args()
    if args.pyspy_native and not args.pyspy:
        ap.error("--pyspy-native samples with py-spy: it needs --pyspy DIR")
    if args.pyspy:
        os.makedirs(args.pyspy, exist_ok=True)
        PYSPY.update(dir=args.pyspy, exe=args.pyspy_exe, native=args.pyspy_native, runs={})
    if args.gc_off:
        from common import GC_OFF

        GC_OFF.append(True)
    global SHAPE
    SHAPE = args.shape
    RECIPE_KNOBS.update(json.loads(args.recipe_knobs))
    if args.compile_mode:
        COMPILE_KWARGS["mode"] = args.compile_mode
    if args.warmup is None:
        args.warmup = 4 if args.compile_mode == "reduce-overhead" else 2
    if args.grad_ckpt:
        GRAD_CKPT.append(True)
    apply_attention_mask_args(args)
    if args.traced_gemm or args.traced_cast:
        import surogate_hf.recipes.fp8_hybrid as fh

        fh.TRACED_GEMM = args.traced_gemm or fh.TRACED_GEMM
        fh.TRACED_CAST = args.traced_cast or fh.TRACED_CAST
    if args.layers is None:
        args.layers = SHAPES[SHAPE][6]
    errors, warned = {}, {}
    keys = args.setups.split(",")
    runs, kept = {}, {}

    def measure(key, rnd):
        if not args.keep_models:
            return run_setup(key, args.layers, args.batch, args.seq, args.warmup, args.steps)
        with setup_env(key):
            if key not in kept:
                kept[key] = Prepared(key, args.layers, args.batch, args.seq)
            return kept[key].time(key, args.warmup if rnd == 0 else 1, args.steps, args.batch, args.seq)

    for rnd in range(args.rounds):
        for key in keys:
            label = SETUPS[key][0]
            if label in errors:
                continue
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                res = attempt(label, lambda: measure(key, rnd), errors)
            ours = sorted({str(w.message).split("\n")[0][:160] for w in seen if "surogate" in str(w.message)})
            if ours:
                warned[key] = sorted(set(warned.get(key, [])) | set(ours))
                print(f"{label}: WARNED {ours}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            if res is None:
                kept.pop(key, None)
                print(f"{label}: FAILED {errors[label]}", flush=True)
                continue
            runs.setdefault(key, []).append(res)
            print(f"{label}: {res[0]:,.0f} tok/s, peak {res[1]:.1f} GiB, loss {res[3]:.3f}, "
                  f"host CPU {res[4]:.1f} / wall {res[5]:.1f} ms a step "
                  f"({time.perf_counter() - t0:.0f}s{f', round {rnd + 1}' if args.rounds > 1 else ''})", flush=True)
            # the table so far, rewritten after each run: a process stopped by a time limit (whole-model compiles
            # take minutes) still leaves what it measured
            report(args, keys, runs, errors, warned, done=sum(map(len, runs.values())))
    report(args, keys, runs, errors, warned)


def report(args, keys, runs, errors, warned, done=None):
    """Write the result table from the runs so far: medians over rounds, ratios to the peers measured; done: the
    setup runs finished when a partial table is written (None: the run's final table)."""
    measured, tps, spread = {}, {}, {}
    for key, got in runs.items():
        if SETUPS[key][0] in errors:
            continue
        got = sorted(got, key=lambda r: r[0])
        measured[key] = got[(len(got) - 1) // 2]  # the median (the lower one of an even count)
        tps[key] = measured[key][0]
        spread[key] = (got[0][0], got[-1][0])
    rows = []
    for key in keys:  # ratios among the setups measured, whatever their order
        label = SETUPS[key][0]
        if key not in measured:
            rows.append([label, None, None, None, None, None,
                         errors.get(label, "not run yet (the table was written before this setup's turn)")])
            continue
        tok, peak, ntrain, _, _, _ = measured[key]
        cpu = sorted(r[4] for r in runs[key])
        ratio, target, notes = None, None, []
        pairs = SMALL_MODEL_TARGETS.get(key) if SHAPE == "smollm2-135m" else None
        for peer, want in pairs or TARGETS.get(key, []):
            if peer not in tps:
                notes.append(f"peer {peer} not measured in this run")
                continue
            r = tok / tps[peer]
            if ratio is None:
                ratio, target = r, want
            verdict = "meets" if r >= want else f"misses by {want - r:.2f}x"
            notes.append(f"{r:.2f}x {SETUPS[peer][0]} (target {want}): {verdict}")
        if len(runs[key]) > 1:
            notes.append(f"median of {len(runs[key])} rounds, {spread[key][0]:,.0f}-{spread[key][1]:,.0f} tok/s")
        cpu_spread = f"; rounds {cpu[0]:.1f}-{cpu[-1]:.1f}" if len(cpu) > 1 else ""
        notes.append(f"host CPU {cpu[(len(cpu) - 1) // 2]:.1f} ms a step (process time, every thread{cpu_spread}; "
                     f"wall {measured[key][5]:.1f})")
        notes += [f"WARNED: {w}" for w in warned.get(key, [])]
        rows.append([label, tok, peak, ntrain / 1e6, ratio, target, "; ".join(notes)])
    hidden, inter, _, _, _, vocab, _, arch = SHAPES[SHAPE]
    body = (f"Model: {SHAPE} shape ({arch} architecture, {_attention()} attention, {args.layers} layers, hidden {hidden}, intermediate {inter}, vocab {vocab}), "
            f"batch {args.batch} x {args.seq}, AdamW (fused), {args.warmup} warm-up + {args.steps} timed steps, "
            + (f"{args.rounds} rounds (setups interleaved; medians), " if args.rounds > 1 else "")
            + ("every setup's model built and compiled once and kept (--keep-models: later rounds after 1 untimed "
               "step; peak memory counts every kept model), " if args.keep_models else "")
            + ("activation checkpointing" if args.grad_ckpt else "no gradient checkpointing")
            + (f"; compiled setups with mode={args.compile_mode!r}" if args.compile_mode else "")
            + ("; transformers' stock SDPA mask function (--stock-causal-mask)" if args.stock_causal_mask else "")
            + ("; use_cache=True (--use-cache)" if args.use_cache else "")
            + ("; Python's garbage collector frozen and off in the timed steps (--gc-off)" if args.gc_off else "")
            + ("; the timed steps sampled by py-spy (--pyspy: slower than unsampled)" if args.pyspy else "")
            + (f"; traced fp8 casts: {args.traced_cast}" if args.traced_cast else "")
            + (f"; PARTIAL: written after {done} of {args.rounds * len(keys)} setup runs" if done is not None else "")
            + ".\n\n")
    body += table(["setup", "tokens/s", "peak GiB", "trainable M", "ratio", "target", "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result(args.name, f"End-to-end training step, {SHAPE}-shaped model", body)


if __name__ == "__main__":
    main()
