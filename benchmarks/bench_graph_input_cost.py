"""Host time a compiled training step spends per graph input, on whatever machine runs it (CPU or CUDA).

A whole-model compile lifts every parameter and buffer its forward reads into graph inputs. Each costs host time
every step, whatever it holds: a dynamo guard (TENSOR_MATCH and five dimension-marking checks), AOTAutograd's runtime
wrappers, inductor's size / stride assert, and, where the backward reads it, a saved tensor. A quantized linear
hands the graph more tensors than a bf16 one (codes, scales, an NF4 weight's tables; probe_graph_inputs.py counts
them per decoder layer), so a host-bound step (a small model without CUDA graphs) pays for each.

Here: a stack of `--layers` tiny layers, each one custom op (its output x's clone) taking `extra` frozen one-byte
tensors beside x, whose backward op takes them again (as the decode route's input gradient does), then a matmul
with a trainable [8, 8] weight; compiled whole (inductor, default mode) for each `--extra` count and timed forward +
backward in blocks interleaved across the counts. The slope of the best block's step time over the graph inputs is
the host cost per input, op-argument handling included (the ops here are Python kernels, which take the tensors as a
Python list; the extension's ops are C++). --fused: no custom op; the forward reads a byte of each frozen tensor in
one inductor-fused pointwise kernel and the backward does not read them: the graph inputs' own cost.
    python benchmarks/bench_graph_input_cost.py --layers 60 --extra 1,4,8,16

--guards: the host cost of a guard instead. A compiled frame whose forward reads a few Python attributes of each of
N submodules (an int, a string, a missing name: the kind of module state a quantized linear's forward consults)
and adds them to x; called forward only, for N = 10 and 400. The step difference over the difference in guard-tree
lines (probe_graph_inputs.guard_counts of dynamo's guard log: the checks and the managers that reach them) is what
evaluating one such line costs each call.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

_LIB = torch.library.Library("graph_input_cost", "DEF")
_LIB.define("take(Tensor x, Tensor[] frozen) -> Tensor")
_LIB.define("take_grad(Tensor grad, Tensor[] frozen) -> Tensor")  # the backward reads the frozen tensors too


@torch.library.impl("graph_input_cost::take", "CompositeExplicitAutograd", lib=_LIB)
def _take(x, frozen):
    return x.clone()


@torch.library.impl("graph_input_cost::take_grad", "CompositeExplicitAutograd", lib=_LIB)
def _take_grad(grad, frozen):
    return grad.clone()


@torch.library.register_fake("graph_input_cost::take", lib=_LIB)
def _(x, frozen):
    return torch.empty_like(x)


@torch.library.register_fake("graph_input_cost::take_grad", lib=_LIB)
def _(grad, frozen):
    return torch.empty_like(grad)


def _take_setup(ctx, inputs, output):
    ctx.frozen = inputs[1]


def _take_backward(ctx, grad):
    return torch.ops.graph_input_cost.take_grad(grad, ctx.frozen), [None] * len(ctx.frozen)


torch.library.register_autograd("graph_input_cost::take", _take_backward, setup_context=_take_setup, lib=_LIB)


class Layer(nn.Module):
    def __init__(self, extra: int, device, fused: bool = False):
        super().__init__()
        self.fused = fused  # --fused: the frozen tensors read by one inductor-fused pointwise kernel instead of the op
        self.names = tuple(f"frozen{i}" for i in range(extra))
        for name in self.names:
            self.register_parameter(name, nn.Parameter(torch.zeros(4, dtype=torch.uint8, device=device),
                                                       requires_grad=False))
        self.weight = nn.Parameter(torch.eye(8, device=device))

    def forward(self, x):
        frozen = [getattr(self, n) for n in self.names]
        if self.fused:
            for t in frozen:  # one fused kernel reading a byte of each; the backward does not read them
                x = x + t[0] * 0
            return x @ self.weight
        return torch.ops.graph_input_cost.take(x, frozen) @ self.weight


class Stack(nn.Module):
    def __init__(self, layers: int, extra: int, device, fused: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(extra, device, fused) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Attrs(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.subs = nn.ModuleList(nn.Module() for _ in range(n))
        for i, sub in enumerate(self.subs):
            sub.index, sub.label = i, f"sub{i}"

    def forward(self, x):
        acc = 0
        for sub in self.subs:
            acc += sub.index + len(sub.label) + (getattr(sub, "missing", None) is None)
        return x + acc


def guard_cost(device, calls: int = 2000, blocks: int = 7) -> None:
    from probe_graph_inputs import captured_guards, guard_counts

    x = torch.ones(1, device=device)
    sizes, best, lines = (10, 400), {}, {}
    models = {}
    for n in sizes:
        torch._dynamo.reset()
        with captured_guards() as text:
            models[n] = torch.compile(_Attrs(n), backend="eager")
            models[n](x)
        lines[n] = sum(guard_counts(text[0]).values())
        best[n] = float("inf")
    for _ in range(blocks):
        for n in sizes:
            t0 = time.perf_counter()
            for _ in range(calls):
                models[n](x)
            best[n] = min(best[n], (time.perf_counter() - t0) / calls)
    print(f"device {device}, torch {torch.__version__}, best of {blocks} interleaved blocks of {calls} calls")
    print()
    print("| submodules read | guard-tree lines | call us |")
    print("|---|---|---|")
    for n in sizes:
        print(f"| {n} | {lines[n]} | {best[n] * 1e6:.1f} |")
    print()
    per_line = (best[sizes[1]] - best[sizes[0]]) / (lines[sizes[1]] - lines[sizes[0]])
    print(f"host cost per guard-tree line and call: {per_line * 1e9:.0f} ns")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--extra", default="1,4,8,16", help="frozen tensors per layer, one compiled model each")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=7, help="timed blocks per model, interleaved across the models")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--guards", action="store_true", help="time guard evaluation instead (see the module docstring)")
    ap.add_argument("--fused", action="store_true",
                    help="no custom op: the frozen tensors are read by an inductor-fused pointwise kernel in the forward "
                         "(the graph inputs' own cost, without a kernel's argument handling or a backward reading them)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.guards:
        guard_cost(dev)
        return
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    extras = [int(e) for e in args.extra.split(",")]
    x = torch.randn(2, 8, device=dev, requires_grad=True)
    models = {}
    for e in extras:
        model = torch.compile(Stack(args.layers, e, dev, args.fused))
        for _ in range(3):
            model(x).sum().backward()
        models[e] = model
    best = {e: float("inf") for e in extras}
    for _ in range(args.blocks):
        for e, model in models.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                model(x).sum().backward()
            sync()
            best[e] = min(best[e], (time.perf_counter() - t0) / args.steps)
    inputs = {e: args.layers * (e + 1) for e in extras}
    lo, hi = min(extras), max(extras)
    slope = (best[hi] - best[lo]) / (inputs[hi] - inputs[lo]) if hi != lo else float("nan")
    print(f"device {dev}, torch {torch.__version__}, {args.layers} layers, best of {args.blocks} interleaved blocks of "
          f"{args.steps} forward + backward steps; the frozen tensors "
          + ("read by a fused pointwise kernel (--fused)" if args.fused else "taken by the custom op and its backward"))
    print()
    print("| frozen tensors per layer | graph inputs from the layers | step us |")
    print("|---|---|---|")
    for e in extras:
        print(f"| {e} | {inputs[e]} | {best[e] * 1e6:.0f} |")
    print()
    print(f"host cost per graph input and step ({lo} -> {hi} per layer): {slope * 1e6:.2f} us")


if __name__ == "__main__":
    main()
