"""MXFP4 (OCP Microscaling v1.0): 32 consecutive elements share an E8M0 power-of-two scale.

    shared_exp = floor(log2(amax(block))) - 2        (2 = emax of E2M1)
    scale byte = clamp(shared_exp + 127, 0, 254);  255 (NaN) when the block holds NaN or inf
    q          = e2m1(x / 2^shared_exp)               (RNE, saturating at +-6)
Decode: x = e2m1_value * 2^(byte - 127). A zero block stores byte 0. Division by a power of two is
exact, so encode and decode have no rounding beyond the E2M1 rounding.

Layout: packed [..., K/2] (even index in the low nibble) and scales uint8 [..., K/32]; GPT-OSS
stores the packed data as `{name}_blocks` [E, rows, K/32, 16] and the scales as `{name}_scales`
[E, rows, K/32], which are reshapes of these.
"""

from __future__ import annotations

import torch

from .e2m1 import decode_packed_e2m1, e2m1_encode, e2m1_round, pack_e2m1

MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def check_mxfp4_shape(shape, name: str = "tensor") -> None:
    if len(shape) < 1 or shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 needs the last dimension of {name} to be a multiple of {MXFP4_BLOCK}; got shape {tuple(shape)}"
        )


SCALE_ROUNDINGS = ("floor", "ceil", "rtn", "best")


def _shared_exponent(xb: torch.Tensor, amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """The block's power-of-two exponent before biasing (int32), for a scale-rounding rule:

    floor  OCP MX v1.0: floor(log2 amax) - 2. The block max lands in [4, 8) and clips to 6 above 6.
    ceil   ceil(log2(amax / 6)): the smallest power of two that does not clip (max lands in (3, 6]).
    rtn    round(log2(amax / 6)) (log domain, ties up): nearest exponent to the ideal amax/6 scale;
           clips when amax/6 is above 2^(k + 0.5).
    best   per block, of floor and floor + 1 (the only two candidates that are neither wasteful nor
           clip more than floor) the one with the smaller squared error: the E8M0 analogue of
           Four Over Six's choice between two scales.
    Every rule yields a valid E8M0 scale; only the byte differs."""
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    floor = exp.to(torch.int32) - 1 - 2
    if rounding == "floor":
        return floor
    if rounding == "ceil":
        # amax / 2^floor is in [4, 8): it fits under 6 unless above 6, then one binade up
        return floor + (amax > 6.0 * torch.ldexp(torch.ones_like(amax), floor.float())).to(torch.int32)
    if rounding == "rtn":
        return torch.floor(torch.log2(amax / 6.0) + 0.5).nan_to_num(0.0).clamp(-200, 200).to(torch.int32)
    if rounding == "best":
        errs = []
        for cand in (floor, floor + 1):
            q = e2m1_round(torch.ldexp(xb, (-cand).unsqueeze(-1).float()))
            errs.append((torch.ldexp(q, cand.unsqueeze(-1).float()) - xb).square().sum(-1))
        return torch.where(errs[1] < errs[0], floor + 1, floor)
    raise ValueError(f"quantize_mxfp4: scale_rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")


def _encode_blocks(xb: torch.Tensor, biased: torch.Tensor, shape) -> torch.Tensor:
    """Packed E2M1 codes of the blocks xb [..., K/32, 32] on their biased E8M0 exponents (int): e2m1(x / 2^shared),
    the division by a power of two exact."""
    shared = biased.to(torch.int32) - E8M0_BIAS
    return pack_e2m1(e2m1_encode(torch.ldexp(xb, (-shared).unsqueeze(-1).float())).reshape(shape))


def quantize_mxfp4(x: torch.Tensor, scale_rounding: str = "floor"):
    """Returns (packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32]).

    scale_rounding: how the block exponent is chosen (see `_shared_exponent`); "floor" is the OCP spec's
    rule and the only one the kernels implement."""
    check_mxfp4_shape(x.shape)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xb.abs().amax(-1)
    shared = _shared_exponent(xb, amax, scale_rounding)
    biased = (shared + E8M0_BIAS).clamp(0, 254)
    biased = torch.where(amax == 0, torch.zeros_like(biased), biased)
    bad = ~torch.isfinite(amax)
    biased = torch.where(bad, torch.full_like(biased, E8M0_NAN), biased)
    return _encode_blocks(xb, biased, x.shape), biased.to(torch.uint8)


def encode_mxfp4_on_scales(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The packed E2M1 codes of x [..., K] on given E8M0 scales [..., K/32] (quantize_mxfp4's encode with its
    scales fixed; a power-of-two division is exact)."""
    check_mxfp4_shape(x.shape)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    return _encode_blocks(xb, scales.to(torch.int32), x.shape)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to fp32 powers of two; 255 -> NaN."""
    s = scales.to(torch.int32)
    v = torch.ldexp(torch.ones_like(s, dtype=torch.float32), (s - E8M0_BIAS).float())
    return torch.where(s == E8M0_NAN, torch.full_like(v, float("nan")), v)


def check_mxfp4_scales(packed: torch.Tensor, scales: torch.Tensor) -> None:
    """The scales a packed MXFP4 tensor needs: uint8 E8M0, [..., rows, K/32]."""
    k = packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // MXFP4_BLOCK):
        raise ValueError(
            f"MXFP4 scales have shape {tuple(scales.shape)}, expected {(*packed.shape[:-1], k // MXFP4_BLOCK)} "
            f"for packed data of shape {tuple(packed.shape)}"
        )
    if scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 E8M0 bytes, got {scales.dtype}")


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    check_mxfp4_scales(packed, scales)
    k = packed.shape[-1] * 2
    vals = decode_packed_e2m1(packed).reshape(*packed.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    return (vals * e8m0_to_float(scales).unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(out_dtype)


def fake_quantize_mxfp4(x: torch.Tensor, out_dtype=None, scale_rounding: str = "floor") -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(x, scale_rounding), out_dtype=out_dtype or x.dtype)
