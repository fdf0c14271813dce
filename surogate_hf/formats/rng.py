"""Counter-based uniform random numbers for stochastic rounding.

A hash of (seed, element index) instead of a stateful generator, so that the reference and the GPU
kernels draw the very same number for the same element: that is what makes stochastic rounding
replayable and testable bit for bit. The hash is murmur3's 32-bit finalizer.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def seed_mix(seed) -> int | torch.Tensor:
    """(seed * golden) mod 2^32 of an int seed, or elementwise of an int64 tensor of seeds (the int64 product wraps
    mod 2^64, which keeps its low 32 bits: the same value)."""
    if isinstance(seed, torch.Tensor):
        return (seed.to(torch.int64) * _GOLDEN) & _M32
    return (int(seed) * _GOLDEN) & _M32


def hash32(seed, offsets: torch.Tensor) -> torch.Tensor:
    """32-bit hash of `offsets` (int64 tensor of element indices) under `seed`, as int64 in [0, 2^32). `seed` is an
    int, or an int64 tensor that broadcasts against offsets (a seed computed on the device: no host read, traceable)."""
    h = (offsets.to(torch.int64) + seed_mix(seed)) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h


def hash32_int(seed: int, offset: int) -> int:
    """hash32 of one Python int offset, in Python arithmetic (no tensor, no device): seeds derived per call."""
    h = (int(offset) + ((int(seed) * _GOLDEN) & _M32)) & _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_from_counter(seed, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) with 24 random bits, one per offset."""
    return (hash32(seed, offsets) >> 8).to(torch.float32) * (2.0**-24)


def uniform_like(x: torch.Tensor, seed) -> torch.Tensor:
    """One uniform per element of `x`, indexed by the element's row-major position."""
    offsets = torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
    return uniform_from_counter(seed, offsets)
