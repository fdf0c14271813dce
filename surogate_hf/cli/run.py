"""`surogate-hf sft` run: model (quantized base, LoRA), Trainer, metrics.json and loss_curve.png."""

from __future__ import annotations

import json
import os
import time

from .data import build_data
from .schema import BUILTIN_PREFIX, OPTIMIZERS, ConfigError, qlora_format, recipe_config, require_cli_extra


def _dtype(cfg: dict, cuda: bool):
    import torch

    name = cfg["torch_dtype"]
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "float32": torch.float32, "fp32": torch.float32}[name]


def surogate_config(cfg: dict):
    fmt = qlora_format(cfg)
    if fmt is None:
        return None
    from ..config import SurogateConfig

    return SurogateConfig(
        format=fmt,
        block_size=(cfg["qlora_block_size"],) * 2,
        four_over_six=cfg["qlora_four_over_six"],
        nf4_block_size=cfg["qlora_bnb_block_size"],
        nf4_double_quant=cfg["qlora_bnb_double_quant"],
        skip_quant_first_layers=cfg["skip_quant_first_layers"] or 0,
        skip_quant_last_layers=cfg["skip_quant_last_layers"] or 0,
    )


def build_model(cfg: dict, dtype, cuda: bool):
    """(model, tokenizer or None, path the adapter refers to)."""
    from transformers import AutoModelForCausalLM

    qc = surogate_config(cfg)
    path = cfg["model"]
    tokenizer = None
    if path.startswith(BUILTIN_PREFIX):
        from ..data import CharTokenizer, build_tiny_model, tiny_llama_config

        # saved and loaded back, so the quantized base comes through the same from_pretrained path as any model
        path = os.path.join(cfg["output_dir"], "base_model")
        tok = CharTokenizer()
        build_tiny_model(tiny_llama_config(tok.vocab_size), seed=cfg["train_seed"]).save_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": dtype}
    if qc is not None:
        kwargs["quantization_config"] = qc
    if cuda:
        kwargs["device_map"] = {"": 0}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs), tokenizer, path

def training_arguments(cfg: dict, cuda: bool, has_eval: bool):
    from transformers import TrainingArguments

    out = cfg["output_dir"]
    warmup = cfg["warmup_steps"] if cfg["warmup_steps"] else cfg["warmup_ratio"]
    return TrainingArguments(
        output_dir=out,
        run_name=cfg["run_name"],
        max_steps=cfg["max_steps"],
        num_train_epochs=cfg["num_epochs"],
        per_device_train_batch_size=cfg["per_device_train_batch_size"],
        per_device_eval_batch_size=cfg["per_device_train_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        learning_rate=cfg["learning_rate"],
        lr_scheduler_type=cfg["lr_scheduler_type"],
        warmup_steps=warmup,
        weight_decay=cfg["weight_decay"],
        max_grad_norm=cfg["max_grad_norm"],
        adam_beta1=cfg["adamw_beta1"],
        adam_beta2=cfg["adamw_beta2"],
        adam_epsilon=cfg["adamw_epsilon"],
        optim=OPTIMIZERS[cfg["optimizer"]],
        logging_steps=cfg["logging_steps"],
        save_strategy="steps" if cfg["save_steps"] else "no",
        save_steps=cfg["save_steps"] or 500,
        save_total_limit=cfg["save_total_limit"],
        eval_strategy="steps" if (has_eval and cfg["eval_steps"]) else "no",
        eval_steps=cfg["eval_steps"] or None,
        seed=cfg["train_seed"],
        dataloader_num_workers=cfg["dataloader_num_workers"],
        report_to=cfg["report_to"] or [],
        use_cpu=not cuda,
        # the model is loaded in its training dtype; LoRA masters are cast per call, so no autocast is needed
        bf16=False,
        fp16=False,
        disable_tqdm=False,
        torch_compile=cfg["torch_compile"] or cfg["use_cuda_graphs"],
        **({"torch_compile_mode": "reduce-overhead"} if cfg["use_cuda_graphs"] else {}),
    )


def _latest_checkpoint(out: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(out) if os.path.isdir(out) else None


def plot_loss(history: list[dict], path: str, title: str) -> None:
    matplotlib = require_cli_extra("matplotlib", "the loss-curve plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(h["step"], h["loss"]) for h in history if "loss" in h]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if pts:
        ax.plot(*zip(*pts), marker=".", label="train loss")
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if evals:
        ax.plot(*zip(*evals), marker="o", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def init_qlora_adapters(model, cfg: dict, base_path: str, train_set, device) -> None:
    """qlora_init: LoftQ adapters fitted to each base's quantization error (loftq), or to each layer's output
    error on the first qlora_init_windows training sequences (activation_aware: on the real-model benchmark
    it cut the 4-bit formats' validation-loss gap to bf16 LoRA by a third; docs/fidelity.md). The dense weights
    are read again from the checkpoint the base was quantized from."""
    import torch

    from ..integrations.loftq import loftq_init

    if not os.path.exists(base_path):  # a Hub id: the snapshot transformers loaded it from (the local cache)
        from huggingface_hub import snapshot_download

        base_path = snapshot_download(base_path, allow_patterns=["*.json", "*.safetensors"])
    calibration = None
    if cfg["qlora_init"] == "activation_aware":
        n = min(cfg["qlora_init_windows"], len(train_set))
        calibration = [torch.tensor([train_set[i]["input_ids"]], device=device) for i in range(n)]
    loftq_init(model, base_path, iters=cfg["qlora_init_iters"], calibration=calibration)


def run_sft(cfg: dict) -> dict:
    import torch
    from transformers import Trainer, set_seed

    from ..data import PadCollator, evaluate_task
    from ..integrations.peft import lora_parameters_dtype, set_lora_dtype
    from ..training import prepare_for_training

    t0 = time.time()
    cuda = torch.cuda.is_available()
    if cfg["use_cuda_graphs"] and not cuda:
        # (torch.compile would silently run without them)
        raise ConfigError("use_cuda_graphs: true needs a CUDA device and none is available; set it to false "
                          "(torch_compile: true compiles without CUDA graphs)")
    out = cfg["output_dir"]
    os.makedirs(out, exist_ok=True)
    set_seed(cfg["train_seed"])
    dtype = _dtype(cfg, cuda)
    model, tokenizer, base_path = build_model(cfg, dtype, cuda)
    model = prepare_for_training(model, gradient_checkpointing=cfg["recompute"])
    if cfg["lora"]:
        from peft import LoraConfig, get_peft_model

        targets = cfg["lora_target_modules"]
        lcfg = LoraConfig(
            r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"], task_type="CAUSAL_LM",
            target_modules="all-linear" if targets in (["all"], ["all-linear"]) else targets,
        )
        model = get_peft_model(model, lcfg)
        set_lora_dtype(model, cfg["lora_dtype"])
    else:
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())

    train_set, eval_set, tasks = build_data(cfg, tokenizer)
    device = next(model.parameters()).device
    if cfg["qlora_init"] != "zero":
        init_qlora_adapters(model, cfg, base_path, train_set, device)
    before = {name: evaluate_task(model, ds) for name, ds in tasks.items()}
    pad = tokenizer.pad_token_id if tokenizer is not None else 0
    callbacks = []
    rcfg = recipe_config(cfg)
    if rcfg is not None:
        from ..integrations.trainer import SurogateRecipeCallback

        callbacks.append(SurogateRecipeCallback(rcfg))
    trainer = Trainer(model=model, args=training_arguments(cfg, cuda, eval_set is not None), train_dataset=train_set,
                      eval_dataset=eval_set, data_collator=PadCollator(pad), callbacks=callbacks)
    eval_before = trainer.evaluate()["eval_loss"] if eval_set is not None else None
    resume = cfg["resume_from_checkpoint"]
    if resume is True:
        resume = _latest_checkpoint(out)
    elif resume is False:
        resume = None
    t_train = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    train_s = time.time() - t_train
    after = {name: evaluate_task(model, ds) for name, ds in tasks.items()}
    eval_after = trainer.evaluate()["eval_loss"] if eval_set is not None else None

    adapter_dir = os.path.join(out, "adapter" if cfg["lora"] else "model")
    model.save_pretrained(adapter_dir)
    merged_dir = None
    if cfg["merge_adapter"]:
        merged = model.merge_and_unload()
        if getattr(merged, "hf_quantizer", None) is not None:
            merged = merged.dequantize()  # layers LoRA did not target are still quantized: export all dense
        merged_dir = os.path.join(out, "merged")
        merged.save_pretrained(merged_dir)

    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    metrics = {
        "model": cfg["model"],
        "base_model_path": base_path,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "qlora_format": qlora_format(cfg),
        "qlora_init": cfg["qlora_init"] if qlora_format(cfg) else None,
        "recipe": None if rcfg is None else rcfg.recipe,
        "lora_dtype": (sorted(str(d).replace("torch.", "") for d in lora_parameters_dtype(model))
                       if cfg["lora"] else None),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": trainer.state.global_step,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "train_loss_mean": result.training_loss,
        "task_metrics_before": before,
        "task_metrics_after": after,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.time() - t0, 2),
        "adapter_dir": adapter_dir,
        "merged_dir": merged_dir,
        "log_history": history,
        "config": cfg,
    }
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2, default=str)
    title = f"{cfg['model']} | qlora={qlora_format(cfg) or 'none'}"
    if tasks:
        name = next(iter(tasks))
        title += f" | {name} exact match {before[name]['exact_match']:.2f} -> {after[name]['exact_match']:.2f}"
    plot_loss(history, os.path.join(out, "loss_curve.png"), title)
    return metrics


def summary(m: dict) -> str:
    lines = [f"surogate-hf sft: {m['steps']} steps on {m['device']} in {m['train_seconds']:.1f}s "
             f"(total {m['total_seconds']:.1f}s)"]
    if m["train_loss_first"] is not None:
        lines.append(f"  train loss {m['train_loss_first']:.4f} -> {m['train_loss_last']:.4f}")
    for name, after in m["task_metrics_after"].items():
        b = m["task_metrics_before"][name]
        lines.append(f"  task {name}: exact match {b['exact_match']:.3f} -> {after['exact_match']:.3f}, "
                     f"token accuracy {b['token_accuracy']:.3f} -> {after['token_accuracy']:.3f}")
    if m["eval_loss_after"] is not None:
        lines.append(f"  eval loss {m['eval_loss_before']:.4f} -> {m['eval_loss_after']:.4f}")
    lines.append(f"  wrote {m['adapter_dir']}, metrics.json and loss_curve.png in {os.path.dirname(m['adapter_dir'])}")
    return "\n".join(lines)
