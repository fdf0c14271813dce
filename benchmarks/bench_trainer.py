"""The recipes through the HF Trainer (SurogateRecipeCallback, the Trainer's default fused AdamW) against the same
model in a plain training loop, side by side in one process: the Trainer must keep the plain loop's ratio to bf16
within 5% (issue target). Qwen3-1.7B shape by default (bench_e2e.SHAPES), random weights, batch 4 x 2048.

--qlora peft,nf4,...: QLoRA through the Trainer instead (bench_e2e's models: PEFT LoRA on the bf16 base, our formats
with bf16 adapters), each against PEFT's Trainer run in the same process, optionally with the Trainer's own compile
switch (--torch-compile-mode default / reduce-overhead: TrainingArguments(torch_compile=True, torch_compile_mode=...),
the whole model compiled by accelerate):
    python benchmarks/bench_trainer.py --shape smollm2-135m --qlora peft,nf4,mxfp4 --torch-compile-mode reduce-overhead
nf4_explicit / mxfp4_explicit: the same with the layers' decode operands unregistered, so a compiled graph takes every
operand of each linear instead of its codes alone (nn.linear.set_registered_graph_route).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import os
import pstats
import shutil
import time

import torch

import bench_e2e as E
from common import attempt, table, time_train_steps, train_step_fn, write_result
from trace_gaps import gap_report


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


TRAINER_KWARGS = {}  # --no-nan-inf-filter


def step_times_note(stamps, warmup, steps) -> str:
    """The timed steps' durations (ms) as median and range: a mean over steps that hides a slow step (a graph
    recorded again, a recompile) shows here. stamps[i]: the host's clock when step i returned (the GPU is waited for
    only at the end of the warm-up and of the timed steps, as a training loop does not wait each step)."""
    ms = sorted((b - a) * 1e3 for a, b in zip(stamps[warmup - 1:warmup + steps - 1], stamps[warmup:warmup + steps]))
    return f"step ms median {ms[len(ms) // 2]:.1f} ({ms[0]:.1f}-{ms[-1]:.1f})"


def phase_note(phases) -> str:
    """Median ms of each part of the timed steps, from the Trainer's callbacks: forward + backward (with the loss's
    isnan check, which waits for the GPU, and the FLOPs count), the clip and optimizer step, the scheduler and
    zero_grad, and from one step's end to the next one's begin (logging checks, the next batch)."""
    full = [p for p in phases if len(p) == 4]
    if not full:
        return "phases: n/a"
    parts = [sorted((p[i + 1] - p[i]) * 1e3 for p in full) for i in range(3)]
    gaps = sorted((b[0] - a[3]) * 1e3 for a, b in zip(full, full[1:]))
    med = [ms[len(ms) // 2] for ms in parts] + [gaps[len(gaps) // 2] if gaps else float("nan")]
    return "phases ms fwd+bwd {:.1f} / optimizer {:.1f} / zero_grad {:.1f} / between steps {:.1f}".format(*med)


def trainer_rounds(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None, profile_to=None):
    """A Trainer for the setup and a function that runs it once more (`Trainer.train()` again, the compiled model,
    its CUDA graphs and the process kept: `warmup` steps, then `steps` timed ones) and returns (tokens/s, note: its
    optimizer, the steps' durations). model: a built model (QLoRA) instead of the bf16 base with `recipe`'s callback;
    compile_mode: the Trainer's torch_compile with this mode; profile_to: a file for torch.profiler's tables of two
    more steps after the timed ones (each round)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from surogate_hf.integrations.trainer import SurogateRecipeCallback

    stamps, prof, phases, marks = [], [], [], []

    def mark(phase):
        # while torch.profiler runs: the Trainer's step phases as annotations of its trace (trace_gaps reads them)
        while marks:
            marks.pop().__exit__(None, None, None)
        if phase and prof and isinstance(prof[-1], torch.profiler.profile):
            marks.append(torch.profiler.record_function("phase:" + phase))
            marks[-1].__enter__()

    class Clock(TrainerCallback):
        # the host's clock at each callback of a step (no wait for the GPU added): phases[i] = (begin, before the
        # optimizer, after it, end) of step i, so that a gap between setups shows in which part of the Trainer's step
        def on_pre_optimizer_step(self, args, state, control, **kw):
            phases[-1].append(time.perf_counter())
            mark("optimizer")

        def on_optimizer_step(self, args, state, control, **kw):
            phases[-1].append(time.perf_counter())
            mark("zero_grad")

        def on_step_begin(self, args, state, control, **kw):
            phases.append([time.perf_counter()])
            if profile_to and state.global_step == warmup + steps:
                prof.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA]))
                prof[-1].__enter__()
            mark("fwd+bwd")
            if profile_to and state.global_step == warmup + steps + 2:
                prof.append(cProfile.Profile())
                prof[-1].enable()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (warmup, warmup + steps):  # the timed window's two ends
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            phases[-1].append(stamps[-1])
            mark("between steps")
            if prof and state.global_step == warmup + steps + 2:
                mark(None)
                prof[-1].__exit__(None, None, None)
                write_profile_tables(prof.pop(), profile_to)
            if prof and state.global_step == warmup + steps + 2 + PYTHON_PROFILED_STEPS:
                prof[-1].disable()
                write_python_profile(prof.pop(), profile_to.replace(".txt", "") + ".python.txt")

    model = E.base_model(layers) if model is None else model
    E.causal_mask_policy()
    compile_kw = {} if compile_mode is None else {"torch_compile": True, "torch_compile_mode": compile_mode}
    args = TrainingArguments(output_dir=out, max_steps=warmup + steps + (2 + PYTHON_PROFILED_STEPS if profile_to else 0),
                             per_device_train_batch_size=batch, learning_rate=1e-5, report_to=[], save_strategy="no",
                             logging_steps=10_000, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
                             **compile_kw, **TRAINER_KWARGS)
    callbacks = [Clock()] + ([SurogateRecipeCallback(recipe)] if recipe else [])
    t = Trainer(model=model, args=args, train_dataset=_Ids(batch * args.max_steps, seq, E.SHAPES[E.SHAPE][5]),
                callbacks=callbacks)

    def run():
        stamps.clear()
        phases.clear()
        t.train()
        optim = type(t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer).__name__
        return (batch * seq * steps / (stamps[warmup + steps - 1] - stamps[warmup - 1]),
                f"{args.optim} ({optim}); {step_times_note(stamps, warmup, steps)}; "
                f"{phase_note(phases[warmup:warmup + steps])}")

    return t, run


def trainer(recipe, layers, batch, seq, warmup, steps, out, model=None, compile_mode=None, profile_to=None):
    """tokens/s of one Trainer run's timed steps (after `warmup`), and a note (trainer_rounds' run, once)."""
    t, run = trainer_rounds(recipe, layers, batch, seq, warmup, steps, out, model, compile_mode, profile_to)
    got = run()
    del t, run
    return got


PYTHON_PROFILED_STEPS = 4  # after the torch.profiler steps: cProfile's Python functions (the wrappers of the
# compiled graphs, CUDA-graph trees, the Trainer's own per-step work), which torch.profiler's op tables do not name


def write_python_profile(prof, path):
    """cProfile's functions over the profiled steps, by own time and by cumulative time."""
    with open(path, "w") as f:
        f.write(f"cProfile of {PYTHON_PROFILED_STEPS} Trainer steps (totals)\n\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=f).sort_stats(key).print_stats(60)
    print(f"python profile: {path}", flush=True)


def write_profile_tables(prof, path):
    """torch.profiler's key averages over the profiled steps (two steps' totals), by host time and by GPU time."""
    ka = prof.key_averages()
    with open(path, "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90) + "\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90) + "\n")
    print(f"profile tables: {path}", flush=True)
    # the timeline: the trace (gzipped) and where in the Trainer's step the GPU idles, and on what host work
    trace = path.replace(".txt", "") + ".trace.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    with open(path.replace(".txt", "") + ".gaps.md", "w") as f:
        f.write(gap_report(trace + ".gz"))
    print(f"trace and GPU idle report: {trace}.gz", flush=True)


def plain_qlora(build, layers, batch, seq, warmup, steps, compile_mode=None):
    """The same QLoRA model in a plain loop (forward, backward, fused AdamW, zero_grad), compiled as the Trainer
    compiles it: tokens/s and the timed steps' durations."""
    if compile_mode is not None:
        E.COMPILE_KWARGS.clear()
        E.COMPILE_KWARGS["mode"] = compile_mode
        build = E.compiled_model(build)
    model = build(layers)
    E.causal_mask_policy()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, E.SHAPES[E.SHAPE][5], (batch, seq), device="cuda")
    step, stamps = train_step_fn(model, ids, opt), []
    for i in range(1, warmup + steps + 1):
        step()
        if i in (warmup, warmup + steps):
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    del model, opt
    return batch * seq * steps / (stamps[-1] - stamps[warmup - 1]), step_times_note(stamps, warmup, steps)


QLORA_BUILDS = {"peft": ("PEFT LoRA, bf16 base, bf16 adapters", lambda L: E.peft_bf16(L, True)),
                **{f: (f"ours {f} QLoRA, bf16 adapters", lambda L, f=f: E.ours_qlora(L, f))
                   for f in ("fp8", "nf4", "nvfp4", "mxfp4")},
                **{f"{f}_explicit": (f"ours {f} QLoRA, bf16 adapters, every operand in the graph",
                                     lambda L, f=f: E._explicit_operands(E.ours_qlora(L, f)))
                   for f in ("nf4", "mxfp4")}}


def qlora_rounds(args, layers, keys):
    """QLoRA through the Trainer, every setup's Trainer built once and run again round by round (--rounds): the first
    round compiles (and records the CUDA graphs), the later ones are timed; each setup's median over them and its
    ratio to PEFT's, and PEFT's ratio per round (a process's host speed drifts by 10-20% between minutes, which
    setups run in one order would read as their difference)."""
    errors, runs, trainers = {}, {}, {}
    for rnd in range(args.rounds):
        for key in keys:
            label = QLORA_BUILDS[key][0]
            if label in errors:
                continue
            if key not in trainers:
                got = attempt(label, lambda: trainer_rounds(None, layers, args.batch, args.seq, args.warmup,
                                                            args.steps, f"/tmp/bench_trainer_{key}",
                                                            model=QLORA_BUILDS[key][1](layers),
                                                            compile_mode=args.torch_compile_mode), errors)
                if got is None:
                    continue
                trainers[key] = got
            t0 = time.perf_counter()
            got = attempt(label, trainers[key][1], errors)
            if got is None:
                trainers.pop(key)
                print(f"{label}: FAILED {errors[label]}", flush=True)
                continue
            if rnd > 0:
                runs.setdefault(key, []).append(got)
            print(f"{label}: {got[0]:,.0f} tok/s {got[1]} (round {rnd + 1}{', untimed' if rnd == 0 else ''}, "
                  f"{time.perf_counter() - t0:.0f}s)", flush=True)
            rounds_report(args, layers, keys, runs, errors)
    rounds_report(args, layers, keys, runs, errors)


def rounds_report(args, layers, keys, runs, errors):
    medians = {k: sorted(r[0] for r in got)[(len(got) - 1) // 2] for k, got in runs.items()}
    peft = medians.get("peft")
    rows = []
    for key in keys:
        label = QLORA_BUILDS[key][0]
        got = runs.get(key, [])
        per_round = " / ".join(f"{a[0]:,.0f}" for a in got)
        ratios = (" / ".join(f"{a[0] / b[0]:.3f}" for a, b in zip(got, runs.get("peft", []))) if key != "peft"
                  else "")
        rows.append([label, medians.get(key), medians[key] / peft if peft and key in medians and key != "peft"
                     else None, per_round, ratios, got[-1][1] if got else errors.get(label, "")])
    mode = args.torch_compile_mode
    body = (f"{args.shape} shape, {layers} layers, batch {args.batch} x {args.seq}, through the HF Trainer"
            + (f" with torch_compile=True, torch_compile_mode={mode!r}" if mode else " (eager)")
            + f"; every setup's Trainer built once and trained {args.rounds} times in turn (`Trainer.train()` again: "
            f"{args.warmup} warm-up + {args.steps} timed steps each), the first round untimed (the compile)"
            + ("; use_cache=True" if args.use_cache else "")
            + ("; logging_nan_inf_filter=False" if args.no_nan_inf_filter else "") + ".\n\n")
    body += table(["setup", "tokens/s (median of the timed rounds)", "x PEFT", "per round", "x PEFT's same round",
                   "last round's note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result(args.name, "QLoRA through the HF Trainer, rounds", body)


def qlora_main(args, layers):
    """QLoRA through the Trainer: each setup's tokens/s and its ratio to PEFT's Trainer run in this process."""
    import torch._dynamo

    errors, res, plain_res = {}, {}, {}
    keys = args.qlora.split(",")
    unknown = [k for k in keys if k not in QLORA_BUILDS]
    if unknown:
        raise SystemExit(f"--qlora: unknown setup(s) {unknown}; expected some of {sorted(QLORA_BUILDS)}")
    if args.rounds > 1:
        if args.plain or args.profile_dir:
            raise SystemExit("--rounds: --plain and --profile-dir apply to one-round runs")
        return qlora_rounds(args, layers, keys)
    for key in keys:
        label, build = QLORA_BUILDS[key]
        torch._dynamo.reset()
        prof = f"{args.profile_dir}/trainer_{key}.txt" if args.profile_dir else None
        got = attempt(label, lambda: trainer(None, layers, args.batch, args.seq, args.warmup, args.steps,
                                             "/tmp/bench_trainer", model=build(layers),
                                             compile_mode=args.torch_compile_mode, profile_to=prof), errors)
        gc.collect()
        torch.cuda.empty_cache()
        if got is not None:
            res[key] = got
            print(f"{label}: {got[0]:,.0f} tok/s {got[1]}", flush=True)
        if args.plain:
            torch._dynamo.reset()
            got = attempt(f"{label}, plain loop", lambda: plain_qlora(build, layers, args.batch, args.seq,
                                                                       args.warmup, args.steps,
                                                                       args.torch_compile_mode), errors)
            gc.collect()
            torch.cuda.empty_cache()
            if got is not None:
                plain_res[key] = got
                print(f"{label}, plain loop: {got[0]:,.0f} tok/s {got[1]}", flush=True)
    peft = res.get("peft", (None,))[0]
    rows = []
    for key in keys:
        label = QLORA_BUILDS[key][0]
        tok, note = res.get(key, (None, errors.get(label, "")))
        plain_tok, plain_note = plain_res.get(key, (None, errors.get(f"{label}, plain loop", "")))
        rows.append([label, tok, tok / peft if tok and peft and key != "peft" else None, 1.0 if key != "peft" else None,
                     note] + ([plain_tok, tok / plain_tok if tok and plain_tok else None, plain_note]
                              if args.plain else []))
    mode = args.torch_compile_mode
    body = (f"{args.shape} shape, {layers} layers, batch {args.batch} x {args.seq}, {args.warmup} warm-up + "
            f"{args.steps} timed steps, through the HF Trainer"
            + (f" with torch_compile=True, torch_compile_mode={mode!r} (the whole model compiled by accelerate)"
               if mode else " (eager)")
            + ("; transformers' stock SDPA mask function" if args.stock_causal_mask else "")
            + ("; use_cache=True" if args.use_cache else "")
            + ("; logging_nan_inf_filter=False" if args.no_nan_inf_filter else "") + ".\n\n")
    body += table(["setup", "tokens/s", "x PEFT (Trainer)", "target", "note"]
                  + (["plain loop tokens/s", "Trainer x plain loop", "plain loop note"] if args.plain else []), rows)
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
    E.add_attention_mask_args(ap)
    ap.add_argument("--no-nan-inf-filter", action="store_true",
                    help="with --qlora: TrainingArguments(logging_nan_inf_filter=False): no isnan/isinf check of "
                         "each step's loss (two host syncs a step)")
    ap.add_argument("--plain", action="store_true",
                    help="with --qlora: also time each model in a plain loop, compiled the same way (Trainer x plain)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --qlora: build each setup's Trainer once and train it this many times in turn, the "
                         "first round untimed (medians of the others; --plain and --profile-dir do not apply)")
    ap.add_argument("--profile-dir", default=None,
                    help="with --qlora: torch.profiler tables of two Trainer steps after the timed ones, then "
                         f"cProfile's functions over {PYTHON_PROFILED_STEPS} more")
    args = ap.parse_args()
    E.SHAPE = args.shape
    E.apply_attention_mask_args(args)
    if args.no_nan_inf_filter:
        TRAINER_KWARGS["logging_nan_inf_filter"] = False
    layers = args.layers or E.SHAPES[args.shape][6]
    if args.qlora:
        return qlora_main(args, layers)
    for opt, val in (("--torch-compile-mode", args.torch_compile_mode), ("--plain", args.plain),
                     ("--profile-dir", args.profile_dir), ("--no-nan-inf-filter", args.no_nan_inf_filter)):
        if val:
            raise SystemExit(f"{opt} applies to --qlora runs (the recipes' Trainer runs are eager)")
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
