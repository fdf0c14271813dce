"""fp8-hybrid linear forward+backward, 8192 tokens, 4096->14336 and 14336->4096, vs a bf16
nn.Linear and torchao Float8Linear (tensorwise), eager and torch.compile, in one run.
Targets: >= 1.6x bf16 nn.Linear, and faster than torchao compiled, eager as well as compiled."""

from __future__ import annotations

import argparse
import copy

import torch

from common import attempt, bench_ms, layer_step_fn, table, write_result

import surogate_hf.kernels  # noqa: F401

TARGET = 1.6



def ours(lin):
    from surogate_hf.recipes.config import as_recipe_config
    from surogate_hf.recipes.linear import RecipeLinear

    cfg = as_recipe_config("fp8-hybrid").with_model_dtype("bf16")
    return RecipeLinear.from_linear(copy.deepcopy(lin), cfg)


def torchao_f8(lin):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    wrap = torch.nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(wrap, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return wrap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    rows, errors = [], {}
    for k, n in ((4096, 14336), (14336, 4096)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2 * args.tokens * k * n
        setups = [("bf16 nn.Linear", lambda: lin, False)]
        if not args.no_compile:
            setups.append(("bf16 nn.Linear compiled", lambda: torch.compile(copy.deepcopy(lin)), False))
        setups += [("torchao Float8Linear tensorwise", lambda: torchao_f8(lin), False)]
        if not args.no_compile:
            setups.append(("torchao Float8Linear tensorwise compiled", lambda: torch.compile(torchao_f8(lin)), False))
        setups += [("ours fp8-hybrid (RecipeLinear)", lambda: ours(lin), True)]
        if not args.no_compile:
            setups.append(("ours fp8-hybrid compiled", lambda: torch.compile(ours(lin)), True))
        base = None
        ao_compiled = None
        for name, build, is_ours in setups:
            label = f"{name} [{k}->{n}]"
            m = attempt(label, build, errors)
            ms = None if m is None else attempt(label, lambda m=m: bench_ms(layer_step_fn(m, x, dy)), errors)
            if ms is None:
                rows.append([name, f"{k}->{n}", None, None, None, None, errors.get(label)])
                continue
            if base is None:
                base = ms
            if name == "torchao Float8Linear tensorwise compiled":
                ao_compiled = ms
            note = ""
            if is_ours:
                sp = base / ms
                note = ("meets" if sp >= TARGET else f"misses {TARGET}x by {TARGET - sp:.2f}x")
                if ao_compiled:
                    note += f"; vs torchao compiled {ao_compiled / ms:.2f}x"
            rows.append([name, f"{k}->{n}", ms, flops / ms / 1e9, base / ms, TARGET if is_ours else None, note])
            del m
    body = table(["setup", "shape", "fwd+bwd ms", "TFLOP/s", "x bf16", "target", "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result("fp8_hybrid_linear", f"fp8-hybrid linear fwd+bwd, {args.tokens} tokens", body)


if __name__ == "__main__":
    main()
