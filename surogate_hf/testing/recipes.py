"""Tiny models and data for the recipe tests (CPU, seeded; no downloads).

    tiny_mlp(layers=2, dim=32, dtype=fp32)    residual GELU MLP blocks: the smallest model apply_recipe converts
    tiny_llama(seed=0, layers=2)              LlamaForCausalLM, hidden 64, vocabulary VOCAB
    token_batch(step, b=8, seq=32)            token ids, each a fixed permutation of the previous one, 10% noise
    TokenDataset(n=48)                        rows of token_batch for the Trainer ({"input_ids", "labels"})
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64


def tiny_mlp(layers=2, dim=32, dtype=torch.float32):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(layers))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = blocks

        def forward(self, x):
            for b in self.layers:
                x = x + b(x)
            return x

    return M().to(dtype)


def tiny_llama(seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def token_batch(step, b=8, seq=32):
    """Each token a fixed permutation of the previous one, 10% noise: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(1000 + step)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    ids = torch.empty(b, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (b,), generator=g)
    for t in range(1, seq):
        noise = torch.rand(b, generator=g) < 0.1
        ids[:, t] = torch.where(noise, torch.randint(0, VOCAB, (b,), generator=g), perm[ids[:, t - 1]])
    return ids


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=48):
        self.rows = [token_batch(10_000 + i, b=1)[0] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
