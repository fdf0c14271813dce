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


_CHECK_NVFP4 = textwrap.dedent("""
    import torch
    from surogate_hf import formats as F
    from surogate_hf.kernels.triton_quant import nvfp4 as K
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-4, 0, 64)[:, None]
    x[0, 0] = 400.0  # blocks within 2/3 of the amax: the max-4 scale clamps at 448
    for block_2d in (False, True):
        for fos in (False, True):
            got = K.quantize_nvfp4(x, block_2d, fos, "mse", False, 0, None)
            ref = F.quantize_nvfp4(x, block_2d=block_2d, four_over_six=fos)
            assert torch.equal(got[0], ref.packed), (block_2d, fos, "codes")
            assert torch.equal(got[1].view(torch.uint8), ref.block_scale.view(torch.uint8)), (block_2d, fos, "scales")
            assert torch.equal(got[2].reshape(()), ref.global_scale), (block_2d, fos, "global")
    print("ok")
""")


_CHECK_NVFP4_RECIPE = textwrap.dedent("""
    import torch
    from surogate_hf import formats as F
    from surogate_hf.kernels import triton_recipe as TR
    from surogate_hf.kernels.triton_quant import hadamard as H
    torch.manual_seed(0)
    # the Hadamard transform of a transposed (column-major) view, read in place, and of a contiguous tensor
    signs = F.hadamard.random_signs(3)
    for x in (torch.randn(48, 40).bfloat16().t(), torch.randn(40, 48).bfloat16(), torch.randn(5, 32, 33)[1].t()):
        got, ref = H.rht(x, signs), F.rht(x, signs)
        assert got.is_contiguous() and torch.equal(got, ref), tuple(x.shape)
    # the nvfp4 GEMM's epilogue: acc * (ga * gb) + bias, one cast, against the reference's torch ops
    acc = torch.randn(37, 24) * 1e3
    ga, gb = torch.tensor(3.1e-3), torch.tensor(0.77)
    for bias in (None, torch.randn(24).bfloat16(), torch.randn(24)):
        ref = acc * (ga.float() * gb.float())
        ref = ref + bias.float() if bias is not None else ref
        got = TR.scale_bias_cast(acc.clone(), ga, gb, bias, torch.float32)
        assert torch.equal(got, ref), ("fp32", bias is None)
    print("ok")
""")


_CHECK_SPLITK = textwrap.dedent("""
    import torch
    from surogate_hf import formats as F
    from surogate_hf.kernels import paths, triton_gemm as TG
    torch.manual_seed(0)
    # few-token weight-only GEMMs (split reduction + fixed-order sum) against dequantize + fp32 matmul; fp32
    # activations (the interpreter truncates the bf16 path's casts; the GPU tests cover bf16)
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        for n, k in ((40, 2880), (2880, 64)):
            w = torch.randn(n, k) * 0.02
            if fmt == "nvfp4":
                q = F.quantize_nvfp4(w, block_2d=False, four_over_six=True)
                args = (TG.NVFP4, q.packed, q.block_scale, q.global_scale.reshape(1).float(), None)
                wref = F.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale, torch.float32)
            elif fmt == "mxfp4":
                packed, scales = F.quantize_mxfp4(w)
                args, wref = (TG.MXFP4, packed, scales, None, None), F.dequantize_mxfp4(packed, scales, torch.float32)
            else:
                packed, state = F.quantize_nf4(w.bfloat16(), 64, True)
                absmax = F.nf4_absmax(state)
                args = (TG.NF4, packed, absmax.float(), None, state.code.float())
                wref = F.dequantize_nf4_raw(packed, absmax, state.code, 64, (n, k), torch.float32)
            for m in (1, 7, 33):
                x, dy = torch.randn(m, k), torch.randn(m, n)
                assert max(paths.splitk_plan(m, k, n, 132)[0], paths.splitk_plan(m, n, k, 132)[0]) > 1
                for got, ref in ((TG.linear(args[0], x, *args[1:], n=n, k=k, nf4_bs=64), x @ wref.t()),
                                 (TG.linear_dgrad(args[0], dy, *args[1:], n=n, k=k, nf4_bs=64), dy @ wref)):
                    err = ((got - ref).norm() / ref.norm()).item()
                    assert err < 1e-5, (fmt, n, k, m, err)
    print("ok")
""")


@pytest.mark.parametrize("check", [_CHECK_WGRAD, _CHECK_NVFP4, _CHECK_NVFP4_RECIPE, _CHECK_SPLITK],
                         ids=["fp8_tiles_wgrad", "nvfp4_quantize", "nvfp4_recipe_rht_epilogue", "weight_only_few_tokens"])
def test_kernel_matches_the_reference_in_the_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1", SUROGATE_HF_AUTOTUNE="0")
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
