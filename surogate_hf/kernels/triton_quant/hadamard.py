"""The randomized Hadamard transform's kernel (formats.hadamard): 16-point butterflies with random signs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _EXACT


@triton.jit
def _rht_kernel(x_ptr, sg_ptr, out_ptr, R, C, SR, SC, ROWS: tl.constexpr, NB: tl.constexpr):
    """out [R, C] (contiguous) = the transform of x [R, C] read through its strides (SR, SC): a transposed view
    (the wgrad operands dy^T, x^T) is read in place, not copied first."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (NB * 16) + tl.arange(0, NB * 16)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * SR + cols[None, :].to(tl.int64) * SC, mask=m,
                other=0.0).to(tl.float32)
    sg = tl.load(sg_ptr + (tl.arange(0, NB * 16) & 15)).to(tl.float32)
    x = x * sg[None, :]
    N: tl.constexpr = ROWS * NB
    # butterfly stages of stride 8, 4, 2, 1: (a, b) -> (a + b, a - b)
    y = tl.reshape(x, (N, 1, 2, 8))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 2, 2, 4))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 4, 2, 2))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (N, 8, 2, 1))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    y = tl.reshape(y, (ROWS, NB * 16)) * 0.25
    tl.store(out_ptr + offs, y, mask=m)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 16:
        raise ValueError(f"the Hadamard transform works on chunks of 16 along the last dim; got shape {tuple(x.shape)}")
    if signs.numel() != 16:
        raise ValueError(f"rht signs must have 16 entries, got shape {tuple(signs.shape)}")
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # a 2-D view keeps its strides (read in place)
    r = x2.shape[0]
    out = torch.empty((r, k), dtype=torch.float32, device=x.device)
    if r and k:
        # a column-major view (unit stride along rows, e.g. dy^T): 32 rows per program, so the rows a program reads
        # of one column are 32 contiguous elements
        rows = 32 if x2.stride(0) == 1 and k > 1 else 16
        _rht_kernel[(triton.cdiv(r, rows), triton.cdiv(k // 16, 8))](
            x2, signs.float().contiguous(), out, r, k, x2.stride(0), x2.stride(1), ROWS=rows, NB=8, **_EXACT,
            num_warps=4)
    return out.reshape(x.shape)
