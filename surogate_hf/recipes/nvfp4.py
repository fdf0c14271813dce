"""NVFP4 GEMMs of the nvfp4 recipe (emulated exactly where no native FP4 GEMM exists).

forward  y  = x W^T   : x in 1x16 blocks (RNE), W in 2D 16x16 blocks (RNE)
dgrad    dx = dy W    : dy in 1x16 blocks (stochastic rounding), W^T = the forward's 2D-quantized W
                        transposed (16x16 tiles make W and W^T quantize to the same values)
wgrad    dW = dy^T x  : reduction over tokens; both operands get the random Hadamard transform along
                        tokens (cancels exactly in the product), then 1x16 blocks, dy^T with
                        stochastic rounding, x^T with RNE. The token count is zero-padded to a multiple
                        of 16 (zeros add nothing to the product).
Four-Over-Six per the recipe config. Quantization is surogate::quantize_nvfp4 (formats.nvfp4), the
GEMMs surogate::nvfp4_mm, the transform surogate::rht.

Stochastic rounding is replayable: the seed of each draw is a hash of (config seed, the layer's
index, the layer's step counter, the role); the step counter is a persistent buffer, so a resumed
run draws the same numbers as the uninterrupted one.

Native path: on SM100+ a CUDA kernel registered for surogate::nvfp4_mm runs the FP4 GEMM. No such
kernel exists in this package yet and none was run here; everywhere else (CPU, Hopper) a one-time
warning says the recipe is emulated.
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..ops import quant as _quant_ops  # noqa: F401  (registers quantize_nvfp4, rht)
from .fp8_hybrid import warn_emulation_once

ROLE_DGRAD, ROLE_WGRAD = 0, 1


def sr_seed(base_seed: int, index: int, step: int, role: int) -> int:
    """32-bit seed for one stochastic-rounding draw (counter-based hash, formats.rng)."""
    layer = int(F.rng.hash32(base_seed, torch.tensor([index])).item())
    return int(F.rng.hash32(layer, torch.tensor([step * 2 + role])).item())


def transpose_nvfp4_2d(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """W^T of a 2D-block NVFP4 tensor (layout only: codes and tile scales move, values do not change)."""
    codes = F.unpack_e2m1(packed).t().contiguous()
    tiles = scale[::F.NVFP4_BLOCK].t()  # [K/16, N/16]: one scale per 16x16 tile
    return F.pack_e2m1(codes), tiles.repeat_interleave(F.NVFP4_BLOCK, dim=0).contiguous(), global_scale


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[-1]) % F.NVFP4_BLOCK
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


class NVFP4Engine:
    name = "nvfp4"

    def __init__(self, cfg):
        self.fos, self.rule = cfg.four_over_six, cfg.four_over_six_rule
        self.sr = not cfg.no_fp4_stochastic_rounding
        self.rht = cfg.fp4_rht
        self.seed = cfg.seed

    def _q(self, t, block_2d=False, stochastic=False, seed=0):
        return torch.ops.surogate.quantize_nvfp4(t, block_2d, self.fos, self.rule, stochastic, seed, None)

    def _weight(self, owner, w, need_t: bool):
        """The 2D-block quantized weight (packed, scales, global) and, with need_t, its transpose: built once per
        optimizer step (the layer's weight key) and reused by micro-batches, recomputes and the dgrad."""
        if torch.compiler.is_compiling():
            wq = self._q(w, block_2d=True)
            return wq, (transpose_nvfp4_2d(*wq) if need_t else None)
        key = owner._weight_key()
        cached = getattr(owner, "_nvfp4_w", None)
        if cached is None or cached[0] != key:
            cached = (key, self._q(w, block_2d=True), None)
        if need_t and cached[2] is None:
            cached = (key, cached[1], transpose_nvfp4_2d(*cached[1]))
        owner._nvfp4_w = cached
        return cached[1], cached[2]

    def forward(self, owner, x, w, bias, need_dx=True, need_dw=True):
        warn_emulation_once("nvfp4_mm", x.device, "the NVFP4 recipe GEMM (no FP4 tensor cores used)")
        xq = self._q(x)
        wq, wt = self._weight(owner, w, need_dx)
        y = torch.ops.surogate.nvfp4_mm(*xq, *wq, bias, x.dtype)
        return y, (x, *(wt if wt is not None else (None, None, None)), owner.fwd_sr_step)

    def backward(self, owner, dy, saved, need_dx, need_dw):
        x, wtp, wts, wtg, step = saved
        seed = lambda role: sr_seed(self.seed, owner.recipe_index, step, role) if self.sr else 0  # noqa: E731
        dx = dw = None
        if need_dx:
            dyq = self._q(dy, stochastic=self.sr, seed=seed(ROLE_DGRAD))
            dx = torch.ops.surogate.nvfp4_mm(*dyq, wtp, wts, wtg, None, dy.dtype)
        if need_dw:
            a, b = _pad_tokens(dy.t()), _pad_tokens(x.t())
            if self.rht:
                signs = owner.rht_signs
                a, b = torch.ops.surogate.rht(a, signs), torch.ops.surogate.rht(b, signs)
            aq = self._q(a, stochastic=self.sr, seed=seed(ROLE_WGRAD))
            bq = self._q(b)
            dw = torch.ops.surogate.nvfp4_mm(*aq, *bq, None, torch.float32)
        return dx, dw
