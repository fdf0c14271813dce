"""The recipes' GPU paths against their references: the FP8 casts into the flat state bit for bit, the Hopper
nvfp4 GEMM to fp32 summation order, the eager and compiled fp8 models against CPU and each other."""

from __future__ import annotations

import warnings

import pytest
import torch

import surogate_hf.kernels as K
import surogate_hf.recipes as R
from surogate_hf import formats as F
from surogate_hf.recipes.fp8_hybrid import cast
from surogate_hf.recipes.scaling import Fp8ScalingState
from test_recipes_scaling import tiny

_ok, _why = K.triton_ok()
_fp8, _fp8_why = K.fp8_ok()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ok, reason=_why)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _u8(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", [(1, 576), (333, 192), (4096, 1536), (7, 2880)])
@pytest.mark.parametrize("fmt", [F.E4M3, F.E5M2])
@pytest.mark.parametrize("current", [False, True])
def test_cast_into_state_is_bit_exact(shape, fmt, current):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    states = []
    for dev in ("cpu", "cuda"):
        st = Fp8ScalingState(2, device=dev)
        st.scale.fill_(37.5)
        st.scale_inv.fill_(1 / 37.5)
        st.amax[3] = 0.5
        out = cast(x.to(dev), st.scale, st.scale_inv, st.amax, 3, fmt, True, True, current)
        states.append((out, st))
    (q0, qt0, s0), st0 = states[0]
    (q1, qt1, s1), st1 = states[1]
    assert torch.equal(_u8(q1), _u8(q0)) and torch.equal(_u8(qt1), _u8(qt0))
    assert s1.item() == s0.item()
    assert torch.equal(st1.amax.cpu(), st0.amax), "the running amax of row 3 (and nothing else)"


@pytest.mark.parametrize("m, k, n", [(48, 64, 32), (1000, 576, 1536), (4096, 2048, 6144)])
def test_nvfp4_mm_on_bf16_tensor_cores(m, k, n):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qa = F.quantize_nvfp4(a)
    qb = F.quantize_nvfp4(b, block_2d=True)
    args = (qa.packed, qa.block_scale, qa.global_scale, qb.packed, qb.block_scale, qb.global_scale)
    bias = torch.randn(n, generator=g).bfloat16()
    ref = torch.ops.surogate.nvfp4_mm(*args, bias, torch.float32)
    out = torch.ops.surogate.nvfp4_mm(*[t.cuda() for t in args], bias.cuda(), torch.float32).cpu()
    # operands are exact in bf16; only the fp32 summation order differs
    tol = k * 2.0**-23 * (F.dequantize_nvfp4(qa.packed, qa.block_scale, qa.global_scale, torch.float32).abs()
                          @ F.dequantize_nvfp4(qb.packed, qb.block_scale, qb.global_scale, torch.float32).abs().t())
    assert ((out - ref).abs() <= tol + 1e-6).all()


def _train(m, device, steps=3, compiled=False, dim=256):
    m = m.to(device)
    run = torch.compile(m, fullgraph=True) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=device == "cuda")
    losses = []
    for i in range(steps):
        x = torch.randn(4, 100, dim, generator=torch.Generator().manual_seed(i)).bfloat16().to(device)
        loss = run(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m


@pytest.mark.skipif(not _fp8, reason=_fp8_why)
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_recipe_on_gpu_matches_cpu(compiled):
    """bf16 model, fp32 masters, fused AdamW on the GPU; eager or compiled (inductor, fullgraph) against the
    CPU reference: the same loss curve within GEMM summation order, and the same recipe state."""
    torch._dynamo.reset()
    kw = dict(model_dtype="bf16", master_dtype="fp32", amax_history_len=4)
    lc, mc = _train(R.apply_recipe(tiny(dim=256).bfloat16(), "fp8-hybrid", **kw), "cpu")
    lg, mg = _train(R.apply_recipe(tiny(dim=256).bfloat16(), "fp8-hybrid", **kw), "cuda", compiled=compiled)
    assert lg == pytest.approx(lc, rel=2e-2)
    torch.testing.assert_close(mg.surogate_fp8_state.amax_history.cpu(), mc.surogate_fp8_state.amax_history,
                               rtol=2e-2, atol=0)


def test_nvfp4_recipe_on_gpu_matches_cpu():
    lc, _ = _train(R.apply_recipe(tiny(dim=256).bfloat16(), "nvfp4"), "cpu", steps=2)
    lg, _ = _train(R.apply_recipe(tiny(dim=256).bfloat16(), "nvfp4"), "cuda", steps=2)
    assert lg == pytest.approx(lc, rel=2e-2)
