"""Triton kernels run by Triton's CPU interpreter against their references, where triton is installed (CI has none:
skipped there with the reason). A subprocess, because TRITON_INTERPRET must be set before triton is imported."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_CHECK_WGRAD = textwrap.dedent("""
    import torch
    import surogate_hf.ops  # noqa: F401
    from surogate_hf.kernels import triton_fp8_wgrad as W
    torch.manual_seed(0)
    for t, n, k in [(256, 128, 128), (300, 96, 200), (77, 40, 130), (1, 16, 16)]:
        dy = (torch.randn(t, n) * 0.01).bfloat16()
        x = (torch.randn(t, k) * 3).bfloat16()
        got = W.fp8_tiles_wgrad(dy, x, 128, torch.float32)
        ref = torch.ops.surogate.fp8_tiles_wgrad(dy, x, 128, torch.float32)
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (t, n, k, err)
    print("ok")
""")


@pytest.mark.parametrize("check", [_CHECK_WGRAD], ids=["fp8_tiles_wgrad"])
def test_kernel_matches_the_reference_in_the_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
