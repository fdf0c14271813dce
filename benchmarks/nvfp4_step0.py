"""Step-0 validation loss of the convergence benchmark's real model under the nvfp4 recipe's forward, one operand's
quantization changed at a time: where the FP4 forward of a pretrained model loses (docs/fidelity.md).

    python benchmarks/nvfp4_step0.py                          # CPU is enough: forward only (~20 s a variant)
    python benchmarks/nvfp4_step0.py --variants w2d,w1d --val-seqs 16

Variants: w1d (the recipe's default: weights 1x16 along each GEMM's reduction dim), w2d (16x16 weight tiles),
x_bf16 / w_bf16 (that operand left in bf16, a diagnostic: recipes.nvfp4.qdq replaced for it), and any of them with
"_allfp4" (every decoder block in FP4 instead of the recipe's bf16 first and last blocks).
Needs the assets of `benchmarks/convergence.py --prepare`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import convergence as C
import convergence_assets as A

import surogate_hf
from surogate_hf.recipes import nvfp4 as N


def _leave_bf16(operand: str):
    """Leave the forward's activation ("x") or weight ("w") operand in bf16 (a diagnostic); returns the undo."""
    orig_qdq, orig_weight = N.qdq, N.NVFP4Engine._quantize_weight
    in_weight = [False]

    def bf16(t):
        return t.to(torch.bfloat16), torch.ones((), dtype=torch.float32, device=t.device)

    def quantize_weight(self, w, dgrad, native=False):
        if operand == "w":
            return bf16(w)
        in_weight[0] = True
        try:
            return orig_weight(self, w, dgrad, native)
        finally:
            in_weight[0] = False

    def qdq(t, axis, *a, **k):
        if operand == "x" and axis == 1 and not in_weight[0]:
            return bf16(t)
        return orig_qdq(t, axis, *a, **k)

    N.qdq, N.NVFP4Engine._quantize_weight = qdq, quantize_weight

    def undo():
        N.qdq, N.NVFP4Engine._quantize_weight = orig_qdq, orig_weight

    return undo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="w2d,w1d,x_bf16,w_bf16,w2d_allfp4,w1d_allfp4")
    ap.add_argument("--val-seqs", type=int, default=8)
    ap.add_argument("--assets", type=Path, default=A.DEFAULT_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    config, state, _, val_ids = A.load_real(args.assets, None)
    vals = C.val_batches(val_ids, 512, 4, args.val_seqs)
    load = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = C.write_checkpoint(config, state, Path(tmp), 0)
        ref = C.evaluate(AutoModelForCausalLM.from_pretrained(ckpt, **load).to(args.device), vals, args.device)
        print(f"| variant | step-0 val loss | vs bf16 |\n|---|---|---|\n| bf16 | {ref:.4f} | - |")
        for name in args.variants.split(","):
            base = name.partition("_allfp4")[0]
            knobs = {"fp4_weight_blocks": "2d" if base == "w2d" else "1d", "fp4_high_precision_tail": 0.0}  # (no training)
            if name.endswith("_allfp4"):
                knobs.update(skip_quant_first_layers=0, skip_quant_last_layers=0)
            model = AutoModelForCausalLM.from_pretrained(ckpt, **load).to(args.device)
            surogate_hf.apply_recipe(model, "nvfp4", master_dtype="fp32", **knobs)
            undo = _leave_bf16(base[0]) if base in ("x_bf16", "w_bf16") else (lambda: None)
            try:
                t0 = time.perf_counter()
                loss = C.evaluate(model, vals, args.device)
            finally:
                undo()
            print(f"| {name} | {loss:.4f} | {100 * (loss / ref - 1):+.1f}% | ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
