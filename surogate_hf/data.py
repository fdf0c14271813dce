"""Data the package generates itself (no network): a character vocabulary, synthetic tasks whose success is
measurable, and a tiny causal LM built from a config.

The tasks are sequence transductions over a small alphabet: `<bos> x1..xL > y1..yL <eos>`, with the loss on
the answer (`y`, `<eos>`) only. The metric is exact match: an example counts when every answer token is the
argmax of the teacher-forced logits, which is exactly when greedy decoding reproduces the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

PAD, BOS, EOS, SEP = "<pad>", "<bos>", "<eos>", ">"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = ("reverse", "copy", "sort", "shift")
IGNORE_INDEX = -100


class CharTokenizer:
    """Tokenizer-free character vocabulary: 4 specials then the 26 lowercase letters (ids are stable)."""

    def __init__(self):
        self.itos = [PAD, BOS, EOS, SEP, *LETTERS]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.sep_token_id = 0, 1, 2, 3

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise ValueError(f"CharTokenizer: characters {bad} are not in the vocabulary (lowercase a-z and '>')")
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] for i in ids if int(i) >= 4 or int(i) == self.sep_token_id)


@dataclass(frozen=True)
class TaskSpec:
    """A synthetic task. `alphabet` letters are drawn uniformly; lengths uniformly in [min_len, max_len]."""

    task: str = "reverse"
    alphabet: int = 12
    min_len: int = 3
    max_len: int = 6

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not 2 <= self.alphabet <= len(LETTERS):
            raise ValueError(f"alphabet must be in [2, {len(LETTERS)}], got {self.alphabet}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len} max_len={self.max_len}")

    @property
    def max_seq_len(self) -> int:
        return 2 * self.max_len + 3  # bos, x, sep, y, eos

    def answer(self, x: str) -> str:
        if self.task == "reverse":
            return x[::-1]
        if self.task == "copy":
            return x
        if self.task == "sort":
            return "".join(sorted(x))
        # shift: each letter moved one place along the alphabet (cyclically)
        return "".join(LETTERS[(LETTERS.index(c) + 1) % self.alphabet] for c in x)

    def examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        letters = LETTERS[: self.alphabet]
        out = []
        for _ in range(n):
            x = "".join(rng.choice(letters) for _ in range(rng.randint(self.min_len, self.max_len)))
            out.append((x, self.answer(x)))
        return out


def encode_example(tok: CharTokenizer, prompt: str, answer: str) -> dict[str, list[int]]:
    p = [tok.bos_token_id, *tok.encode(prompt), tok.sep_token_id]
    a = [*tok.encode(answer), tok.eos_token_id]
    return {
        "input_ids": p + a,
        "labels": [IGNORE_INDEX] * len(p) + a,
        "attention_mask": [1] * (len(p) + len(a)),
    }


class SyntheticTaskDataset(torch.utils.data.Dataset):
    """Examples of a TaskSpec, encoded once (deterministic in `seed`)."""

    def __init__(self, spec: TaskSpec, n: int, seed: int, tokenizer: CharTokenizer | None = None):
        self.spec, self.tokenizer = spec, tokenizer or CharTokenizer()
        self.pairs = spec.examples(n, seed)
        self.items = [encode_example(self.tokenizer, x, y) for x, y in self.pairs]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]


class PadCollator:
    """Right-pads input_ids with the pad id, labels with -100 and the attention mask with 0."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(f["input_ids"]) for f in features)
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        return {
            k: torch.tensor([f[k] + [v] * (n - len(f[k])) for f in features], dtype=torch.long)
            for k, v in fill.items()
        }


@torch.no_grad()
def evaluate_task(model, dataset: SyntheticTaskDataset, batch_size: int = 256) -> dict[str, float]:
    """exact_match (greedy decoding reproduces the whole answer), token_accuracy and mean answer loss."""
    was_training = model.training
    model.eval()
    device = next(p.device for p in model.parameters())
    collate = PadCollator(dataset.tokenizer.pad_token_id)
    exact = tokens_ok = tokens = 0
    loss_sum = 0.0
    for s in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(s, min(s + batch_size, len(dataset)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        pred, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        ok = (pred == labels) | ~mask
        exact += int(ok.all(dim=1).sum())
        tokens_ok += int(((pred == labels) & mask).sum())
        tokens += int(mask.sum())
        loss_sum += float(
            torch.nn.functional.cross_entropy(logits[:, :-1][mask], labels[mask], reduction="sum")
        )
    model.train(was_training)
    return {"exact_match": exact / len(dataset), "token_accuracy": tokens_ok / tokens, "loss": loss_sum / tokens}


def tiny_llama_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 4, max_positions: int = 64, **kw):
    """A small Llama config (hidden <= 128, <= 4 layers by default): every projection has K a multiple of 128,
    so every quantized format's block shape fits."""
    from transformers import LlamaConfig

    defaults = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    defaults.update(kw)
    return LlamaConfig(**defaults)


def build_tiny_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised causal LM from `config`, reproducible in `seed`."""
    from transformers import AutoModelForCausalLM

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    return model
