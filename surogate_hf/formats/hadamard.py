"""Random Hadamard transform (RHT) on 16-element chunks of the last dim: y = (x * d) @ H16 / 4.

H16 is the Sylvester Hadamard matrix and d a fixed random +-1 vector. (d H16 / 4) is orthogonal, so
applying it to both operands along a GEMM's reduction dim leaves the product unchanged while
spreading outliers before FP4 quantization. The reference computes it as the fast Walsh-Hadamard
butterfly in fp32 (4 stages of a+b / a-b, then the exact multiply by 1/4), a fixed order of
operations a kernel can reproduce bit for bit.
"""

from __future__ import annotations

import torch

from .rng import hash32

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n (a power of two), unnormalised."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def random_signs(seed: int, n: int = HADAMARD_SIZE, device=None) -> torch.Tensor:
    """The fixed +-1 diagonal for `seed` (fp32 [n])."""
    bits = hash32(seed, torch.arange(n, device=device)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """x @ H16 along the last dim of a [..., 16] fp32 tensor (stage order: stride 8, 4, 2, 1)."""
    h = 8
    while h >= 1:
        x = x.reshape(*x.shape[:-1], 16 // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-3], 16)
        h //= 2
    return x


def _check(x: torch.Tensor) -> None:
    if x.shape[-1] % HADAMARD_SIZE:
        raise ValueError(
            f"the Hadamard transform works on chunks of {HADAMARD_SIZE} along the last dim; got shape {tuple(x.shape)}"
        )


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Forward transform of every 16-chunk of the last dim: ((x * d) @ H16) / 4, in fp32."""
    _check(x)
    xc = x.float().reshape(*x.shape[:-1], -1, HADAMARD_SIZE) * signs.float()
    return (_butterfly(xc) * 0.25).reshape(x.shape)


def inverse_rht(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of rht: (y @ H16 / 4) * d."""
    _check(y)
    yc = y.float().reshape(*y.shape[:-1], -1, HADAMARD_SIZE)
    return ((_butterfly(yc) * 0.25) * signs.float()).reshape(y.shape)
