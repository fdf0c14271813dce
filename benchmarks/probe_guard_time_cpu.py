"""Probe, on a CPU: dynamo's guard check of a whole compiled QLoRA model, per setup, without a GPU.

Every call of a compiled model first runs its guards (the profiler's "TorchDynamo Cache Lookup"); through the HF
Trainer, which waits for the GPU every step, that check is exposed before each forward's graph replay. Dynamo guards
every tensor the traced code touches, so each slot of a quantized linear that the compiled route reads costs every
call. This builds the model of a shape (LlamaForCausalLM from its config, random weights, the target linears
converted to a format, PEFT LoRA on them), compiles it whole (backend "eager": the guards are dynamo's, whatever the
backend), runs it twice, and times the compiled forward's guard check alone (its guard manager's check on the
call's arguments, best of repeats). Ours take their compiled graph route as on the GPU.
    python benchmarks/probe_guard_time_cpu.py --setups peft,nf4,mxfp4,nvfp4,fp8 --layers 30
"""

from __future__ import annotations

import argparse
import time

import torch

from common import table, write_result

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(setup: str, layers: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from surogate_hf.nn import linear as L

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=4096, use_cache=True)  # SmolLM2-135M's linears
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if setup != "peft":
        for name, module in list(model.named_modules()):
            if name.split(".")[-1] in TARGETS:
                model.set_submodule(name, L.LINEAR_CLASSES[setup].from_linear(module))
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.bfloat16()
    return model


def probe(setup: str, layers: int, repeats: int) -> dict:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from probe_compiled_host_cpu import graph_route_on_cpu

    undo = graph_route_on_cpu() if setup != "peft" else (lambda: None)
    try:
        torch._dynamo.reset()
        model = build(setup, layers)
        run = torch.compile(model, backend="eager")
        ids = torch.randint(0, 4096, (1, 16))
        for _ in range(2):
            run(input_ids=ids, labels=ids).loss.backward()
        entries = _debug_get_cache_entry_list(type(model).forward.__code__)
        if len(entries) != 1:
            raise RuntimeError(f"{setup}: {len(entries)} compiled entries of the model's forward, expected 1")
        guards = entries[0].guard_manager
        frame = {"self": model, "args": (), "kwargs": {"input_ids": ids, "labels": ids}}
        if not guards.check(frame):
            raise RuntimeError(f"{setup}: the guards fail on the call they were built for")
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(20):
                guards.check(frame)
            best = min(best, (time.perf_counter() - t0) / 20)
        return {"guard_ms": best * 1e3, "params": sum(1 for _ in model.parameters())}
    finally:
        undo()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="peft,nf4,mxfp4,nvfp4,fp8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default=None, help="write results/<name>.md")
    a = ap.parse_args()
    rows, base = [], None
    for setup in a.setups.split(","):
        got = probe(setup, a.layers, a.repeats)
        base = got["guard_ms"] if setup == "peft" else base
        ratio = f"{got['guard_ms'] / base:.2f}" if base else "-"
        rows.append([setup, got["params"], f"{got['guard_ms']:.3f}", ratio])
        print(setup, got, flush=True)
    body = table(["setup", "parameters", "guard check ms a call", "x PEFT"], rows)
    print(body)
    if a.name:
        write_result(a.name, "Dynamo's guard check of a compiled QLoRA model (CPU)",
                     f"SmolLM2-135M linears, {a.layers} layers, PEFT LoRA r=8, compiled whole (backend eager); the "
                     f"forward's guard check timed alone, best of {a.repeats} x 20.\n\n" + body)


if __name__ == "__main__":
    main()
