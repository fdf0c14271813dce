"""Tiny Llama / Qwen3 / Qwen3-MoE / GPT-OSS models built from configs (no downloads), for the tests.

    tiny_config(kind, **overrides)           kind in TINY_KINDS, or "gpt_oss"
    build_tiny_model(kind, seed=0, dtype=torch.bfloat16, **overrides)
    save_tiny_model(kind, path, seed=0, dtype=torch.bfloat16, **overrides) -> path (safetensors + config.json)
    sqnr_db(ref, test)                       10*log10(|ref|^2 / |ref - test|^2), in fp32
    sample_input_ids(vocab_size, batch=2, seq=16, seed=0)
"""

from __future__ import annotations

import torch

TINY_KINDS = ("llama", "qwen3", "qwen3_moe")

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_COMMON, **overrides})


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_COMMON, **overrides})


def tiny_qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    base = dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True)
    return Qwen3MoeConfig(**{**base, **overrides})


def tiny_gpt_oss_config(**overrides):
    """GPT-OSS (fused, transposed, interleaved gate/up experts with biases); not in TINY_KINDS."""
    from transformers import GptOssConfig

    base = dict(_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return GptOssConfig(**{**base, **overrides})


_BUILDERS = {"llama": tiny_llama_config, "qwen3": tiny_qwen3_config, "qwen3_moe": tiny_qwen3_moe_config,
             "gpt_oss": tiny_gpt_oss_config}


def tiny_config(kind: str, **overrides):
    try:
        return _BUILDERS[kind](**overrides)
    except KeyError:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}") from None


def build_tiny_model(kind: str, seed: int = 0, dtype=torch.bfloat16, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    # Random init leaves norms at 1 and MoE routers at 0 (uniform routing); perturb them so routing
    # and every weight matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight") or ".router." in name:
                p.normal_(0, 0.5)
            elif kind == "gpt_oss" and ".experts." in name:  # left at zero by GPT-OSS' init
                p.normal_(0, 0.05)
    return model.to(dtype).eval()


def save_tiny_model(kind: str, path, seed: int = 0, dtype=torch.bfloat16, **overrides):
    model = build_tiny_model(kind, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(str(path))
    return path


def sample_input_ids(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.detach().float(), test.detach().float()
    noise = (ref - test).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
