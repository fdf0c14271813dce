"""A QLoRA training step on a Qwen3-0.6B-shaped model (random weights from its config, fp8 base,
LoRA r=16 on all seven projections, batch 4 x 2048): surogate's LoRA layer with lora_dtype=fp32
(fp32 master adapters, compute in bf16) against stock PEFT lora.Linear layers (fp32 adapters, inputs
upcast to fp32) on the very same quantized base. The issue's bar: ours is not slower."""

from __future__ import annotations

import argparse
import gc

import torch
from torch import nn

from common import attempt, table, time_train_steps, train_step_fn, write_result

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script itself
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen3_0_6b(layers: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    m.config.use_cache = False
    return m


def build(fmt: str, ours: bool, layers: int):
    from peft import LoraConfig, get_peft_model

    from surogate_hf.integrations.peft import install_peft_dispatch, set_lora_dtype, uninstall_peft_dispatch
    from surogate_hf.nn import linear as L

    cls = {"fp8": L.FP8Linear, "nvfp4": L.NVFP4Linear, "mxfp4": L.MXFP4Linear, "nf4": L.NF4Linear}[fmt]
    model = qwen3_0_6b(layers)
    for name, lin in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in PROJ]:
        model.set_submodule(name, cls.from_linear(lin))
    for p in model.parameters():
        p.requires_grad_(False)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    (install_peft_dispatch if ours else uninstall_peft_dispatch)()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=PROJ, lora_dropout=0.0))
    if ours:
        set_lora_dtype(model, torch.float32)
    kinds = {type(m).__name__ for m in model.modules() if hasattr(m, "lora_A")}
    return model, ",".join(sorted(kinds))


def run(fmt, ours, layers, batch, seq, warmup, steps):
    model, kinds = build(fmt, ours, layers)
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = ",".join(sorted({str(p.dtype).replace("torch.", "") for p in params}))
    opt = torch.optim.AdamW(params, lr=1e-5, fused=DEVICE == "cuda")
    ids = torch.randint(0, 151936, (batch, seq), device=DEVICE)
    seconds, peak, _ = time_train_steps(train_step_fn(model, ids, opt), warmup, steps)
    tok = batch * seq * steps / seconds
    del model, opt, params
    return tok, peak, kinds, dtypes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8,nvfp4")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    rows, errors = [], {}
    for fmt in args.formats.split(","):
        got = {}
        for ours in (False, True):
            label = f"{fmt} base, " + ("surogate LoRA, lora_dtype fp32" if ours else "stock PEFT lora.Linear (fp32)")
            res = attempt(label, lambda: run(fmt, ours, args.layers, args.batch, args.seq, args.warmup, args.steps), errors)
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            if res is None:
                rows.append([label, None, None, None, None, None, errors[label]])
                continue
            tok, peak, kinds, dtypes = res
            got[ours] = tok
            ratio = tok / got[False] if ours and False in got else None
            note = "" if ratio is None else ("not slower: meets" if ratio >= 1.0 else f"slower by {1 - ratio:.1%}")
            rows.append([label, tok, peak, kinds, dtypes, ratio, note])
            print(label, f"{tok:,.0f} tok/s", flush=True)
    body = (f"Model: Qwen3-0.6B shape ({args.layers} layers, hidden 1024, intermediate 3072, vocab 151936), "
            f"LoRA r=16 on all 7 projections, batch {args.batch} x {args.seq}, fused AdamW, {args.warmup} warm-up + "
            f"{args.steps} timed steps.\n\n")
    body += table(["setup", "tokens/s", "peak GiB", "LoRA layer", "adapter dtypes", "ours / stock", "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result("qlora_lora_dtype_0.6b", "QLoRA step: surogate lora_dtype vs stock PEFT on the same quantized base", body)


if __name__ == "__main__":
    main()
