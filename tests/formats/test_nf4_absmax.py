"""NF4's double-quantized absmax decode (formats.nf4.dequantize_blockwise) is bitsandbytes' own, bit for bit, and
traces: a compiled NF4 linear that reads its slots inside the graph matches eager (bitsandbytes' CPU op returned
NaN there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from surogate_hf import formats as F
from surogate_hf.formats.nf4 import dequantize_blockwise
from surogate_hf.nn import linear as L


@pytest.mark.parametrize("shape, block", [((256, 128), 64), ((1000, 576), 64), ((960, 2880), 128), ((7, 64), 64)])
def test_matches_bitsandbytes(shape, block):
    import bitsandbytes.functional as bf

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16() * 0.05
    _, st = F.quantize_nf4(w, block)
    ours = dequantize_blockwise(st.absmax, st.state2.absmax, st.state2.code, st.state2.blocksize)
    assert torch.equal(ours, bf.dequantize_blockwise(st.absmax, st.state2))


def test_compiled_nf4_linear_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = L.NF4Linear.from_linear(nn.Linear(128, 256, bias=False).bfloat16())
    x = torch.randn(4, 128).bfloat16()
    eager = base(x)
    compiled = torch.compile(base, fullgraph=True)(x)
    assert not torch.isnan(compiled).any()
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- the scale search (nf4_scale_search)
@pytest.mark.parametrize("double_quant", [True, False])
def test_scale_search_writes_a_bitsandbytes_tensor_with_less_error(double_quant):
    import bitsandbytes.functional as bf

    w = torch.randn(192, 640, generator=torch.Generator().manual_seed(1)) * 0.02
    p0, s0 = F.quantize_nf4(w, 64, double_quant)
    p1, s1 = F.quantize_nf4(w, 64, double_quant, scale_search=True)
    assert p1.shape == p0.shape and p1.dtype == p0.dtype and s1.nested == s0.nested
    deq1 = bf.dequantize_4bit(p1, s1).float()  # bitsandbytes itself reads it
    assert torch.equal(deq1, F.dequantize_nf4_raw(p1, F.nf4_absmax(s1), F.nf4_code(), 64, w.shape, torch.float32))
    err0 = (bf.dequantize_4bit(p0, s0).float() - w).square().sum()
    err1 = (deq1 - w).square().sum()
    assert err1 < 0.93 * err0  # ~0.5 dB on Gaussian weights as on the real ones
    # per block never worse than bitsandbytes' scale without double quantization (1.0 is a candidate)
    if not double_quant:
        per0 = (bf.dequantize_4bit(p0, s0).float() - w).square().reshape(-1, 64).sum(-1)
        per1 = (deq1 - w).square().reshape(-1, 64).sum(-1)
        assert bool((per1 <= per0 * (1 + 1e-6)).all())


def test_encode_on_bitsandbytes_scales_gives_its_codes():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.03
    w[3, :64] = 0  # a zero block
    p, st = F.quantize_nf4(w, 64, False)
    assert torch.equal(F.nf4.encode_nf4(w, st.absmax, F.nf4_code(), 64), p)


def test_scale_search_option_reaches_the_module():
    lin = nn.Linear(128, 64, bias=False)
    w = lin.weight.detach()
    for search in (True, False):
        m = L.NF4Linear.from_linear(lin, scale_search=search)
        p, _ = F.quantize_nf4(w, 64, True, scale_search=search)
        assert torch.equal(m.weight.reshape(-1), p.reshape(-1).view(m.weight.dtype)), search


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scale_search_on_cuda_matches_the_cpu_encode():
    """The search is torch ops, so on the GPU it encodes as on the CPU: on the same scales the codes are equal bit
    for bit; the whole quantizer (its error sums and bitsandbytes' CUDA double quantization) within rounding."""
    w = torch.randn(1152, 960, generator=torch.Generator().manual_seed(3)) * 0.02
    p_cpu, s_cpu = F.quantize_nf4(w, 64, True, scale_search=True)
    absmax = F.nf4_absmax(s_cpu)
    assert torch.equal(F.nf4.encode_nf4(w.cuda(), absmax.cuda(), F.nf4_code("cuda"), 64).cpu(), p_cpu)
    p_gpu, s_gpu = F.quantize_nf4(w.cuda(), 64, True, scale_search=True)
    assert (p_gpu.cpu() == p_cpu).float().mean() > 0.999
    d_cpu = F.dequantize_nf4_raw(p_cpu, absmax, F.nf4_code(), 64, w.shape, torch.float32)
    d_gpu = F.dequantize_nf4_raw(p_gpu, F.nf4_absmax(s_gpu), F.nf4_code("cuda"), 64, w.shape, torch.float32).cpu()
    e_cpu, e_gpu = (d_cpu - w).square().sum(), (d_gpu - w).square().sum()
    assert abs(float(e_gpu / e_cpu) - 1) < 1e-3


def test_scale_search_names_a_partial_block():
    with pytest.raises(ValueError, match=r"scale_search needs whole blocks; the weight's 96 elements .* block_size 64"):
        F.quantize_nf4(torch.randn(3, 32), 64, True, scale_search=True)
