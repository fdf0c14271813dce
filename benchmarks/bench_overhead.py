"""Host (CPU) time per quantized linear call, forward + backward of a tiny layer (4 tokens, 128 -> 128,
bf16: the math is negligible, so the figure is what the Python side costs per layer per step):

- "op path": the autograd Function over the surogate:: custom ops (QuantLinearFunction), which is
  what the module ran on every device before the CUDA plan path, and still runs on CPU / under
  torch.compile;
- "plan path": what QuantizedLinear runs on CUDA now (PlannedLinearFunction + cached GemmPlan,
  calling the ops' CUDA implementations directly). On a machine without CUDA the plan is built
  with the ops' reference functions instead, so both columns do the same math and their
  difference is the wrapper cost alone;
- a frozen nn.Linear for scale.
On CUDA the loop synchronizes once per block: what is timed is the host issuing the launches.
Best of 5 blocks (the host may be shared).
"""

from __future__ import annotations

import argparse
import os
import time

# fixed kernel tiles: autotuning would spend the run compiling variants, and tiles do not change host time
os.environ.setdefault("SUROGATE_HF_AUTOTUNE", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import table, write_result  # noqa: E402

import surogate_hf.kernels  # noqa: E402,F401
from surogate_hf.nn import linear as L  # noqa: E402
from surogate_hf.ops import linear as OL  # noqa: E402


def _timed(fn, iters: int, device: str) -> float:
    for _ in range(max(20, iters // 20)):
        fn()
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters // 5):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / (iters // 5) * 1e6)
    return best


def _reference_plan(m: L.QuantizedLinear):
    """(fwd, dgrad, args, None) over the ops' reference functions (CPU stand-in for the CUDA plan; no C++ decode route)."""
    t, n, k, fmt = m._tensors(), m.out_features, m.in_features, m.fmt
    if fmt.name == "fp8":
        bn, bk, s = fmt._blocks(t, n, k)
        args = (t[""], s, bn, bk)
    elif fmt.name == "nvfp4":
        args = (t[""], t["_scale"], t["_scale_2"])
    elif fmt.name == "mxfp4":
        args = fmt._canon(t, n, k)
    else:
        args = (t[""], fmt._absmax(t, n, k), t["_quant_map"], fmt.block_size, n, k)
    name = {"fp8": "fp8_block_linear"}.get(fmt.name, f"{fmt.name}_linear")
    return getattr(OL, name)._init_fn, getattr(OL, name + "_dgrad")._init_fn, args, None


def measure(device: str, iters: int, tokens: int, width: int, dtype) -> list[list]:
    torch.manual_seed(0)
    dense = nn.Linear(width, width, bias=True, device=device, dtype=dtype).requires_grad_(False)
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, width, device=device, dtype=dtype)

    def step(forward):
        def f():
            x.grad = None
            forward(x).backward(dy)

        return f

    base = _timed(step(dense), iters, device)
    rows = [["nn.Linear (frozen)", base, base, 1.0]]
    for name, cls in (("fp8", L.FP8Linear), ("nvfp4", L.NVFP4Linear), ("mxfp4", L.MXFP4Linear), ("nf4", L.NF4Linear)):
        m = cls.from_linear(dense)
        n, k = m.out_features, m.in_features

        def op_path(x, m=m):
            return L.quantized_linear(x, m.fmt, m._tensors(), n, k) + m.bias

        if device == "cuda":
            plan_path = m
        else:
            cache = {}

            def plan_path(x, m=m, cache=cache):
                plan = L.gemm_plan(cache, None, m._slot_sources(), lambda: _reference_plan(m))
                return L.planned_linear(x, plan) + m.bias

        old = _timed(step(op_path), iters, device)
        new = _timed(step(plan_path), iters, device)
        rows.append([f"{name} QuantizedLinear", old, new, new / base])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: intra-op threads only add wake-up latency
    rows = measure(args.device, args.iters, args.tokens, args.width, torch.bfloat16)
    body = table(["layer", "op path us/call", "plan path us/call", "plan path x nn.Linear"], rows)
    body = (f"{args.tokens} tokens, {args.width}->{args.width}, bf16, fwd+bwd, best of 5 x {args.iters // 5} calls, "
            f"device {args.device}"
            + ("" if args.device == "cuda" else "; the CPU plan path runs the ops' reference functions (same math "
               "as the op path: the difference is wrapper cost)") + "\n\n" + body)
    write_result(f"host_overhead_{args.device}", "Host time per quantized linear call (fwd+bwd)", body)


if __name__ == "__main__":
    main()
