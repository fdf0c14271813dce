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

from .e2m1 import decode_packed_e2m1, e2m1_encode, pack_e2m1

MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def check_mxfp4_shape(shape, name: str = "tensor") -> None:
    if len(shape) < 1 or shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 needs the last dimension of {name} to be a multiple of {MXFP4_BLOCK}; got shape {tuple(shape)}"
        )


def quantize_mxfp4(x: torch.Tensor):
    """Returns (packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32])."""
    check_mxfp4_shape(x.shape)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xb.abs().amax(-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = (exp.to(torch.int32) - 1) - 2
    biased = (shared + E8M0_BIAS).clamp(0, 254)
    biased = torch.where(amax == 0, torch.zeros_like(biased), biased)
    bad = ~torch.isfinite(amax)
    biased = torch.where(bad, torch.full_like(biased, E8M0_NAN), biased)
    shared = biased - E8M0_BIAS
    codes = e2m1_encode(torch.ldexp(xb, (-shared).unsqueeze(-1).float()))
    codes = codes.reshape(x.shape)
    return pack_e2m1(codes), biased.to(torch.uint8)


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


def fake_quantize_mxfp4(x: torch.Tensor, out_dtype=None) -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(x), out_dtype=out_dtype or x.dtype)
