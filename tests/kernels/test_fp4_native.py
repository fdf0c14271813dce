"""The SM100 native NVFP4 GEMM's CPU-checkable parts (kernels.fp4_native): the cuBLAS 128x4 scale layout and the
gate. The GEMM itself needs FP4 tensor cores, which none of our machines has: it has never run."""

from __future__ import annotations

import pytest
import torch

from surogate_hf.kernels import fp4_native, probe


def _blocked_index(r: int, c: int, cols_padded: int) -> int:
    """cuBLAS's block-scaling-factor layout, written from its documentation: 128x4 tiles in row-major order, 512
    bytes each; inside a tile the scale of (row, col) sits at (row % 32) * 16 + (row % 128 // 32) * 4 + col % 4."""
    tile = (r // 128) * (cols_padded // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


@pytest.mark.parametrize("rows, cols", [(128, 4), (200, 10), (5, 3), (256, 8)])
def test_to_blocked_follows_the_cublas_layout(rows, cols):
    scales = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    out = fp4_native.to_blocked(scales)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert out.shape == (rp * cp,)
    want = torch.zeros(rp * cp, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            want[_blocked_index(r, c, cp)] = scales[r, c]
    assert torch.equal(out, want)  # (padding scales are zero)


def test_native_fp4_is_gated_off_here(monkeypatch):
    a = torch.zeros(16, 32, dtype=torch.uint8)
    ok, why = fp4_native.supported(a, a)
    assert not ok and why
    probe.fp4_ok.cache_clear()
    monkeypatch.setenv("SUROGATE_HF_NATIVE_FP4", "0")
    assert probe.fp4_ok() == (False, "disabled by SUROGATE_HF_NATIVE_FP4=0")
    probe.fp4_ok.cache_clear()
