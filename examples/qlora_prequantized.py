"""QLoRA on a pre-quantized checkpoint: the base is trained in the format it was stored in (fine-grained FP8 or
ModelOpt NVFP4), LoRA adapters train on top, and the adapter is reloaded with `model.load_adapter`.

    python examples/qlora_prequantized.py                     # offline: writes a tiny FP8 checkpoint first
    python examples/qlora_prequantized.py --format nvfp4      # ... a ModelOpt NVFP4 one
    python examples/qlora_prequantized.py --model Qwen/Qwen3-8B-FP8 --steps 100     # a Hub FP8 checkpoint (GPU)

`SurogateConfig()` (no format) means "the checkpoint's own format"; adding a format to a pre-quantized
checkpoint would quantize twice and is refused.
"""

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from surogate_hf import SurogateConfig
from surogate_hf.data import CharTokenizer, PadCollator, SyntheticTaskDataset, TaskSpec, build_tiny_model, evaluate_task
from surogate_hf.data import tiny_llama_config
from surogate_hf.integrations.peft import merge_to_dense
from surogate_hf.nn import QuantizedLinear
from surogate_hf.training import prepare_for_training


def write_tiny_prequantized(out: str, fmt: str) -> str:
    """A tiny checkpoint in a standard pre-quantized layout (fp8: quant_method fp8; nvfp4: ModelOpt)."""
    dense = os.path.join(out, "dense")
    build_tiny_model(tiny_llama_config(CharTokenizer().vocab_size), seed=0).save_pretrained(dense)
    path = os.path.join(out, f"prequantized-{fmt}")
    AutoModelForCausalLM.from_pretrained(dense, quantization_config=SurogateConfig(format=fmt)).save_pretrained(path)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a pre-quantized checkpoint (default: a tiny one written offline)")
    ap.add_argument("--format", default="fp8", choices=["fp8", "nvfp4"], help="format of the offline checkpoint")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="out/qlora_prequantized")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    device_map = {"": 0} if cuda else None
    os.makedirs(args.out, exist_ok=True)
    path = args.model or write_tiny_prequantized(args.out, args.format)

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(), dtype=dtype,
                                                 device_map=device_map)
    q = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    print(f"{len(q)} quantized linears, format {q[0].quant_format}, prequantized={q[0].prequantized}")
    model = prepare_for_training(model, gradient_checkpointing=args.model is not None)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))

    if args.model is None:
        spec = TaskSpec(task="reverse", alphabet=16, min_len=4, max_len=8)
        train, task_eval, pad = SyntheticTaskDataset(spec, 20000, seed=1), SyntheticTaskDataset(spec, 512, seed=2), 0
    else:
        tok = AutoTokenizer.from_pretrained(path)
        tok.pad_token = tok.pad_token or tok.eos_token
        train = []
        for x, y in TaskSpec(task="reverse").examples(4000, seed=1):
            p, a = tok(f"Reverse: {x}\nAnswer:")["input_ids"], tok(f" {y}", add_special_tokens=False)["input_ids"]
            a = a + [tok.eos_token_id]
            train.append({"input_ids": p + a, "labels": [-100] * len(p) + a, "attention_mask": [1] * (len(p) + len(a))})
        task_eval, pad = None, tok.pad_token_id
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32,
                               learning_rate=3e-3, warmup_steps=20, logging_steps=20, report_to=[],
                               save_strategy="no", use_cpu=not cuda),
        train_dataset=train,
        data_collator=PadCollator(pad),
    )
    trainer.train()
    model.save_pretrained(os.path.join(args.out, "adapter"))

    # transformers' own adapter API on a fresh load of the same checkpoint
    fresh = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(), dtype=dtype,
                                                 device_map=device_map)
    fresh.load_adapter(os.path.join(args.out, "adapter"))
    if task_eval is not None:
        print("trained:", evaluate_task(model, task_eval))
        print("load_adapter:", evaluate_task(fresh, task_eval))

    # a pre-quantized base cannot take a delta in its own format without losing it: the merge exports dense
    merged = merge_to_dense(model)
    merged.save_pretrained(os.path.join(args.out, "merged-dense"))
    print("merged dense checkpoint:", os.path.join(args.out, "merged-dense"))


if __name__ == "__main__":
    main()
