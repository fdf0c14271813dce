"""GPT-OSS with MXFP4 bases: the MoE experts stay packed MXFP4 (frozen, decoded one expert at a time inside the
op), LoRA adapters train the attention projections through stock PEFT and the HF Trainer.

    python examples/gptoss_mxfp4.py                                   # offline: a tiny GPT-OSS built from a config
    python examples/gptoss_mxfp4.py --model openai/gpt-oss-20b        # the real checkpoint (GPU, ~14 GB of weights)

The tiny model is quantized while it loads (`SurogateConfig(format="mxfp4")`: experts and attention in MXFP4).
The real checkpoint ships its experts pre-quantized in MXFP4 (`{P}_blocks` / `{P}_scales`) and its attention in
bf16: `SurogateConfig()` loads the experts as they are stored, and LoRA then wraps the bf16 attention layers
(`set_lora_dtype` gives them fp32 masters with bf16 compute). LoRA on the expert weights themselves is not
supported (PEFT's target_parameters would parametrize the packed tensors); train attention (and more) instead.
"""

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GptOssConfig, Trainer, TrainingArguments

from surogate_hf import SurogateConfig
from surogate_hf.data import CharTokenizer, PadCollator, SyntheticTaskDataset, TaskSpec, evaluate_task
from surogate_hf.integrations.peft import set_lora_dtype
from surogate_hf.nn import QuantizedExperts, QuantizedLinear
from surogate_hf.training import prepare_for_training


def write_tiny_gptoss(path: str) -> str:
    tok = CharTokenizer()
    cfg = GptOssConfig(
        vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GPT-OSS checkpoint (default: a tiny one built offline)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="out/gptoss_mxfp4")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    os.makedirs(args.out, exist_ok=True)

    if args.model is None:
        path, qc = write_tiny_gptoss(os.path.join(args.out, "base")), SurogateConfig(format="mxfp4")
    else:
        path, qc = args.model, SurogateConfig()  # the checkpoint's own MXFP4 experts
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=dtype,
                                                 device_map={"": 0} if cuda else None)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    print(f"{len(experts)} MXFP4 expert modules, {len(linears)} quantized linears")

    model = prepare_for_training(model, gradient_checkpointing=args.model is not None)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    set_lora_dtype(model, "fp32")
    model.print_trainable_parameters()

    if args.model is not None:
        raise SystemExit("model loaded and adapters attached; plug your tokenized dataset into the Trainer below")
    spec = TaskSpec(task="reverse", alphabet=12, min_len=3, max_len=6)
    train, task_eval = SyntheticTaskDataset(spec, 20000, seed=1), SyntheticTaskDataset(spec, 512, seed=2)
    print("before:", evaluate_task(model, task_eval))
    Trainer(
        model=model,
        args=TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32,
                               learning_rate=3e-3, warmup_steps=20, logging_steps=20, report_to=[],
                               save_strategy="no", use_cpu=not cuda),
        train_dataset=train,
        data_collator=PadCollator(0),
    ).train()
    print("after:", evaluate_task(model, task_eval))
    model.save_pretrained(os.path.join(args.out, "adapter"))


if __name__ == "__main__":
    main()
