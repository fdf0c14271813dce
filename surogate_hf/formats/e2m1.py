"""FP4 E2M1 elements: encode (round-to-nearest-even or stochastic), decode, and nibble packing.

Codes are 4 bits, sign in bit 3, magnitude index in bits 0-2 over the levels
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes per byte, the element with the even index in the low
nibble: the layout of ModelOpt NVFP4 checkpoints, of GPT-OSS MXFP4 blocks and of
torch.float4_e2m1fn_x2.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decode table indexed by the 4-bit code.
E2M1_VALUES = E2M1_LEVELS + tuple(-v for v in E2M1_LEVELS)


def e2m1_table(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes, nearest with ties to the even code, saturating at +-6.

    Decision thresholds between neighbouring levels: a tie moves to the level whose code is even
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). NaN encodes to zero: callers
    carry NaN through the block scale instead.
    """
    a = x.float().abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value (fp32): the value e2m1_encode's code decodes to."""
    return e2m1_decode(e2m1_encode(x))


def e2m1_encode_stochastic(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes stochastically: up with probability (|x|-lo)/(hi-lo).

    `uniform` holds one draw in [0, 1) per element (see rng.uniform_from_counter). The gap between
    neighbouring levels is a power of two, so the probability is formed by an exact multiply.
    Values beyond +-6 saturate.
    """
    a = x.float().abs().clamp(max=E2M1_MAX)
    lo_code = (
        (a >= 0.5).to(torch.uint8) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0) + (a >= 4.0) + (a >= 6.0)
    ).to(torch.int64)
    levels = torch.tensor(E2M1_LEVELS + (E2M1_MAX,), dtype=torch.float32, device=x.device)
    inv_gap = torch.tensor((2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.0), dtype=torch.float32, device=x.device)
    p_up = (a - levels[lo_code]) * inv_gap[lo_code]
    code = (lo_code + (uniform < p_up).to(torch.int64)).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) to fp32 values."""
    return e2m1_table(codes.device)[(codes & 0xF).long()]


def decode_packed_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes -> [..., K] fp32 values; the same as e2m1_decode(unpack_e2m1(packed)),
    through one 256 x 2 table lookup (an order of magnitude faster on CPU than decoding nibbles)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"decode_packed_e2m1: expected uint8 packed codes, got {packed.dtype}")
    b = torch.arange(256, device=packed.device)
    table = e2m1_table(packed.device)
    pairs = torch.stack((table[b & 0xF], table[b >> 4]), dim=-1)
    out = torch.nn.functional.embedding(packed.long(), pairs)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1: expected uint8 packed codes, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
