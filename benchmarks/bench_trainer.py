"""The recipes through the HF Trainer (SurogateRecipeCallback, the Trainer's default fused AdamW) against the same
model in a plain training loop, side by side in one process: the Trainer must keep the plain loop's ratio to bf16
within 5% (issue target). Qwen3-1.7B shape by default (bench_e2e.SHAPES), random weights, batch 4 x 2048.

--qlora peft,nf4,...: QLoRA through the Trainer instead (bench_e2e's models: PEFT LoRA on the bf16 base, our formats
with bf16 adapters), each against PEFT's Trainer run in the same process, optionally with the Trainer's own compile
switch (--torch-compile-mode default / reduce-overhead: TrainingArguments(torch_compile=True, torch_compile_mode=...),
the whole model compiled by accelerate):
    python benchmarks/bench_trainer.py --shape smollm2-135m --qlora peft,nf4,mxfp4 --torch-compile-mode reduce-overhead
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import bench_e2e as E
from common import attempt, table, time_train_steps, train_step_fn, write_result


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def plain(recipe, layers, batch, seq, warmup, steps):
    model = E.full(layers, recipe)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, E.SHAPES[E.SHAPE][5], (batch, seq), device="cuda")
    dt, _, _ = time_train_steps(train_step_fn(model, ids, opt), warmup, steps)
    del model, opt
    return batch * seq * steps / dt


def trainer(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None):
    """tokens/s of the Trainer's timed steps (after `warmup`), and its optimizer. model: a built model (QLoRA) instead
    of the bf16 base with `recipe`'s callback; compile_mode: the Trainer's torch_compile with this mode."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from surogate_hf.integrations.trainer import SurogateRecipeCallback

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    model = E.base_model(layers) if model is None else model
    compile_kw = {} if compile_mode is None else {"torch_compile": True, "torch_compile_mode": compile_mode}
    args = TrainingArguments(output_dir=out, max_steps=warmup + steps, per_device_train_batch_size=batch,
                             learning_rate=1e-5, report_to=[], save_strategy="no", logging_steps=10_000,
                             disable_tqdm=True, dataloader_num_workers=0, bf16=False, **compile_kw)
    callbacks = [Clock()] + ([SurogateRecipeCallback(recipe)] if recipe else [])
    t = Trainer(model=model, args=args, train_dataset=_Ids(batch * (warmup + steps), seq, E.SHAPES[E.SHAPE][5]),
                callbacks=callbacks)
    t.train()
    optim = type(t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer).__name__
    del t, model
    return batch * seq * steps / (stamps[-1] - stamps[warmup - 1]), f"{args.optim} ({optim})"


QLORA_BUILDS = {"peft": ("PEFT LoRA, bf16 base, bf16 adapters", lambda L: E.peft_bf16(L, True)),
                **{f: (f"ours {f} QLoRA, bf16 adapters", lambda L, f=f: E.ours_qlora(L, f))
                   for f in ("fp8", "nf4", "nvfp4", "mxfp4")}}


def qlora_main(args, layers):
    """QLoRA through the Trainer: each setup's tokens/s and its ratio to PEFT's Trainer run in this process."""
    import torch._dynamo

    errors, res = {}, {}
    keys = args.qlora.split(",")
    unknown = [k for k in keys if k not in QLORA_BUILDS]
    if unknown:
        raise SystemExit(f"--qlora: unknown setup(s) {unknown}; expected some of {sorted(QLORA_BUILDS)}")
    for key in keys:
        label, build = QLORA_BUILDS[key]
        torch._dynamo.reset()
        got = attempt(label, lambda: trainer(None, layers, args.batch, args.seq, args.warmup, args.steps,
                                             "/tmp/bench_trainer", model=build(layers),
                                             compile_mode=args.torch_compile_mode), errors)
        gc.collect()
        torch.cuda.empty_cache()
        if got is not None:
            res[key] = got
            print(f"{label}: {got[0]:,.0f} tok/s {got[1]}", flush=True)
    peft = res.get("peft", (None,))[0]
    rows = []
    for key in keys:
        label = QLORA_BUILDS[key][0]
        tok, note = res.get(key, (None, errors.get(label, "")))
        rows.append([label, tok, tok / peft if tok and peft and key != "peft" else None, 1.0 if key != "peft" else None,
                     note])
    mode = args.torch_compile_mode
    body = (f"{args.shape} shape, {layers} layers, batch {args.batch} x {args.seq}, {args.warmup} warm-up + "
            f"{args.steps} timed steps, through the HF Trainer"
            + (f" with torch_compile=True, torch_compile_mode={mode!r} (the whole model compiled by accelerate)"
               if mode else " (eager)") + ".\n\n")
    body += table(["setup", "tokens/s", "x PEFT (Trainer)", "target", "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result(args.name, "QLoRA through the HF Trainer", body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(E.SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--recipes", default="bf16,fp8-hybrid")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--name", default="trainer_vs_plain")
    ap.add_argument("--qlora", default=None, help="QLoRA setups through the Trainer instead of the recipes, e.g. "
                    f"peft,nf4,mxfp4 (of {','.join(QLORA_BUILDS)}); ratios to peft")
    ap.add_argument("--torch-compile-mode", default=None, choices=["default", "reduce-overhead"],
                    help="with --qlora: the Trainer's torch_compile=True with this torch_compile_mode")
    args = ap.parse_args()
    E.SHAPE = args.shape
    layers = args.layers or E.SHAPES[args.shape][6]
    if args.qlora:
        return qlora_main(args, layers)
    if args.torch_compile_mode:
        raise SystemExit("--torch-compile-mode applies to --qlora runs (the recipes' Trainer runs are eager)")
    errors, res = {}, {}
    for recipe in args.recipes.split(","):
        r = None if recipe == "bf16" else recipe  # bf16 = the model as it is (no recipe applied)
        for where, fn in (("plain loop", lambda r=r: (plain(r, layers, args.batch, args.seq, args.warmup, args.steps), "")),
                          ("Trainer", lambda r=r: trainer(r, layers, args.batch, args.seq, args.warmup, args.steps,
                                                          "/tmp/bench_trainer"))):
            got = attempt(f"{recipe} {where}", fn, errors)
            gc.collect()
            torch.cuda.empty_cache()
            if got is not None:
                res[(recipe, where)] = got
                print(f"{recipe} {where}: {got[0]:,.0f} tok/s {got[1]}", flush=True)
    rows = []
    base = {w: res.get(("bf16", w), (None,))[0] for w in ("plain loop", "Trainer")}
    for recipe in args.recipes.split(","):
        for where in ("plain loop", "Trainer"):
            tok, note = res.get((recipe, where), (None, errors.get(f"{recipe} {where}", "")))
            ratio = tok / base[where] if tok and base[where] else None
            rows.append([recipe, where, tok, ratio, note])
    body = f"{args.shape} shape, {layers} layers, batch {args.batch} x {args.seq}, {args.warmup} warm-up + {args.steps} timed steps.\n\n"
    body += table(["recipe", "loop", "tokens/s", "x bf16 in the same loop", "note"], rows)
    for recipe in args.recipes.split(","):
        p, t = (res.get((recipe, w), (None,))[0] for w in ("plain loop", "Trainer"))
        if recipe != "bf16" and p and t and base["plain loop"] and base["Trainer"]:
            rp, rt = p / base["plain loop"], t / base["Trainer"]
            body += f"\n\n{recipe}: ratio to bf16 {rt:.3f} through the Trainer vs {rp:.3f} in the plain loop: " \
                    f"{abs(rt / rp - 1) * 100:.1f}% apart (target within 5%)"
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result(args.name, "Recipes through the HF Trainer vs a plain loop", body)


if __name__ == "__main__":
    main()
