"""Compile a small fp8-hybrid model on CUDA with each way the traced GEMM can enter the graph and print what
happens (the loss of 3 steps, or the full error): a diagnosis script for inductor's handling of the FP8 GEMM."""

from __future__ import annotations

import sys
import traceback
import warnings

import torch
from torch import nn

import surogate_hf.recipes as R
import surogate_hf.recipes.fp8_hybrid as FH


class Model(nn.Module):
    def __init__(self, dim=512, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim)) for _ in range(layers))

    def forward(self, x):
        for blk in self.layers:
            x = x + blk(x)
        return x


def main():
    warnings.simplefilter("ignore")
    for mode in sys.argv[1:] or ["aten", "op"]:
        FH.TRACED_GEMM = mode
        torch._dynamo.reset()
        m = R.apply_recipe(Model().cuda().bfloat16(), "fp8-hybrid")
        assert isinstance(m.layers[0][0], R.RecipeLinear)
        run = torch.compile(m, fullgraph=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        try:
            losses = []
            for i in range(3):
                x = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
                loss = run(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(round(loss.item(), 5))
            print(f"{mode}: ok, losses {losses}", flush=True)
        except Exception:
            print(f"{mode}: FAILED", flush=True)
            traceback.print_exc(limit=40)


if __name__ == "__main__":
    main()
