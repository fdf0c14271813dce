"""surogate::nvfp4_mm on FP4 tensor cores (SM 10.0+): cuBLASLt's block-scaled GEMM through torch._scaled_mm.

The packed E2M1 operands go in as torch.float4_e2m1fn_x2 and their E4M3 block scales in cuBLAS's 128x4 tiled layout
(`to_blocked`, https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout); the GEMM accumulates
in fp32 and writes fp32, and the product of the two globals, the bias and one rounding follow in one pass, as
surogate::nvfp4_mm's contract states (fp32 summation order is the only freedom).

Status: no GPU we can reach has FP4 tensor cores (H100 / H200 are SM 9.0). This path is written but has never run;
`to_blocked` and the argument plumbing are checked on CPU (tests/kernels/test_fp4_native.py), the GEMM itself is not.
kernels.probe.fp4_ok() gates it; everywhere else the operands run exactly on bf16 tensor cores (kernels.nvfp4_qdq).
"""

from __future__ import annotations

import torch

from . import probe
from ..ops._warn import warn_once

# cuBLASLt reads each packed row in 16-byte units: K / 2 bytes a multiple of 16
K_MULTIPLE = 32


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """[R, C] block scales -> the flat cuBLAS 128x4-tiled layout (R padded to 128 and C to 4 with zeros): tile
    (r // 128, c // 4) in row-major order, inside it row r % 32 of 32, then (r % 128) // 32, then c % 4."""
    r, c = scales.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    padded = scales
    if (rp, cp) != (r, c):
        padded = scales.new_zeros((rp, cp))
        padded[:r, :c] = scales
    blocks = padded.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)  # [rt, ct, 128, 4]
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)  # 128 rows = 4 groups of 32, interleaved


def supported(a_packed: torch.Tensor, b_packed: torch.Tensor) -> tuple[bool, str]:
    """Whether the native GEMM takes these operands on their device (else the bf16 tensor-core emulation runs)."""
    ok, why = probe.fp4_ok(a_packed.device.index or 0)
    if not ok:
        return ok, why
    k = a_packed.shape[-1] * 2
    if k % K_MULTIPLE:
        return False, f"the native FP4 GEMM needs the reduction dim to be a multiple of {K_MULTIPLE}, got {k}"
    return True, ""


def nvfp4_mm(a_packed, a_scale, a_global, b_packed, b_scale, b_global, bias, out_dtype, epilogue):
    """cast((A @ B^T) * (ga * gb) + bias, out_dtype) on FP4 tensor cores; `epilogue(acc, ga, gb, bias, out_dtype)`
    applies the globals, the bias and the rounding to the fp32 result."""
    warn_once("nvfp4_native", "surogate_hf: surogate::nvfp4_mm runs on FP4 tensor cores (cuBLASLt block-scaled "
              "GEMM); this path was written without an SM100 GPU to run it on: report any mismatch")
    e4m3 = torch.float8_e4m3fn
    acc = torch._scaled_mm(
        a_packed.contiguous().view(torch.float4_e2m1fn_x2),
        b_packed.contiguous().view(torch.float4_e2m1fn_x2).t(),
        to_blocked(a_scale.view(torch.uint8)).view(e4m3),
        to_blocked(b_scale.view(torch.uint8)).view(e4m3),
        out_dtype=torch.float32,
    )
    return epilogue(acc, a_global, b_global, bias, out_dtype)
