"""NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 elements, one FP32 global scale per tensor.

Encode (Transformer Engine's reference order, kept here so kernels can match it bit for bit):
    S            = 448 (the E4M3 maximum, with or without Four-Over-Six)
    global_enc   = 6 * S / amax(tensor)          global_dec = amax(tensor) / (6 * S)  (= weight_scale_2)
    s_blk        = e4m3(min(amax(block) / m * global_enc, 448))      m = 6 (or 4, see below)
    enc_blk      = min(1 / (s_blk * global_dec), FLT_MAX)
    q            = e2m1(x * enc_blk)                                  (RNE, or stochastic)
Decode:  x = (e2m1_value * s_blk) * global_dec   (the first product is exact: one rounding in all).

Blocks: 1D = 16 consecutive elements of the last dim (activations, gradients, ModelOpt weights);
2D = 16 x 16 tiles of the last two dims (training weights, so W and W^T quantize alike). The
returned block scales always have the 1D layout [..., rows, K/16] (2D tiles repeated over their
16 rows), which is ModelOpt's `weight_scale` layout.

Four-Over-Six (4/6): per block, quantize with m = 6 and with m = 4 and keep the candidate whose
error against x is lower by `rule` ("mse", "mae" or "abs_max"); ties keep m = 6. The global scale stays
at S = 448: for the blocks within 2/3 of the tensor amax the m = 4 scale clamps at 448, its error says so
and m = 6 is kept, so per block 4/6 is never worse than m = 6 alone. The 4/6 paper lowers S to 256 so that
every block may take m = 4; that costs every block 0.8 bit of E4M3 range at the bottom (on the real model
of benchmarks/convergence.py: all-FP4 step-0 validation loss 5.80 with 256, 5.54 with 448; docs/fidelity.md
has what training then did). Errors are summed in a fixed pairwise order so kernels can reproduce the
choice exactly. With stochastic rounding the choice is made on the round-to-nearest candidates and the
chosen scale is then used for the stochastic encode.

NaN anywhere in the tensor makes its global scale NaN, so the whole tensor decodes to NaN: a NaN
never hides behind a finite quantized value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .e2m1 import E2M1_MAX, decode_packed_e2m1, e2m1_decode, e2m1_encode, e2m1_encode_stochastic, pack_e2m1
from .fp8 import E4M3, FP8_MAX
from .hadamard import rht
from .rng import uniform_like

NVFP4_BLOCK = 16
FOUR_OVER_SIX_RULES = ("mse", "mae", "abs_max")
_FLT_MAX = torch.finfo(torch.float32).max


class NVFP4Quantized(NamedTuple):
    packed: torch.Tensor  # uint8 [..., rows, K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., rows, K/16]
    global_scale: torch.Tensor  # fp32 scalar, the decode global (ModelOpt weight_scale_2)


# S * 6 of the encode above: the tensor amax maps to the largest E4M3 block scale times the largest E2M1 element
GLOBAL_RANGE = FP8_MAX[E4M3] * E2M1_MAX


def nvfp4_global_scales(amax: torch.Tensor):
    """(encode, decode) global scales from a tensor amax. Zero amax gives 1 (the tensor is zeros)."""
    s = GLOBAL_RANGE
    amax = amax.float()
    zero = amax == 0
    enc = torch.where(zero, torch.ones_like(amax), s / torch.where(zero, torch.ones_like(amax), amax))
    dec = torch.where(zero, torch.ones_like(amax), amax / s)
    return enc, dec


def _block_encode_scale(block_scale: torch.Tensor, global_dec: torch.Tensor) -> torch.Tensor:
    """enc_blk = min(1 / (s_blk * global_dec), FLT_MAX): what a block's elements are multiplied by before E2M1."""
    return (1.0 / (block_scale.float() * global_dec.float())).clamp(max=_FLT_MAX)


def _tree_sum(e: torch.Tensor) -> torch.Tensor:
    while e.shape[-1] > 1:
        half = e.shape[-1] // 2
        e = e[..., :half] + e[..., half:]
    return e[..., 0]


def _block_error(deq: torch.Tensor, x: torch.Tensor, rule: str) -> torch.Tensor:
    d = deq - x
    if rule == "mse":
        return _tree_sum(d * d)
    if rule == "mae":
        return _tree_sum(d.abs())
    return d.abs().amax(-1)


def _to_blocks(t: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """[..., R, K] -> [..., nR, nK, B] with B = 16 (1D, nR = R) or 256 (2D, row-major inside a tile)."""
    *lead, r, k = t.shape
    if not block_2d:
        return t.reshape(*lead, r, k // 16, 16)
    t = t.reshape(*lead, r // 16, 16, k // 16, 16)
    return t.transpose(-3, -2).reshape(*lead, r // 16, k // 16, 256)


def _from_blocks(t: torch.Tensor, block_2d: bool, r: int, k: int) -> torch.Tensor:
    *lead, _, _, _ = t.shape
    if not block_2d:
        return t.reshape(*lead, r, k)
    t = t.reshape(*lead, r // 16, k // 16, 16, 16).transpose(-3, -2)
    return t.reshape(*lead, r, k)


def check_nvfp4_shape(shape, block_2d: bool, name: str = "tensor") -> None:
    if len(shape) < 1 or shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs the last dimension of {name} to be a multiple of {NVFP4_BLOCK}; got shape {tuple(shape)}"
        )
    if block_2d and (len(shape) < 2 or shape[-2] % NVFP4_BLOCK):
        raise ValueError(
            f"NVFP4 2D (16x16) blocks need the last two dimensions of {name} to be multiples of {NVFP4_BLOCK}; "
            f"got shape {tuple(shape)}"
        )


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block_2d: bool = False,
    four_over_six: bool = True,
    rule: str = "mse",
    stochastic: bool = False,
    seed: int | torch.Tensor = 0,
    amax: torch.Tensor | None = None,
) -> NVFP4Quantized:
    """Quantize the last dim (and, with block_2d, the second-to-last) of `x` to NVFP4.

    `amax` overrides the tensor amax used for the global scale (e.g. one amax shared by the shards
    of a fused weight). `seed` (an int, or a 0-dim int64 tensor of the same value: the same draws) picks the
    stochastic-rounding stream; the draw for an element is
    indexed by its row-major position in `x`.
    """
    if rule not in FOUR_OVER_SIX_RULES:
        raise ValueError(f"four_over_six rule must be one of {FOUR_OVER_SIX_RULES}, got {rule!r}")
    check_nvfp4_shape(x.shape, block_2d)
    squeeze = x.dim() == 1
    xf = x.float().unsqueeze(0) if squeeze else x.float()
    r, k = xf.shape[-2:]
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    g_enc, g_dec = nvfp4_global_scales(amax)

    xb = _to_blocks(xf, block_2d)
    blk_amax = xb.abs().amax(-1)

    def candidate(m: float):
        s = (blk_amax / m * g_enc).clamp(max=FP8_MAX[E4M3]).to(E4M3)
        enc = _block_encode_scale(s, g_dec)
        codes = e2m1_encode(xb * enc.unsqueeze(-1))
        deq = (e2m1_decode(codes) * s.float().unsqueeze(-1)) * g_dec
        return s, enc, codes, deq

    s, enc, codes, deq = candidate(E2M1_MAX)
    if four_over_six:
        s4, enc4, codes4, deq4 = candidate(4.0)
        use4 = _block_error(deq4, xb, rule) < _block_error(deq, xb, rule)
        s = torch.where(use4, s4, s)
        enc = torch.where(use4, enc4, enc)
        codes = torch.where(use4.unsqueeze(-1), codes4, codes)
    if stochastic:
        u = _to_blocks(uniform_like(xf, seed), block_2d)
        codes = e2m1_encode_stochastic(xb * enc.unsqueeze(-1), u)

    codes = _from_blocks(codes, block_2d, r, k)
    if block_2d:
        s = s.repeat_interleave(NVFP4_BLOCK, dim=-2)
    packed = pack_e2m1(codes)
    if squeeze:
        packed, s = packed[0], s[0]
    return NVFP4Quantized(packed, s, g_dec.reshape(()))


def encode_nvfp4_on_scales(x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The packed E2M1 codes of x [..., R, K] on given 1D block scales and decode global (the encode of
    quantize_nvfp4 with its scales fixed): e2m1(x * min(1 / (s_blk * global_dec), FLT_MAX)), round to nearest."""
    *lead, r, k = x.shape
    enc = _block_encode_scale(block_scale, global_scale)
    codes = e2m1_encode(x.float().reshape(*lead, r, k // NVFP4_BLOCK, NVFP4_BLOCK) * enc.unsqueeze(-1))
    return pack_e2m1(codes.reshape(x.shape))


def check_nvfp4_scales(packed: torch.Tensor, block_scale: torch.Tensor) -> None:
    """The block scale a packed NVFP4 tensor needs: E4M3, [..., rows, K/16]."""
    k = packed.shape[-1] * 2
    if tuple(block_scale.shape) != (*packed.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(
            f"NVFP4 block scale has shape {tuple(block_scale.shape)}, expected "
            f"{(*packed.shape[:-1], k // NVFP4_BLOCK)} for packed data of shape {tuple(packed.shape)}"
        )
    if block_scale.dtype != E4M3:
        raise TypeError(f"NVFP4 block scale must be float8_e4m3fn, got {block_scale.dtype}")


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """Inverse of quantize_nvfp4: packed [..., R, K/2], block_scale [..., R, K/16], global scalar."""
    check_nvfp4_scales(packed, block_scale)
    vals = decode_packed_e2m1(packed)
    s = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return ((vals * s) * global_scale.float()).to(out_dtype)


def fake_quantize_nvfp4(x: torch.Tensor, out_dtype=None, **kwargs) -> torch.Tensor:
    """quantize then dequantize: the values an NVFP4 GEMM operand really holds."""
    qt = quantize_nvfp4(x, **kwargs)
    return dequantize_nvfp4(*qt, out_dtype=out_dtype or x.dtype)


QDQ_AXES = (0, 1, 2)  # blocks down columns, along rows, 16 x 16 tiles


def nvfp4_operand(x: torch.Tensor, axis: int, signs: torch.Tensor | None = None, transform=rht) -> torch.Tensor:
    """The tensor an NVFP4 GEMM operand quantizes, from a 2-D x [R, C]:
    axis 1: x itself (1D blocks along rows); axis 0: x^T with its R columns zero-padded to a multiple of 16, [C, Rp]
    (blocks down x's columns: the wgrad operands, reduced over tokens); axis 2: x itself in 16 x 16 tiles (the
    training weight). With `signs` (axes 0 and 1), the random Hadamard transform of the 1D blocks (fp32), by
    `transform(t, signs)` (a kernel's own transform can stand in for the reference's)."""
    if x.dim() != 2 or axis not in QDQ_AXES:
        raise ValueError(f"nvfp4 operand: x must be 2-D and axis 0, 1 or 2; got shape {tuple(x.shape)}, axis {axis}")
    if axis == 2 and signs is not None:
        raise ValueError("nvfp4 operand: 16x16 tiles (axis 2) take no Hadamard transform")
    t = x
    if axis == 0:
        pad = (-x.shape[0]) % NVFP4_BLOCK
        t = torch.nn.functional.pad(x.t(), (0, pad)) if pad else x.t()
    if signs is not None:
        t = transform(t, signs)
    return t


def qdq_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, *, axis: int, signs: torch.Tensor | None = None,
              four_over_six: bool = True, rule: str = "mse", stochastic: bool = False, seed: int | torch.Tensor = 0):
    """(values, global_scale): x's NVFP4 operand (nvfp4_operand) quantized with the global scale of `amax` (None: the
    operand's own), returned as
    e2m1 * s_blk in bf16 (exact: at most 5 significant bits, within bf16's range) laid out like x ([R, C], or
    [Rp, C] for axis 0), and the decode global. values * global is the dequantized operand; a GEMM over two such
    operands with fp32 accumulation, scaled by the product of their globals, is the NVFP4 GEMM (the nvfp4 recipe's
    operands on GPUs without FP4 tensor cores). Stochastic draws are indexed in the quantized tensor (x^T for
    axis 0)."""
    t = nvfp4_operand(x, axis, signs)
    q = quantize_nvfp4(t, block_2d=axis == 2, four_over_six=four_over_six, rule=rule, stochastic=stochastic, seed=seed,
                       amax=amax)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    v = dequantize_nvfp4(q.packed, q.block_scale, one, torch.bfloat16)
    return (v.t().contiguous() if axis == 0 else v), q.global_scale


def mm_qdq(a: torch.Tensor, b: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """cast((a @ b) * (ga * gb) + bias, out_dtype) for two qdq_nvfp4 operands a [M, K], b [K, N] (e2m1 * s_blk) and
    their decode globals: the NVFP4 GEMM (fp32 products and sums, the globals' product applied once, the bias added
    in fp32, one rounding). A GPU kernel differs by fp32 summation order only."""
    out = (a.float() @ b.float()) * (ga.float() * gb.float()).reshape(())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
