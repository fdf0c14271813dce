"""Probe, on a CPU: what one graph input a linear instead of one per slot would save around a compiled step.

The design under test (not the library's route yet): an MXFP4 linear's two slots (codes, E8M0 scales) become views of
one flat byte tensor, and the graph route reads that tensor (sliced inside the graph) instead of each slot, so a
linear hands the compiled graphs one frozen tensor, as PEFT's bf16 weight does, instead of two. Both variants run in
probe_compiled_host_cpu's stand-in (LAYERS blocks of seven LoRA-adapted linears compiled whole); the probe reports its
graph inputs, inductor's size asserts and the profiler's self time of the compiled region's wrappers per step.
    python benchmarks/probe_flat_slots_cpu.py --layers 30 --runs 2
"""

from __future__ import annotations

import argparse

import torch

import probe_compiled_host_cpu as P

FLAT_ATTR = "_probe_flat_slots"


def flatten_slots(model: torch.nn.Module) -> None:
    """Each MXFP4 linear's codes and scales re-pointed to views of one flat uint8 tensor (16-byte aligned parts)."""
    from surogate_hf.nn import linear as L

    for module in model.modules():
        if isinstance(module, L.MXFP4Linear):
            codes, scales = module._parameters["weight"], module._parameters["weight_scale"]
            a, b = torch.numel(codes), torch.numel(scales)
            start = -(-a // 16) * 16
            flat = torch.empty(start + b, dtype=torch.uint8, device=codes.device)
            flat[:a].copy_(codes.data.reshape(-1))
            flat[start:].copy_(scales.data.reshape(-1))
            codes.data, scales.data = flat[:a].view(codes.shape), flat[start:].view(scales.shape)
            module.__dict__[FLAT_ATTR] = (flat, start, tuple(codes.shape), tuple(scales.shape))


def flat_decode_operands(self):
    """graph_decode_operands' tuple for a flattened MXFP4 linear, its operands sliced from the one flat tensor."""
    from surogate_hf.kernels.registry import decode_operands

    flat, start, codes_shape, scales_shape = self.__dict__[FLAT_ATTR]
    codes = flat[:codes_shape[0] * codes_shape[1]].view(codes_shape)
    scales = flat[start:start + scales_shape[0] * scales_shape[1]].view(scales_shape)
    return (*decode_operands("mxfp4", codes, scales, None, None, self.out_features, self.in_features, 32, None), None)


def probe(variant: str, layers: int, tokens: int, steps: int) -> dict:
    from surogate_hf.nn import linear as L

    build, operands = P.build, L.QuantizedLinear.graph_decode_operands
    if variant == "flat":
        P.build = lambda setup, n: _flattened(build(setup, n))
        L.QuantizedLinear.graph_decode_operands = flat_decode_operands
    try:
        return P.probe("mxfp4", layers, tokens, steps)
    finally:
        P.build, L.QuantizedLinear.graph_decode_operands = build, operands


def _flattened(model):
    flatten_slots(model)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=2, help="runs of each variant, alternating")
    args = ap.parse_args()
    keys = ("graph_inputs", "asserts", "wall_ms", *P.PROFILED_REGIONS)
    print("| variant | run | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for run in range(args.runs):
        for variant in ("slots", "flat"):
            r = probe(variant, args.layers, args.tokens, args.steps)
            cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            print(f"| {variant} | {run + 1} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
