"""Probe, on a CPU: the host work a whole-model compile puts around each step, per setup, without a GPU.

A small model's compiled step without CUDA graphs is bound by the host (results/host/), and so is the Trainer's step
with them (it waits for the GPU every step, so the work before the forward replays is exposed). Much of that work
scales with the tensors the graphs take: dynamo's guards, AOTAutograd's runtime wrappers (`CompiledFunction`),
inductor's `assert_size_stride` on every graph input and every custom-op output, the tensors saved for the backward.
This probe builds a stand-in of a decoder stack (LAYERS blocks of seven LoRA-adapted linears: q, k, v, o, gate, up,
down, at small widths so that the compute stays small), compiles it whole with inductor, and reports per step:
the forward graph's inputs, inductor's `assert_size_stride` calls, and the profiler's self CPU time of the compiled
region's wrappers. Ours run their graph route (the extension's two graph ops per linear, as on the GPU); on a CPU those
ops run their Python reference, so the op rows of a profile are not the GPU's; the structure around them is.
    python benchmarks/probe_compiled_host_cpu.py --setups peft,mxfp4,nf4 --layers 30
(What a change to the tensors per linear would save can be read here before a GPU call measures it: `nf4/explicit`
runs a format's route with every operand in the graph, as before the registered route.)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch import nn

from common import table, write_result

PROFILED_REGIONS = ("CompiledFunction", "CompiledFunctionBackward", "TorchDynamo Cache Lookup",
                    "Torch-Compiled Region: 0/0")
WIDTH, MLP = 64, 128  # multiples of every format's blocks (NF4's 64 divides K)


def build(setup: str, layers: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    from surogate_hf.integrations.peft import install_peft_dispatch
    from surogate_hf.nn import linear as L

    install_peft_dispatch()

    def linear(n, k):
        dense = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        return dense.requires_grad_(False) if setup == "peft" else L.LINEAR_CLASSES[setup].from_linear(dense)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (linear(WIDTH, WIDTH) for _ in range(4))
            self.gate, self.up, self.down = linear(MLP, WIDTH), linear(MLP, WIDTH), linear(WIDTH, MLP)

        def forward(self, x):
            h = x + self.o(self.q(x) * self.k(x) + self.v(x))
            return h + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = get_peft_model(Stack(), LoraConfig(r=8, lora_alpha=16, target_modules=["q", "k", "v", "o", "gate", "up",
                                                                                   "down"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.bfloat16()
    return model


def graph_route_on_cpu():
    """Ours' linears take the graph route inside the compile on a CPU too (QuantizedLinear.decoded_route asks for CUDA
    tensors and the extension; the graph ops' reference kernels stand in for the C++ ones here). Returns the undo."""
    from surogate_hf.nn import linear as L

    original = L.QuantizedLinear.decoded_route
    L.QuantizedLinear.decoded_route = lambda self, x: self.graph_route()
    return lambda: setattr(L.QuantizedLinear, "decoded_route", original)


def probe(setup: str, layers: int, tokens: int, steps: int) -> dict:
    """setup: peft, a format, or `format/explicit` (the graph route with every operand in the graph instead of the
    codes alone: nn.linear.set_registered_graph_route(model, False))."""
    from torch._inductor.compile_fx import compile_fx

    from surogate_hf.nn import linear as L

    setup, _, route = setup.partition("/")
    if route not in ("", "explicit"):
        raise ValueError(f"setup {setup}/{route}: the only route suffix is /explicit")
    undo = graph_route_on_cpu() if setup != "peft" else (lambda: None)
    try:
        torch._dynamo.reset()
        model = build(setup, layers)
        if route == "explicit":
            L.set_registered_graph_route(model, False)
        inputs = []

        def backend(gm, example_inputs):
            inputs.append(sum(1 for node in gm.graph.nodes if node.op == "placeholder"))
            return compile_fx(gm, example_inputs)

        run = torch.compile(model, backend=backend)
        x = torch.randn(tokens, WIDTH, dtype=torch.bfloat16)

        def step():
            run(x).float().square().mean().backward()

        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        asserts = sum(nc for (_, _, name), (_, nc, *_) in pstats.Stats(prof).stats.items()
                      if "assert_size_stride" in name) // steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                step()
        self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in p.key_averages() if e.key in PROFILED_REGIONS}
    finally:
        undo()
    return {"graph_inputs": inputs[0] if inputs else None, "graphs": len(inputs), "asserts": asserts,
            "wall_ms": 1e3 * wall, **{k: self_ms.get(k) for k in PROFILED_REGIONS}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft,mxfp4,nvfp4,nf4",
                    help="peft (nn.Linear bf16 bases) and our formats (mxfp4, nvfp4, nf4, fp8), each on the registered "
                         "graph route, or with /explicit (e.g. nf4/explicit) on the route taking every operand")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--name", default="probe_compiled_host_cpu")
    args = ap.parse_args()
    rows = []
    for setup in args.setups.split(","):
        r = probe(setup, args.layers, args.tokens, args.steps)
        print(setup, r, flush=True)
        per_layer = None if r["graph_inputs"] is None else r["graph_inputs"] / args.layers
        rows.append([setup, r["graphs"], r["graph_inputs"], per_layer, r["asserts"], r["wall_ms"],
                     *(r[k] for k in PROFILED_REGIONS)])
    body = (f"{torch.__version__}, a CPU; {args.layers} blocks of seven LoRA-adapted linears ({WIDTH} / {MLP} wide), "
            f"{args.tokens} tokens, compiled whole with inductor; per step, over {args.steps} steps. Ours run the graph "
            "route, whose ops execute their Python reference here: the wall time and the op rows are not the GPU's; "
            "the inputs, asserts and the wrappers' self time are the structure the GPU step has too.\n\n")
    body += table(["setup", "graphs", "forward graph inputs", "a layer", "assert_size_stride calls a step",
                   "wall ms a step", *(f"{k} self ms a step" for k in PROFILED_REGIONS)], rows)
    write_result(args.name, "Compiled step host structure on a CPU", body)


if __name__ == "__main__":
    main()
