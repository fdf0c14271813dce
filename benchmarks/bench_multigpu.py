"""Multi-GPU training step: 1 GPU vs DDP vs FSDP2 on the same host, side by side in one launch.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_multigpu.py            # GPUs (NCCL)
    accelerate launch --num_processes 2 benchmarks/bench_multigpu.py                 # same thing
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_multigpu.py --tiny     # CPU / gloo check

For every setup (QLoRA on our fp8 / nvfp4 / mxfp4 / nf4 bases, PEFT LoRA on a bf16 base, full fine-tuning
in bf16 and with the fp8-hybrid and nvfp4 recipes) it runs, in this order and in the same processes:
  single  rank 0 alone (the other ranks wait at a barrier): the 1-GPU baseline
  ddp     DDP over every rank (broadcast_buffers=True, the Trainer's default)
  fsdp2   fully_shard per decoder layer + root (surogate_hf.distributed.shard_model), bf16 MixedPrecisionPolicy
and reports tokens/s over all ranks, packed base bytes each rank holds, peak memory per rank, and the
issue's targets: FSDP2 packed bytes per rank <= 0.55x one GPU's; DDP tok/s >= 1.9x one GPU's; DDP fp8 QLoRA
>= 1.1x DDP PEFT LoRA; DDP fp8-hybrid >= 1.1x DDP bf16. The model is a Qwen3-1.7B shape with random weights
(--layers, --hidden, --intermediate to change it), batch per rank x seq tokens per rank per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import os

import torch
import torch.distributed as dist
from torch import nn

from common import attempt, speed_knobs, table, time_train_steps, write_result

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETUPS = {  # key: (label, kind, detail)
    "ours_fp8": ("fp8 QLoRA (ours)", "qlora", "fp8"),
    "ours_nvfp4": ("nvfp4 QLoRA (ours)", "qlora", "nvfp4"),
    "ours_mxfp4": ("mxfp4 QLoRA (ours)", "qlora", "mxfp4"),
    "ours_nf4": ("nf4 QLoRA (ours)", "qlora", "nf4"),
    "peft_bf16": ("PEFT LoRA, bf16 base", "lora", None),
    "full_bf16": ("full fine-tune bf16", "full", None),
    "full_fp8": ("full fine-tune fp8-hybrid", "full", "fp8-hybrid"),
    "full_nvfp4": ("full fine-tune nvfp4 recipe", "full", "nvfp4"),
}
MODES = ("single", "ddp", "fsdp2")
# DDP targets of the issue; nvfp4's is its single-GPU one (>= 0.8x bf16 on Hopper)
PEERS = {"ours_fp8": ("peft_bf16", 1.1), "full_fp8": ("full_bf16", 1.1), "full_nvfp4": ("full_bf16", 0.8)}


def config(args):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                       head_dim=args.hidden // args.heads, vocab_size=args.vocab, tie_word_embeddings=True,
                       max_position_embeddings=max(4096, args.seq))


def _quantized_base(args, device, fmt):
    """The model built on meta, each target linear quantized one at a time from a random dense weight on the
    device, the rest materialized: peak memory ~ the quantized model + one dense linear, so shapes whose bf16
    weights exceed one GPU (the largest-model measurement) can be built."""
    from transformers import AutoModelForCausalLM

    from surogate_hf.nn import LINEAR_CLASSES

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(args), dtype=torch.bfloat16, attn_implementation="sdpa")
    for name in [n for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in PROJ]:
        lin = model.get_submodule(name)
        dense = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device=device, dtype=torch.bfloat16)
        nn.init.normal_(dense.weight, std=0.02)
        model.set_submodule(name, LINEAR_CLASSES[fmt].from_linear(dense))
        del dense
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            t.fill_(1.0) if "norm" in mod_name.rsplit(".", 1)[-1] else nn.init.normal_(t, std=0.02)
            mod._parameters[pname] = nn.Parameter(t, requires_grad=p.requires_grad)
        if "rotary_emb" in mod._modules:  # its inv_freq buffer is computed at construction
            with torch.device(device):
                mod._modules["rotary_emb"] = type(mod.rotary_emb)(config=model.config)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on meta: {left[:4]}")
    return model


def build(key, args, device, mode):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, kind, detail = SETUPS[key]
    torch.manual_seed(0)
    if kind == "qlora":
        from surogate_hf.integrations.peft import install_peft_dispatch

        model = _quantized_base(args, device, detail)
        install_peft_dispatch()
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config(args), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if kind == "full":
        if detail is not None:
            from surogate_hf.recipes.linear import apply_recipe

            # rank 0 alone ("single") must not all_reduce its amaxes with ranks that wait at a barrier (FP8 only: the
            # nvfp4 recipe keeps no amax state across steps)
            apply_recipe(model, detail, **({"reduce_amax": mode != "single"} if detail == "fp8-hybrid" else {}),
                         **speed_knobs(detail))
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=PROJ, lora_dropout=0.0),
                           autocast_adapter_dtype=False)
    if kind == "qlora":
        from surogate_hf.integrations.peft import set_lora_dtype

        set_lora_dtype(model, torch.bfloat16)
    return model


def wrap(model, mode, device):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=True)
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from surogate_hf.distributed import shard_model

        return shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return model


def run(key, mode, args, device):
    """(tokens/s over all ranks, packed local bytes, packed total bytes, peak GiB, DDP broadcast bytes/step)."""
    from surogate_hf.distributed import ddp_broadcast_bytes, packed_base_bytes

    world = 1 if mode == "single" else dist.get_world_size()
    model = wrap(build(key, args, device, mode), mode, device)
    inner = model.module if mode == "ddp" else model
    local, total = packed_base_bytes(inner)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    seconds, peak, _ = time_train_steps(step, args.warmup, args.steps)
    if mode != "single":  # the slowest rank sets the pace
        t = torch.tensor([seconds], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = t.item()
    bcast = ddp_broadcast_bytes(inner) if mode == "ddp" else None
    return {"tok_s": world * args.batch * args.seq * args.steps / seconds, "packed_local": local, "packed_total": total,
            "peak_gib": peak, "ddp_broadcast_bytes": bcast}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (non-reentrant) in every setup")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo): checks the script, times nothing useful")
    ap.add_argument("--json", default=None, help="also write the measurements here (rank 0)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.vocab = 2, 128, 256, 4, 256
        args.batch, args.seq, args.warmup, args.steps = 2, 32, 1, 2

    cuda = torch.cuda.is_available() and not args.tiny
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun / accelerate launch (--nproc-per-node >= 2): the modes compare 1 rank with all")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        import surogate_hf.kernels  # noqa: F401  (registers the CUDA implementations)

    keys, modes = args.setups.split(","), args.modes.split(",")
    results, errors = {}, {}
    for key in keys:
        for mode in modes:
            label = f"{SETUPS[key][0]} / {mode}"
            def measure(key=key, mode=mode):
                return run(key, mode, args, device)

            res = attempt(label, measure, errors) if (mode != "single" or rank == 0) else None
            gc.collect()  # the setup's model and optimizer are gone with run()'s frame
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
            if res is not None:
                results[(key, mode)] = res
                if rank == 0:
                    print(f"{label}: {res['tok_s']:,.0f} tok/s, packed base {res['packed_local'] / 2**20:.2f} / "
                          f"{res['packed_total'] / 2**20:.2f} MiB on rank 0", flush=True)
            elif rank == 0 and label in errors:
                print(f"{label}: FAILED {errors[label]}", flush=True)

    # every rank's packed bytes (FSDP2 shards differ by rank) and peaks, gathered for the table
    mine = {f"{k}|{m}": (r["packed_local"], r["peak_gib"]) for (k, m), r in results.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        rows, out = [], []
        for key in keys:
            single = results.get((key, "single"))
            for mode in modes:
                r = results.get((key, mode))
                label = f"{SETUPS[key][0]} / {mode}"
                if r is None:
                    rows.append([SETUPS[key][0], mode, None, None, None, None, None, errors.get(label, "not run")])
                    continue
                per_rank = [g.get(f"{key}|{mode}", (None, None)) for g in (gathered if mode != "single" else gathered[:1])]
                packed_max = max(p for p, _ in per_rank)
                notes = []
                speedup = r["tok_s"] / single["tok_s"] if single and mode != "single" else None
                if speedup is not None and mode == "ddp":
                    notes.append(f"DDP {speedup:.2f}x 1 GPU (target >= 1.9): {'meets' if speedup >= 1.9 else 'misses'}")
                if single and mode == "fsdp2" and single["packed_total"]:
                    frac = packed_max / single["packed_total"]
                    notes.append(f"packed/rank {frac:.3f}x 1 GPU (target <= 0.55): {'meets' if frac <= 0.55 else 'misses'}")
                if mode == "ddp" and key in PEERS and (PEERS[key][0], "ddp") in results:
                    peer, want = PEERS[key]
                    x = r["tok_s"] / results[(peer, "ddp")]["tok_s"]
                    notes.append(f"{x:.2f}x {SETUPS[peer][0]} (target >= {want}): {'meets' if x >= want else 'misses'}")
                if r["ddp_broadcast_bytes"] is not None:
                    notes.append(f"DDP broadcast {r['ddp_broadcast_bytes']} B/step")
                peaks = [p for _, p in per_rank if p is not None]
                rows.append([SETUPS[key][0], mode, r["tok_s"], speedup, packed_max / 2**20, r["packed_total"] / 2**20,
                             max(peaks) if peaks else None, "; ".join(notes)])
                out.append({"setup": key, "mode": mode, **r, "packed_local_per_rank": [p for p, _ in per_rank],
                            "speedup_vs_single": speedup})
        body = (f"World size {world} ({'NCCL, CUDA' if cuda else 'gloo, CPU'}); model: {args.layers} layers, hidden "
                f"{args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}; batch {args.batch} x {args.seq} "
                f"per rank; AdamW; gradient checkpointing {'on' if args.grad_ckpt else 'off'}; {args.warmup} warm-up + {args.steps} timed steps; FSDP2 = fully_shard per decoder "
                "layer + root with a bf16 MixedPrecisionPolicy.\n\n")
        body += table(["setup", "mode", "tokens/s (all ranks)", "x 1 GPU", "packed MiB/rank (max)", "packed MiB total",
                       "peak GiB/rank", "note"], rows)
        if errors:
            body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
        if args.tiny and not args.name:  # a check of the script: nothing for benchmarks/results/
            print(body, flush=True)
        else:
            write_result(args.name or f"multigpu_{world}", f"Multi-GPU training step: 1 vs {world} ranks, DDP and FSDP2", body)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": out, "errors": errors}, f, indent=1)
    gc.collect()  # DDP / FSDP2 state of the last setup: freed while the process group can still take it down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter finalization: a gloo worker thread still holding a finished collective's tensors aborted a rank
    # there ("terminate called without an active exception", exit -6) after every result was written, once, on a loaded
    # 2-core CI host (the same teardown crash as pytorch/pytorch PR 179291 describes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
