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
