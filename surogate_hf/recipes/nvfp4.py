"""NVFP4 GEMMs of the nvfp4 recipe (emulated exactly where no native FP4 GEMM exists).

forward  y  = x W^T   : x in 1x16 blocks (RNE), W in 1x16 blocks along K (RNE)
dgrad    dx = dy W    : dy in 1x16 blocks (stochastic rounding), W in 1x16 blocks along N (RNE)
                        With fp4_weight_blocks="2d" (NVIDIA's pretraining recipe) W is quantized once in 16x16
                        tiles and the dgrad multiplies the same values transposed.
wgrad    dW = dy^T x  : reduction over tokens; both operands get the random Hadamard transform along
                        tokens (cancels exactly in the product), then 1x16 blocks, dy^T with
                        stochastic rounding, x^T with RNE. The token count is zero-padded to a multiple
                        of 16 (zeros add nothing to the product).
Four-Over-Six per the recipe config.

Each operand takes one amax pass and one quantize pass (surogate::nvfp4_amax / nvfp4_qdq, formats.nvfp4.qdq_nvfp4)
that writes the values the FP4 GEMM operand holds, e2m1 * s_blk, as bf16: exact (at most 5 significant bits). The
wgrad operands are quantized along the token axis in place of a transposed copy, the transform and the padding done
in the same pass. The GEMM is then a bf16 tensor-core GEMM with fp32 output, scaled by the product of the two
globals and rounded once (`gemm`): the NVFP4 GEMM up to fp32 summation order. The weight operands are
quantized once per optimizer step and cached as bf16: along K for the forward and along N for the dgrad (4 bytes per
parameter; finer scales than 16x16 tiles at the price of W and W^T no longer holding the same values), or with
fp4_weight_blocks="2d" one 16x16-tile copy whose transposed view serves the dgrad (2 bytes per parameter).

Stochastic rounding is replayable: the seed of each draw is a hash of (config seed, the layer's
index, the layer's step counter, the role); the step counter is a persistent buffer, so a resumed
run draws the same numbers as the uninterrupted one.

Native path: on SM100+ (kernels.probe.fp4_ok) the operands stay packed (`packed`: surogate::quantize_nvfp4 of the
same operand tensors, so the same values) and surogate::nvfp4_mm runs cuBLASLt's block-scaled FP4 GEMM
(kernels.fp4_native). No GPU we can reach has FP4 tensor cores: that path is written and its plumbing checked on
CPU against the bf16 one, but it has never run on a GPU. Everywhere else a one-time warning says the recipe is
emulated.
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..ops import quant as _quant_ops  # noqa: F401  (registers quantize_nvfp4, nvfp4_qdq, rht)
from ..ops import recipe as _recipe_ops  # noqa: F401  (registers nvfp4_mm, nvfp4_qdq_mm)
from .fp8_hybrid import warn_emulation_once

ROLE_DGRAD, ROLE_WGRAD = 0, 1


def sr_seed(base_seed: int, index: int, step: int, role: int) -> int:
    """32-bit seed for one stochastic-rounding draw (counter-based hash, formats.rng)."""
    return F.rng.hash32_int(F.rng.hash32_int(base_seed, index), step * 2 + role)


def _cuda_eager(t: torch.Tensor) -> bool:
    return t.is_cuda and not torch.compiler.is_compiling()


def qdq(t: torch.Tensor, axis: int, fos: bool, rule: str, stochastic: bool = False, seed: int = 0, signs=None):
    """(e2m1 * s_blk in bf16, decode global) of t's NVFP4 operand (formats.nvfp4.qdq_nvfp4): axis 1, 1x16 blocks along
    rows; axis 0, 16-blocks down the token axis (zero-padded); axis 2, 16x16 tiles. Eager on CUDA one call that
    takes the amax and quantizes (kernels.nvfp4_qdq, no Python op wrapper on the path); elsewhere the op."""
    if _cuda_eager(t):
        return _kernels().qdq(t, None, signs, axis, fos, rule, stochastic, seed)
    return torch.ops.surogate.nvfp4_qdq(t, None, signs, axis, fos, rule, stochastic, seed)


def gemm(a: torch.Tensor, b: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor, bias, out_dtype: torch.dtype):
    """cast((a @ b) * (ga * gb) + bias, out_dtype) for qdq operands a [M, K] and b [K, N] (any strides): the NVFP4
    GEMM up to fp32 summation order (formats.nvfp4.mm_qdq). On the GPU one bf16 tensor-core GEMM with fp32 output
    and one epilogue pass (Hopper has no FP4 tensor cores; the bf16 operands hold the FP4 values exactly)."""
    if _cuda_eager(a):
        return _kernels().gemm(a, b, ga, gb, bias, out_dtype)
    return torch.ops.surogate.nvfp4_qdq_mm(a, b, ga, gb, bias, out_dtype)


def _kernels():
    from ..kernels import nvfp4_qdq

    return nvfp4_qdq


def native_fp4(device: torch.device) -> bool:
    """FP4 tensor cores on `device` (kernels.probe.fp4_ok: SM100+): the operands then stay packed for
    surogate::nvfp4_mm's native GEMM. Never true on our machines (Hopper), so that path has not run on a GPU."""
    if device.type != "cuda":
        return False
    from ..kernels import probe

    return probe.fp4_ok(device.index or 0)[0]


def packed(t: torch.Tensor, axis: int, fos: bool, rule: str, stochastic: bool = False, seed: int = 0, signs=None):
    """(packed E2M1 [rows, K/2], E4M3 block scales [rows, K/16], global) of t's NVFP4 operand as surogate::nvfp4_mm
    takes it, K being its GEMM's reduction dim: axis 1, t; axis 0, t^T with the tokens zero-padded to 16 (and
    transformed); axis 2, t in 16x16 tiles. The same values as qdq's (formats.nvfp4.nvfp4_operand)."""
    op = F.nvfp4_operand(t, axis, signs, transform=torch.ops.surogate.rht)
    return torch.ops.surogate.quantize_nvfp4(op.contiguous(), axis == 2, fos, rule, stochastic, seed, None)


def transpose_nvfp4_2d(packed_codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """W^T of a 16x16-tile NVFP4 tensor (layout only: codes and tile scales move, values do not change)."""
    codes = F.unpack_e2m1(packed_codes).t().contiguous()
    tiles = scale[:: F.NVFP4_BLOCK].t()  # [K/16, N/16]: one scale per 16x16 tile
    return F.pack_e2m1(codes), tiles.repeat_interleave(F.NVFP4_BLOCK, dim=0).contiguous(), global_scale


class NVFP4Engine:
    name = "nvfp4"

    def __init__(self, cfg):
        self.fos, self.rule = cfg.four_over_six, cfg.four_over_six_rule
        self.sr = not cfg.no_fp4_stochastic_rounding
        self.rht = cfg.fp4_rht
        self.weight_1d = cfg.fp4_weight_blocks == "1d"
        self.seed = cfg.seed

    def _operand(self, native: bool, t, axis, stochastic=False, seed=0, signs=None):
        """An operand as the GEMM of this device takes it: packed for FP4 tensor cores, else bf16 e2m1 * s_blk."""
        quantize = packed if native else qdq
        return quantize(t, axis, self.fos, self.rule, stochastic, seed, signs)

    def _quantize_weight(self, w, dgrad: bool, native: bool = False):
        """The weight operand of the forward (dgrad=False) or of the dgrad. 1D blocks run along each GEMM's reduction
        dim: K for the forward, N for the dgrad (qdq: laid out as W; packed: as W^T, rows K). 16x16 tiles serve both:
        the dgrad multiplies the transposed view (qdq) or the transposed codes (packed)."""
        if self.weight_1d:
            return self._operand(native, w, 0 if dgrad else 1)
        tiles = self._operand(native, w, 2)
        return transpose_nvfp4_2d(*tiles) if native and dgrad else tiles

    def _weight(self, owner, w, dgrad: bool, native: bool = False):
        """The quantized weight operand, built once per optimizer step (the layer's weight key) and reused by
        micro-batches, recomputes and (16x16 tiles, qdq) the dgrad."""
        if torch.compiler.is_compiling():
            return self._quantize_weight(w, dgrad, native)
        key = (owner._weight_key(), native)
        cached = getattr(owner, "_nvfp4_w", None)
        if cached is None or cached[0] != key:
            cached = owner._nvfp4_w = [key, None, None]
        slot = 2 if dgrad and (self.weight_1d or native) else 1
        if cached[slot] is None:
            cached[slot] = self._quantize_weight(w, dgrad, native)
        return cached[slot]

    def forward(self, owner, x, w, bias, need_dx=True, need_dw=True):
        warn_emulation_once("nvfp4_mm", x.device, "the NVFP4 recipe GEMM (no FP4 tensor cores used)")
        native = native_fp4(x.device)
        xq = self._operand(native, x, 1)
        wq = self._weight(owner, w, False, native)
        if native:
            y = torch.ops.surogate.nvfp4_mm(*xq, *wq, bias, x.dtype)
        else:
            y = gemm(xq[0], wq[0].t(), xq[1], wq[1], bias, x.dtype)
        if need_dx and (self.weight_1d or native):
            wq = self._weight(owner, w, True, native)
        return y, (x, *wq, native, owner.fwd_sr_step)

    def backward(self, owner, dy, saved, need_dx, need_dw):
        x, *wq, native, step = saved
        seed = lambda role: sr_seed(self.seed, owner.recipe_index, step, role) if self.sr else 0  # noqa: E731
        dx = dw = None
        if need_dx:
            dyq = self._operand(native, dy, 1, self.sr, seed(ROLE_DGRAD))
            if native:
                dx = torch.ops.surogate.nvfp4_mm(*dyq, *wq, None, dy.dtype)
            else:
                dx = gemm(dyq[0], wq[0], dyq[1], wq[1], None, dy.dtype)
        if need_dw:
            # the reduction runs over tokens: blocks along axis 0 (zero-padded to 16), the transform on both operands
            signs = owner.rht_signs if self.rht else None
            aq = self._operand(native, dy, 0, self.sr, seed(ROLE_WGRAD), signs)
            bq = self._operand(native, x, 0, signs=signs)
            if native:
                dw = torch.ops.surogate.nvfp4_mm(*aq, *bq, None, torch.float32)
            else:
                dw = gemm(aq[0].t(), bq[0], aq[1], bq[1], None, torch.float32)
        return dx, dw
