"""QLoRA linear forward+backward (LoRA r=16, 8192 tokens, 4096->14336 and 14336->4096): our fp8,
nvfp4, mxfp4 and nf4 bases vs PEFT on a bf16 base (bf16 adapters, and stock fp32 adapters) and
bitsandbytes Linear4bit + PEFT. Targets: fp8 >= 1.3x bf16-base PEFT; nf4 >= 1.2x bnb + PEFT;
nvfp4 / mxfp4 >= 0.9x bf16-base PEFT at <= 0.57 bytes/param."""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from common import attempt, bench_ms, layer_step_fn, table, write_result

import surogate_hf.kernels  # noqa: F401

TARGETS = {"fp8": (1.3, "bf16"), "nf4": (1.2, "bnb"), "nvfp4": (0.9, "bf16"), "mxfp4": (0.9, "bf16")}


def lora(model, bf16_adapters: bool):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=["0"], lora_dropout=0.0)
    return get_peft_model(model, cfg, autocast_adapter_dtype=not bf16_adapters)


def peft_bf16(lin, bf16_adapters=True):
    return lora(nn.Sequential(copy.deepcopy(lin)).requires_grad_(False), bf16_adapters)


def bnb_nf4(lin, bf16_adapters=True):
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                          compress_statistics=True, quant_type="nf4", device="cpu")
    q.weight = bnb.nn.Params4bit(lin.weight.detach().cpu(), requires_grad=False, quant_type="nf4",
                                 compress_statistics=True)
    return lora(nn.Sequential(q.cuda()), bf16_adapters)


def ours(lin, fmt):
    from surogate_hf.integrations.peft import install_peft_dispatch, set_lora_dtype
    from surogate_hf.nn import linear as L

    cls = {"fp8": L.FP8Linear, "nvfp4": L.NVFP4Linear, "mxfp4": L.MXFP4Linear, "nf4": L.NF4Linear}[fmt]
    base = cls.from_linear(lin)
    install_peft_dispatch()
    seq = nn.Sequential(base)
    # PEFT reads the model's device from its first Parameter; a lone quantized base holds buffers only
    seq.register_parameter("anchor", nn.Parameter(torch.zeros(1, device=lin.weight.device), requires_grad=False))
    m = lora(seq, True)
    set_lora_dtype(m, torch.bfloat16)
    return m, base.quantized_nbytes() / (lin.in_features * lin.out_features)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    rows, errors = [], {}
    for k, n in ((4096, 14336), (14336, 4096)):
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        ref = {}
        setups = [
            ("PEFT LoRA, bf16 base, bf16 adapters", "bf16", lambda: (peft_bf16(lin, True), 2.0)),
            ("PEFT LoRA, bf16 base, fp32 adapters (stock)", None, lambda: (peft_bf16(lin, False), 2.0)),
            ("bnb NF4 + PEFT, bf16 adapters", "bnb", lambda: (bnb_nf4(lin, True), None)),
            ("bnb NF4 + PEFT, fp32 adapters (stock)", None, lambda: (bnb_nf4(lin, False), None)),
        ] + [(f"ours {f} base + LoRA bf16", f, (lambda f=f: ours(lin, f))) for f in ("fp8", "nvfp4", "mxfp4", "nf4")]
        for name, key, build in setups:
            label = f"{name} [{k}->{n}]"
            built = attempt(label, build, errors)
            if built is None:
                rows.append([name, f"{k}->{n}", None, None, None, None, None, errors.get(label)])
                continue
            m, bpp = built
            ms = attempt(label, lambda m=m: bench_ms(layer_step_fn(m, x, dy)), errors)
            if ms is None:
                rows.append([name, f"{k}->{n}", None, bpp, None, None, None, errors.get(label)])
                continue
            if key in ("bf16", "bnb"):
                ref[key] = ms
            target, ratio, note = None, None, ""
            if name.startswith("ours"):
                target, against = TARGETS[key]
                if against in ref:
                    ratio = ref[against] / ms
                    note = f"vs {'bf16-base PEFT' if against == 'bf16' else 'bnb+PEFT'}: " + (
                        "meets" if ratio >= target else f"misses by {target - ratio:.2f}x")
                if key in ("nvfp4", "mxfp4") and bpp is not None and bpp > 0.57:
                    note += f"; {bpp:.3f} B/param > 0.57"
            rows.append([name, f"{k}->{n}", ms, bpp, ratio, target, None, note])
            del m
        for r in rows:
            if r[1] == f"{k}->{n}" and r[2] is not None and "bf16" in ref:
                r[6] = ref["bf16"] / r[2]
    body = table(["setup", "shape", "fwd+bwd ms", "bytes/param", "ratio vs its peer", "target", "x bf16-base PEFT",
                  "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result("qlora_linear", f"QLoRA linear fwd+bwd, LoRA r=16, {args.tokens} tokens", body)


if __name__ == "__main__":
    main()
