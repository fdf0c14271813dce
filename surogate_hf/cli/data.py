"""`surogate-hf sft` data: the config's datasets as tokenized train / eval sets (synthetic tasks, local or Hub
text and instruction records)."""

from __future__ import annotations

import json
from pathlib import Path

def _read_records(d: dict) -> list[dict]:
    p = Path(d["path"])
    if p.is_file():
        text = p.read_text()
        if p.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{p}: expected a JSON list of records")
        return data
    try:
        import datasets as hf_datasets
    except ImportError:
        raise ValueError(f"dataset {d['path']!r} is not a local file and the `datasets` package (needed for Hub "
                         "datasets) is not installed") from None
    ds = hf_datasets.load_dataset(d["path"], d.get("subset"), split=d.get("split", "train"))
    return list(ds)


def _tokenized(d: dict, tokenizer, seq_len: int) -> list[dict]:
    from ..data import IGNORE_INDEX

    out = []
    for r in _read_records(d)[: d.get("samples")]:
        if d["type"] == "text":
            ids = tokenizer(r[d.get("text_field", "text")], truncation=True, max_length=seq_len)["input_ids"]
            labels = list(ids)
        else:
            fmt = d.get("prompt_format", "{instruction}\n{input}\n" if d.get("input_field") else "{instruction}\n")
            prompt = fmt.format(instruction=r[d["instruction_field"]], input=r.get(d.get("input_field") or "", ""))
            p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            a_ids = tokenizer(str(r[d["output_field"]]), add_special_tokens=False)["input_ids"]
            a_ids = a_ids + [tokenizer.eos_token_id]
            ids = (p_ids + a_ids)[:seq_len]
            labels = ([IGNORE_INDEX] * len(p_ids) + a_ids)[:seq_len]
        out.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)})
    return out


class _ListDataset:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def build_data(cfg: dict, tokenizer):
    """(train set, eval set or None, synthetic task eval sets {name: dataset})."""
    import random

    from ..data import SyntheticTaskDataset, TaskSpec

    train, evals, tasks = [], [], {}
    for i, d in enumerate(cfg["datasets"]):
        if d["type"] == "synthetic":
            spec = TaskSpec(**{k: d[k] for k in ("task", "alphabet", "min_len", "max_len") if k in d})
            train.extend(SyntheticTaskDataset(spec, d["samples"], seed=cfg["train_seed"] + i).items)
            eval_seed = cfg["eval_seed"] + 10_000 + i  # disjoint from the training seeds
            tasks[f"{spec.task}[{i}]"] = SyntheticTaskDataset(spec, d["eval_samples"], seed=eval_seed)
        else:
            items = _tokenized(d, tokenizer, cfg["sequence_len"])
            random.Random(cfg["eval_seed"]).shuffle(items)
            n_eval = int(len(items) * cfg["validation_split_ratio"])
            evals.extend(items[:n_eval])
            train.extend(items[n_eval:])
    if not train:
        raise ValueError("the datasets produced no training examples")
    return _ListDataset(train), (_ListDataset(evals) if evals else None), tasks
