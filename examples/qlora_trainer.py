"""Online QLoRA with stock transformers + PEFT calls: quantize a bf16/fp32 checkpoint while it loads, train LoRA
adapters with the HF Trainer, save them, reload them, and export a merged dense model.

    python examples/qlora_trainer.py                        # offline: tiny model + generated task, ~1 min on CPU
    python examples/qlora_trainer.py --format nf4 --optim adamw_bnb_8bit
    python examples/qlora_trainer.py --model Qwen/Qwen3-0.6B --format fp8 --steps 100   # a real model (GPU)

With --model, the data is a toy instruction set written to the output directory (replace it with yours).
"""

import argparse
import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from surogate_hf import SurogateConfig
from surogate_hf.data import (
    CharTokenizer,
    PadCollator,
    SyntheticTaskDataset,
    TaskSpec,
    build_tiny_model,
    evaluate_task,
    tiny_llama_config,
)
from surogate_hf.integrations.peft import merge_to_dense, set_lora_dtype
from surogate_hf.training import prepare_for_training


def data_for(args, tokenizer):
    """(train items, eval dataset with a task metric or None, pad id)."""
    spec = TaskSpec(task="reverse", alphabet=16, min_len=4, max_len=8)
    if args.model is None:
        return SyntheticTaskDataset(spec, 20000, seed=1), SyntheticTaskDataset(spec, 512, seed=2), 0
    # a real tokenizer: the same task written as text, loss on the answer only
    items = []
    for x, y in spec.examples(4000, seed=1):
        p = tokenizer(f"Reverse: {x}\nAnswer:", add_special_tokens=True)["input_ids"]
        a = tokenizer(f" {y}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        items.append({"input_ids": p + a, "labels": [-100] * len(p) + a, "attention_mask": [1] * (len(p) + len(a))})
    return items, None, tokenizer.pad_token_id


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir or Hub id (default: a tiny model built offline)")
    ap.add_argument("--format", default="fp8", choices=["fp8", "nvfp4", "mxfp4", "nf4"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optim", default="adamw_torch", help="e.g. adamw_bnb_8bit (bitsandbytes 8-bit AdamW)")
    ap.add_argument("--lora-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", default="out/qlora_trainer")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    os.makedirs(args.out, exist_ok=True)

    tokenizer, path = None, args.model
    if path is None:  # build a small Llama from a config and save it: no download
        path = os.path.join(args.out, "base")
        build_tiny_model(tiny_llama_config(CharTokenizer().vocab_size), seed=0).save_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    # 1. the base is quantized tensor by tensor as it loads (FP8 128x128 blocks, NVFP4, MXFP4 or NF4)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=SurogateConfig(format=args.format), dtype=dtype,
        device_map={"": 0} if cuda else None,
    )
    # 2. one call instead of prepare_model_for_kbit_training: frozen base, checkpointing, dtypes untouched
    model = prepare_for_training(model, gradient_checkpointing=args.model is not None)
    # 3. stock PEFT: all-linear picks the quantized linears, each wrapped in SurogateLoraLinear
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    set_lora_dtype(model, args.lora_dtype)  # fp32 masters (default) or bf16; compute in the model dtype
    model.print_trainable_parameters()

    train, task_eval, pad = data_for(args, tokenizer)
    if task_eval is not None:
        print("before:", evaluate_task(model, task_eval))
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32, learning_rate=args.lr,
            warmup_steps=20, logging_steps=20, optim=args.optim, report_to=[], save_strategy="no",
            use_cpu=not cuda,
        ),
        train_dataset=train,
        data_collator=PadCollator(pad),
    )
    trainer.train()
    if task_eval is not None:
        print("after:", evaluate_task(model, task_eval))

    # 4. adapters: save, then reload onto a freshly quantized base (PeftModel.from_pretrained)
    model.save_pretrained(os.path.join(args.out, "adapter"))
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format=args.format),
                                                dtype=dtype, device_map={"": 0} if cuda else None)
    reloaded = PeftModel.from_pretrained(base, os.path.join(args.out, "adapter"))
    if task_eval is not None:
        print("reloaded:", evaluate_task(reloaded, task_eval))

    # 5. merged export: dense layers holding dequantize(W) + delta (no requantization, which would round small
    #    deltas away); merge_to_dense also makes untargeted layers dense and drops the quantization config
    merged = merge_to_dense(reloaded)
    merged.save_pretrained(os.path.join(args.out, "merged"))
    assert getattr(merged.config, "quantization_config", None) is None
    print("merged dense checkpoint (loads with stock transformers):", os.path.join(args.out, "merged"))


if __name__ == "__main__":
    main()
