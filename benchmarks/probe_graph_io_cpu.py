"""Probe, on a CPU: the tensors a whole-model compile hands across its graphs per decoder layer, PEFT against ours.

With CUDA graphs (`mode="reduce-overhead"`), every step's host work around the replays scales with these counts: the
forward graph's inputs (dynamo's guards, AOTAutograd's wrappers, CUDA-graph trees' static-input checks), its outputs
(the loss and every tensor saved for the backward: each one rebuilt from the graph's memory pool after a replay and
packed into the autograd context), and the backward graph's inputs (those saved tensors unpacked and checked again).
A loop that waits for the GPU every step (the HF Trainer: its loss's isnan check) exposes all of it. This probe
compiles a real-shaped decoder (SmolLM2-135M's widths, LAYERS decoder layers, a 4,096-token vocabulary) through
AOTAutograd at two depths and prints the difference, one decoder layer of seven LoRA-adapted linears. Ours run their
graph route (the extension's two graph ops per linear, as on the GPU; their Python reference runs here).
    python benchmarks/probe_graph_io_cpu.py --setups peft,mxfp4,nvfp4,nf4,fp8,nf4/explicit
A format's linears take the registered route (their decode operands registered at load: the codes alone cross);
`fmt/explicit` hands the graph every operand, as before it.
"""

from __future__ import annotations

import argparse

import torch

from probe_compiled_host_cpu import graph_route_on_cpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def graph_io(setup: str, layers: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=4096, use_cache=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    undo = lambda: None  # noqa: E731
    fmt, _, route = setup.partition("/")
    if route not in ("", "explicit"):
        raise ValueError(f"setup {setup}: the only route suffix is /explicit")
    if setup != "peft":
        from surogate_hf.nn import linear as L
        from surogate_hf.training import prepare_for_training

        for name, module in list(model.named_modules()):
            if name.split(".")[-1] in TARGETS:
                model.set_submodule(name, L.LINEAR_CLASSES[fmt].from_linear(module))
        prepare_for_training(model, gradient_checkpointing=False)
        if route == "explicit":  # every operand of each linear in the graph, the route before the registered one
            L.set_registered_graph_route(model, False)
        undo = graph_route_on_cpu()
    try:
        model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.bfloat16()
        got = {}

        def outputs(gm):
            return [n for n in gm.graph.nodes if n.op == "output"][0].args[0]

        def forward(gm, example_inputs):
            got["forward inputs"], got["forward outputs"] = len(example_inputs), len(outputs(gm))
            return make_boxed_func(gm.forward)

        def backward(gm, example_inputs):
            got["backward inputs"] = len(example_inputs)
            got["backward outputs"] = sum(1 for o in outputs(gm) if o is not None)
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        run = torch.compile(model, backend=aot_autograd(fw_compiler=forward, bw_compiler=backward))
        ids = torch.randint(0, cfg.vocab_size, (1, 16))
        run(input_ids=ids, labels=ids).loss.backward()
    finally:
        undo()
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft,mxfp4,nvfp4,nf4,fp8")
    args = ap.parse_args()
    keys = ("forward inputs", "forward outputs", "backward inputs", "backward outputs")
    print(f"{torch.__version__}; per decoder layer (the difference between 3 and 1 layers, halved)\n")
    print("| setup | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for setup in args.setups.split(","):
        one, three = graph_io(setup, 1), graph_io(setup, 3)
        print(f"| {setup} | " + " | ".join(f"{(three[k] - one[k]) / 2:g}" for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
