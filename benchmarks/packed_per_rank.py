"""Packed base bytes per rank under FSDP2, computed from the slot shapes of meta-device models (no memory, no GPU).

    python benchmarks/packed_per_rank.py            # the table in docs/multigpu.md

Every decoder linear is quantized (lm_head and embeddings stay bf16, as with SurogateConfig's default skips);
FSDP2 splits each packed slot along dim 0 (surogate_hf.distributed.fsdp2_bytes_per_rank, checked against real
shards in tests/test_distributed.py). DDP keeps the whole packed base on every rank (the "1 rank" column).
"""

from __future__ import annotations

import torch

from common import table

from surogate_hf.distributed import fsdp2_bytes_per_rank
from surogate_hf.nn import replace_with_quantized_modules

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads, head_dim, vocab)
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, 128, 151936),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, 128, 128256),
    "Qwen3-32B": (5120, 25600, 64, 64, 8, 128, 151936),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8, 128, 128256),
}
FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
WORLDS = (1, 2, 4, 8)


def meta_model(shape):
    from transformers import LlamaConfig
    from transformers import AutoModelForCausalLM

    h, i, n, heads, kv, hd, vocab = shape
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, vocab_size=vocab, tie_word_embeddings=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def main():
    rows = []
    for name, shape in SHAPES.items():
        for fmt in FORMATS:
            model = meta_model(shape)
            replace_with_quantized_modules(model, fmt, skip=["lm_head"])
            per_world = [max(fsdp2_bytes_per_rank(model, w)) for w in WORLDS]
            rows.append([name, fmt] + [b / 2**30 for b in per_world] + [per_world[1] / per_world[0]])
    print(table(["model", "format"] + [f"{w} rank{'s' if w > 1 else ''} GiB" for w in WORLDS] + ["2 ranks / 1"], rows))


if __name__ == "__main__":
    main()
