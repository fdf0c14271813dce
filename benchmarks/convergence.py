"""Convergence on real text: a real pretrained model fine-tuned on held-out-validated public-domain text,
every precision setup trained from the same weights, on the same batches, with the same seeds.

    python benchmarks/convergence.py --prepare                 # once, needs the network (see convergence_assets.py)
    python benchmarks/convergence.py --prepare --asset-set smollm2-kjv   # once: the held-out model and corpus
    python benchmarks/convergence.py --jobs 3                  # all setups, three at once (one at a time: ~23 min
                                                               # on an H100, ~75 s a setup, host-bound)
    python benchmarks/convergence.py --setups qlora-nf4,qlora-nf4+loftq --steps 100
    python benchmarks/convergence.py --asset-set smollm2-kjv   # the same setups on SmolLM2-135M + the KJV
    python benchmarks/convergence.py --tiny --steps 4          # CPU smoke run: tiny Gemma3 from a config, text
                                                               # the package ships (its docstrings), byte tokens

Asset sets (--asset-set; convergence_assets.py): gemma3-shakespeare (default: Gemma 3 270M on Shakespeare, cache
benchmarks/.convergence_assets) and smollm2-kjv (held out: SmolLM2-135M-Instruct on the King James Bible, cache
benchmarks/.convergence_assets_heldout). --assets names another cache dir; its config.json says which set it holds.

Setups (--setups takes a comma-separated list of names or fnmatch patterns, e.g. 'qlora-*'):
    lora-bf16                 stock PEFT LoRA on the bf16 model: the reference of every LoRA setup
    qlora-<fmt>               SurogateConfig(format=fmt) + prepare_for_training + PEFT, fmt in fp8/nvfp4/mxfp4/nf4
    qlora-<fmt>+loftq         the same, adapters initialised by surogate_hf.loftq_init (--loftq-iters)
    qlora-<fmt>+aa            the same, activation-aware: loftq_init(iters=1, calibration=--aa-windows windows
                              from the end of the train split), the rank-r fit of each layer's output error
    qlora-nf4-absmax          nf4 encoded as bitsandbytes does (nf4_scale_search=False: each block's scale its absmax)
    qlora-<fmt>+gptq          the same calibration, loftq_init(quantizer="gptq"): GPTQ codes for the base on the
                              format's own scales, then the activation-aware adapters on the error GPTQ leaves
    qlora-fp8+fp8-hybrid      QLoRA with a training recipe (apply_recipe on the PEFT model: the base GEMMs follow
                              the recipe, docs/recipes.md; a 128x128 fp8 base keeps its own W8A8 GEMMs);
    qlora-nvfp4+nvfp4         likewise qlora-mxfp4+nvfp4 and qlora-nf4+fp8-hybrid
    qlora-fp8+bf16            the fp8 base under the bf16 recipe: weight-only (the weight decoded to bf16, bf16
                              activations and gradients) instead of the format's own W8A8 1x128 / 128x128 GEMMs
    peft-bnb-nf4              the peer: stock PEFT QLoRA on bitsandbytes NF4 (CUDA + bitsandbytes only)
    full-bf16                 full fine-tune, apply_recipe("bf16"), fp32 masters: the reference of full-*
    full-fp8-hybrid           apply_recipe("fp8-hybrid"), fp32 masters (per-tensor delayed scaling)
    full-fp8-blockwise        apply_recipe("fp8-hybrid", fp8_scaling="blockwise"): DeepSeek-V3's 1x128 / 128x128 tiles
    full-fp8-{margin1,bf16grad}   fp8-hybrid with margin 1; E4M3 forward GEMMs with bf16 backward GEMMs (ablation)
    full-nvfp4                apply_recipe("nvfp4"), fp32 masters (by default the first block and the last two
                              stay in bf16: recipes.config.NVFP4_BF16_ENDS; the last 30% of the steps run the forward
                              in bf16: NVFP4_HIGH_PRECISION_TAIL)
    full-nvfp4-notail         the same with FP4 to the end (fp4_high_precision_tail=0)
    full-nvfp4-{no46,nosr,norht,allfp4}   the nvfp4 recipe without 4/6, without stochastic rounding, without the
                              Hadamard transform, or with every block in FP4 (ablation)
    full-nvfp4-{w2d,w1d,w1d-allfp4}   weights in 16x16 tiles or in 1x16 blocks along each GEMM's reduction dim
                              (fp4_weight_blocks), the latter also with every block in FP4
    full-nvfp4-absmax         the nvfp4 recipe choosing 4/6 by the block's largest error instead of its squared sum
    full-nvfp4-tail{10,20,30} NVIDIA's precision switch: the last 10% / 20% / 30% of the steps run the nvfp4 layers' forward
                              GEMMs in bf16, dgrad and wgrad staying FP4 (fp4_high_precision_tail, recipes.switch)
    full-nvfp4-tail20-all     the same with all three GEMMs in bf16 for the last 20%

Output: a table of final validation loss and the gap in % to the reference (for a full fine-tune under a low-precision
recipe also the same trained weights evaluated with a plain bf16 forward, which separates what training under the
recipe cost from what its forward costs at evaluation), and
benchmarks/results/convergence.json (curves) and convergence.png (plot); --out changes the stem.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import convergence_assets as assets  # noqa: E402

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
ALL_SETUPS = (
    ["lora-bf16"]
    + [f"qlora-{f}" for f in FORMATS]
    + [f"qlora-{f}+loftq" for f in FORMATS]
    + [f"qlora-{f}+aa" for f in FORMATS]
    + [f"qlora-{f}+gptq" for f in FORMATS]
    + ["qlora-nf4-absmax"]
    + ["qlora-fp8+fp8-hybrid", "qlora-fp8+bf16", "qlora-nvfp4+nvfp4", "qlora-mxfp4+nvfp4", "qlora-nf4+fp8-hybrid",
       "peft-bnb-nf4"]
    + ["full-bf16", "full-fp8-hybrid", "full-fp8-blockwise", "full-nvfp4"]
)
# full fine-tune setups: (recipe, knobs). The full-nvfp4-* rows ablate one ingredient of NVIDIA's NVFP4 recipe each
# (issue 16 item 3): 4/6 block scales, stochastic rounding of gradients, the random Hadamard transform of the wgrad
# operands, and the first / last blocks kept in bf16 (allfp4 converts them too).
FULL_SETUPS = {
    "full-bf16": ("bf16", {}),
    "full-fp8-hybrid": ("fp8-hybrid", {}),
    "full-fp8-blockwise": ("fp8-hybrid", {"fp8_scaling": "blockwise"}),
    "full-fp8-margin1": ("fp8-hybrid", {"margin": 1}),
    "full-fp8-bf16grad": ("bf16", {"matmul_dtype": "e4m3", "gradient_dtype": "bf16"}),
    "full-nvfp4": ("nvfp4", {}),  # the recipe's defaults: the precision switch over the last 30% of the steps
    "full-nvfp4-notail": ("nvfp4", {"fp4_high_precision_tail": 0.0}),  # FP4 to the end (the default before b917649)
    "full-nvfp4-no46": ("nvfp4", {"four_over_six": False}),
    "full-nvfp4-nosr": ("nvfp4", {"no_fp4_stochastic_rounding": True}),
    "full-nvfp4-norht": ("nvfp4", {"fp4_rht": False}),
    "full-nvfp4-allfp4": ("nvfp4", {"skip_quant_first_layers": 0, "skip_quant_last_layers": 0}),
    "full-nvfp4-w2d": ("nvfp4", {"fp4_weight_blocks": "2d"}),
    "full-nvfp4-w1d": ("nvfp4", {"fp4_weight_blocks": "1d"}),
    "full-nvfp4-w1d-allfp4": ("nvfp4", {"fp4_weight_blocks": "1d", "skip_quant_first_layers": 0,
                                        "skip_quant_last_layers": 0}),
    "full-nvfp4-absmax": ("nvfp4", {"four_over_six_rule": "abs_max"}),
    # more decoder layers kept in model_dtype than the default (1 first and 2 last: ~16% of Gemma-3-270M's 18,
    # 10% of SmolLM2-135M's 30)
    "full-nvfp4-ends-1-4": ("nvfp4", {"skip_quant_first_layers": 1, "skip_quant_last_layers": 4}),
    "full-nvfp4-ends-2-6": ("nvfp4", {"skip_quant_first_layers": 2, "skip_quant_last_layers": 6}),
    # the precision switch over the run's last steps, scheduled by recipes.schedule_precision in run_setup's loop
    "full-nvfp4-tail10": ("nvfp4", {"fp4_high_precision_tail": 0.1}),
    "full-nvfp4-tail20": ("nvfp4", {"fp4_high_precision_tail": 0.2}),  # the default until the 30% measurement
    "full-nvfp4-tail20-all": ("nvfp4", {"fp4_high_precision_tail": 0.2, "fp4_high_precision_passes": "all"}),
    "full-nvfp4-tail30": ("nvfp4", {"fp4_high_precision_tail": 0.3}),  # = full-nvfp4 (the default), named as measured
}
ALL_SETUPS += [s for s in FULL_SETUPS if s not in ALL_SETUPS]
# QLoRA bases other than a format's defaults: name -> (format, SurogateConfig options)
QLORA_VARIANTS = {"nf4-absmax": ("nf4", {"nf4_scale_search": False})}  # bitsandbytes' own encode (scale = absmax)


def reference_of(setup: str) -> str:
    return "full-bf16" if setup.startswith("full-") else "lora-bf16"


def select_setups(spec: str | None) -> list[str]:
    if not spec:
        return list(ALL_SETUPS)
    chosen = []
    for pat in (s.strip() for s in spec.split(",") if s.strip()):
        hits = [s for s in ALL_SETUPS if fnmatch.fnmatchcase(s, pat)]
        if not hits:
            raise SystemExit(f"--setups: {pat!r} matches no setup; known: {', '.join(ALL_SETUPS)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


# ----------------------------------------------------------------------------- data and model
def tiny_assets(seed: int):
    """A tiny Gemma3 built from a config and byte-level text the package ships (its own docstrings)."""
    import surogate_hf

    text = []
    for path in sorted(Path(surogate_hf.__file__).parent.rglob("*.py")):
        src = path.read_text()
        if src.startswith('"""'):
            text.append(src[3 : src.find('"""', 3)])
    ids = torch.tensor(list("\n".join(text).encode("utf-8")), dtype=torch.long)
    cut = int(len(ids) * 0.9)
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 256,
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }
    return config, None, ids[:cut], ids[cut:]


def write_checkpoint(config: dict, state: dict | None, out_dir: Path, seed: int) -> Path:
    """The bf16 checkpoint every setup loads with from_pretrained (as a user would). The model class is the causal
    LM of config["model_type"] (gemma3_text -> Gemma3ForCausalLM, llama -> LlamaForCausalLM)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k not in ("source", "model_type")})
    torch.manual_seed(seed)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embedding
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def batches(ids: torch.Tensor, seq_len: int, batch: int, steps: int, seed: int):
    """Fixed order: a seeded permutation of the non-overlapping seq_len windows, wrapping around."""
    n = len(ids) // seq_len
    if n < batch:
        raise ValueError(f"{len(ids)} training tokens give {n} windows of {seq_len}, fewer than one batch of {batch}")
    windows = ids[: n * seq_len].view(n, seq_len)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g)
    for s in range(steps):
        idx = order[(torch.arange(batch) + s * batch) % n]
        yield windows[idx]


def val_batches(ids: torch.Tensor, seq_len: int, batch: int, n_seqs: int):
    n = min(len(ids) // seq_len, n_seqs)
    if n < 1:
        raise ValueError(f"{len(ids)} validation tokens are fewer than one window of {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    return [windows[i : i + batch] for i in range(0, n, batch)]


# ----------------------------------------------------------------------------- setups
def build(setup: str, ckpt: Path, args, device: str):
    """(model to train, trainable parameters, learning rate) for one setup."""
    import surogate_hf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear")
    load = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    if setup == "lora-bf16":
        model = AutoModelForCausalLM.from_pretrained(ckpt, **load).to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        model = get_peft_model(model, lora)
        lr = args.lr_lora
    elif setup.startswith("qlora-"):
        fmt, *extras = setup[len("qlora-") :].split("+")
        fmt, options = QLORA_VARIANTS.get(fmt, (fmt, {}))
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, quantization_config=surogate_hf.SurogateConfig(format=fmt, **options), device_map=device, **load
        )
        model = surogate_hf.prepare_for_training(model, gradient_checkpointing=False)
        model = get_peft_model(model, lora)
        for extra in extras:
            if extra == "loftq":
                surogate_hf.loftq_init(model, ckpt, iters=args.loftq_iters)
            elif extra == "aa":
                surogate_hf.loftq_init(model, ckpt, iters=1, calibration=args.calibration, damp=args.aa_damp)
            elif extra == "gptq":  # GPTQ codes for the base, then the activation-aware adapters on what it leaves
                surogate_hf.loftq_init(model, ckpt, iters=1, calibration=args.calibration, damp=args.aa_damp,
                                       quantizer="gptq")
            else:
                surogate_hf.apply_recipe(model, extra)  # (run_setup schedules nvfp4's precision switch)
        lr = args.lr_lora
    elif setup == "peft-bnb-nf4":
        if device != "cuda":
            raise RuntimeError("skipped: bitsandbytes QLoRA needs CUDA")
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        bnb = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
        model = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=bnb, device_map=device, **load)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = get_peft_model(model, lora)
        lr = args.lr_lora
    elif setup.startswith("full-"):
        model = AutoModelForCausalLM.from_pretrained(ckpt, **load).to(device)
        if setup not in FULL_SETUPS:
            raise ValueError(f"unknown setup {setup!r}")
        recipe, knobs = FULL_SETUPS[setup]
        surogate_hf.apply_recipe(model, recipe, master_dtype="fp32", **knobs)
        lr = args.lr_full
    else:
        raise ValueError(f"unknown setup {setup!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, lr


@torch.no_grad()
def evaluate(model, vals, device) -> float:
    model.eval()
    losses = [float(model(input_ids=v.to(device), labels=v.to(device)).loss) for v in vals]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate_in_bf16(model, ckpt: Path, vals, device) -> float:
    """The validation loss of a recipe-trained model's weights under a plain bf16 forward (the stock model loading
    them, no recipe). A low-precision forward taxes a pretrained model's loss before any training step (Gemma-3-270M
    pays ~2.6% for the FP4 one); this separates what training under the recipe cost from what the recipe's own
    forward costs at evaluation."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    missing, _ = plain.load_state_dict(model.state_dict(), strict=False)  # (recipe buffers are extra, never missing)
    if missing:
        raise RuntimeError(f"evaluate_in_bf16: the trained model's state_dict lacks {missing[:5]}")
    loss = evaluate(plain, vals, device)
    del plain
    return loss


def lr_at(step: int, steps: int, base: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def run_setup(setup: str, ckpt: Path, train_ids, vals, args, device: str) -> dict:
    t0 = time.perf_counter()
    model, params, lr = build(setup, ckpt, args, device)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    curve = {"step": [0], "val": [evaluate(model, vals, device)], "train": []}
    model.train()
    from surogate_hf.recipes import schedule_precision

    for step, ids in enumerate(batches(train_ids, args.seq_len, args.batch, args.steps, args.seed)):
        # the nvfp4 precision switch, where a setup asks for one
        if schedule_precision(model, step, args.steps) and "precision_switch_step" not in curve:
            curve["precision_switch_step"] = step
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, lr)
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve["train"].append(float(loss))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve["step"].append(step + 1)
            curve["val"].append(evaluate(model, vals, device))
            print(f"  {setup:24s} step {step + 1:4d}  train {curve['train'][-1]:.4f}  val {curve['val'][-1]:.4f}", flush=True)
    if not math.isfinite(curve["val"][-1]):
        raise FloatingPointError(f"{setup}: validation loss is {curve['val'][-1]}")
    curve["final"] = curve["val"][-1]
    curve["seconds"] = time.perf_counter() - t0
    if setup in FULL_SETUPS and setup != "full-bf16":  # every low-precision full fine-tune (timed apart from the above)
        curve["final_bf16_forward"] = evaluate_in_bf16(model, ckpt, vals, device)
    del model, opt, params
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return curve


# ----------------------------------------------------------------------------- report
def run_guarded(setup: str, ckpt: Path, train_ids, vals, args) -> dict:
    """run_setup, with a failure reported as the setup's result (in the table, never dropped). Module level: the
    --jobs workers are spawned processes and receive it by name."""
    try:
        return run_setup(setup, ckpt, train_ids, vals, args, args.device)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not msg.startswith("skipped"):
            traceback.print_exc()
            msg = f"error: {type(e).__name__}: {msg}"
        print(f"  {setup}: {msg}", flush=True)
        return {"error": msg[:200]}


def gaps(results: dict) -> dict:
    for name, r in results.items():
        ref = results.get(reference_of(name), {})
        if "final" in r and "final" in ref:
            r["reference"] = reference_of(name)
            r["gap_pct"] = 100.0 * (r["final"] - ref["final"]) / ref["final"]
            if "final_bf16_forward" in r:
                r["gap_bf16_forward_pct"] = 100.0 * (r["final_bf16_forward"] - ref["final"]) / ref["final"]
    return results


def table(results: dict) -> str:
    lines = ["| setup | val loss start | val loss final | reference | gap to reference | the same weights, bf16 forward "
             "| time (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | | | | {r['error']} | | |")
            continue
        gap = "(reference)" if r.get("reference") == name else (f"{r['gap_pct']:+.2f}%" if "gap_pct" in r else "n/a")
        bf16 = (f"{r['final_bf16_forward']:.4f} ({r['gap_bf16_forward_pct']:+.2f}%)" if "gap_bf16_forward_pct" in r
                else "")
        lines.append(f"| {name} | {r['val'][0]:.4f} | {r['final']:.4f} | {r.get('reference', '')} | {gap} | {bf16} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, group in zip(axes, ("LoRA / QLoRA", "full fine-tune")):
        for name, r in results.items():
            if "final" not in r or (name.startswith("full-") != (group == "full fine-tune")):
                continue
            ref = name == reference_of(name)
            label = f"{name} ({r['final']:.3f}" + ("" if ref else f", {r['gap_pct']:+.2f}%") + ")"
            ax.plot(r["step"], r["val"], label=label, lw=2.5 if ref else 1.2, color="k" if ref else None,
                    ls="--" if "loftq" in name else "-")
        ax.set_title(group)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="download and cache the model and text, then exit")
    ap.add_argument("--asset-set", choices=list(assets.ASSET_SETS), default=None,
                    help=f"model + corpus (default {assets.DEFAULT_SET}; smollm2-kjv is the held-out set); "
                         f"picks the default --assets dir")
    ap.add_argument("--assets", type=Path, default=None,
                    help="the cache --prepare writes (default: the asset set's, e.g. benchmarks/.convergence_assets)")
    ap.add_argument("--tiny", action="store_true", help="tiny model from a config + text the package ships (no cache)")
    ap.add_argument("--setups", default=None, help="comma-separated names or patterns (default: all)")
    ap.add_argument("--layers", type=int, default=None,
                    help="use the first N decoder layers (default all: Gemma 18, SmolLM2 30); a cut model starts at a "
                         "loss far above the full model's (Gemma ~25): smoke tests only")
    ap.add_argument("--steps", type=int, default=None, help="default 200 (tiny: 4)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8, tiny 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 512 (tiny 32)")
    ap.add_argument("--eval-every", type=int, default=None, help="default 20 (tiny 2)")
    ap.add_argument("--val-seqs", type=int, default=None, help="validation windows (default 64, tiny 4)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr-lora", type=float, default=2e-4)
    ap.add_argument("--lr-full", type=float, default=2e-5)
    ap.add_argument("--loftq-iters", type=int, default=3)
    ap.add_argument("--aa-windows", type=int, default=8, help="calibration windows of the +aa setups (train split)")
    ap.add_argument("--aa-damp", type=float, default=0.01,
                    help="damping of the +aa setups' input second moment (share of its mean diagonal)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "convergence", help="stem of the .json and .png")
    ap.add_argument("--jobs", type=int, default=1,
                    help="setups trained at once, each in its own process (a 270M run leaves most of an H100 idle; "
                         "the numbers do not change, the time column then includes the other runs' contention)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    asset_set = args.asset_set or assets.DEFAULT_SET
    if args.assets is None:
        args.assets = assets.ASSET_SETS[asset_set].default_dir
    if args.prepare:
        assets.prepare(args.assets, asset_set=asset_set)
        return {}
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per setup drowns the curves
    tiny = args.tiny
    for k, big, small in (("steps", 200, 4), ("batch", 8, 2), ("seq_len", 512, 32), ("eval_every", 20, 2), ("val_seqs", 64, 4)):
        if getattr(args, k) is None:
            setattr(args, k, small if tiny else big)
    setups = select_setups(args.setups)
    # a gap needs its reference, trained in the same run: missing references go first, in ALL_SETUPS order
    refs = {reference_of(s) for s in setups}
    setups = [s for s in ALL_SETUPS if s in refs and s not in setups] + setups

    if tiny:
        config, state, train_ids, val_ids = tiny_assets(args.seed)
        source = "tiny Gemma3 from a config, byte-level text of surogate_hf's docstrings"
    else:
        info = assets.cache_info(args.assets)
        if args.asset_set is not None and info["asset_set"] != args.asset_set:
            raise SystemExit(f"--assets {args.assets} holds the asset set {info['asset_set']!r}, not {args.asset_set!r}")
        args.asset_set = info["asset_set"]  # recorded in the run's meta
        config, state, train_ids, val_ids = assets.load_real(args.assets, args.layers)
        source = (f"{info['model_name']} ({config['num_hidden_layers']} layers, vocab cut to {config['vocab_size']}), "
                  f"{info['corpus_name']}")
    vals = val_batches(val_ids, args.seq_len, args.batch, args.val_seqs)
    n_cal = min(args.aa_windows, len(train_ids) // args.seq_len)
    # the +aa setups' calibration inputs: the last windows of the train split (training text, never validation)
    args.calibration = val_batches(train_ids[len(train_ids) - n_cal * args.seq_len :], args.seq_len, 2, n_cal)
    print(f"convergence: {source}; {args.steps} steps x {args.batch} x {args.seq_len} tokens, device {args.device}")

    results = {}
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "calibration"}
    meta.update(source=source, device_name=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                torch=torch.__version__)

    def save(res):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))

    with tempfile.TemporaryDirectory(prefix="convergence_ckpt_") as tmp:
        ckpt = write_checkpoint(config, state, Path(tmp), args.seed)
        del state
        if args.jobs == 1:
            for setup in setups:
                results[setup] = run_guarded(setup, ckpt, train_ids, vals, args)
                save(results)  # after every setup: a run cut short by a time limit keeps what it measured
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
                running = {pool.submit(run_guarded, s, ckpt, train_ids, vals, args): s for s in setups}
                for done in cf.as_completed(running):
                    results[running[done]] = done.result()
                    save(results)
            results = {s: results[s] for s in setups}  # the table in setup order, whatever finished first
    gaps(results)
    print(table(results))
    save(results)
    plot(results, args.out.with_suffix(".png"), f"{source}; {args.steps} steps, seed {args.seed}")
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
