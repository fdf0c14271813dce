"""Quantized linears inside torch.compile with many tokens: the decode runs as plain torch ops (inductor fuses it
ahead of the GEMM instead of calling a custom op per layer), bit-identical to eager, and only the packed tensors
are saved for backward (the decode is recomputed for the input gradient, never a dense weight kept)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from surogate_hf.kernels import paths
from surogate_hf.nn import linear as L


def _layer(fmt: str, n: int = 96, k: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return L.LINEAR_CLASSES[fmt].from_linear(nn.Linear(k, n, bias=False, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "fp8"])  # fp8: a weight-only (small) weight
def test_compiled_many_token_linear_decodes_in_graph_and_saves_no_dense_weight(fmt):
    torch._dynamo.reset()
    q = _layer(fmt)
    tokens = paths.DENSE_MIN_TOKENS + 37
    x = torch.randn(tokens, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, 96, dtype=torch.bfloat16)
    y_eager = q(x)
    y_eager.backward(g)
    dx_eager, x.grad = x.grad, None

    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.compile(q, fullgraph=True)(x)
    y.backward(g)
    assert torch.equal(y, y_eager) and torch.equal(x.grad, dx_eager)
    assert saved, "the compiled graph saves the packed weight for backward"
    dense = [s for s in saved if s[0] == (96, 256) and s[1].is_floating_point]
    assert not dense, f"a dense [n, k] weight was saved for backward: {saved}"


def test_the_traced_decode_is_the_format_decode():
    for fmt in ("nvfp4", "mxfp4", "nf4", "fp8"):
        q = _layer(fmt)
        t = q._tensors()
        assert torch.equal(q.fmt.dequantize_traced(t, 96, 256, torch.bfloat16), q.dequantize(torch.bfloat16)), fmt


def test_fp8_decodes_in_the_graph_exactly_where_its_linear_is_weight_only(monkeypatch):
    """fp8's traced decode follows the linear's spec (formats.fp8_linear_weight_only), at every token count: a small
    weight decodes in the graph even for a few tokens, a weight at or above the threshold keeps the W8A8 op."""
    from surogate_hf import formats as F

    q = _layer("fp8")
    few = torch.randn(8, 256, dtype=torch.bfloat16)
    assert q.fmt.decodes_in_gemm(few, 96, 256) and not q.fmt.decodes_in_gemm(few, 4096, 4096)
    calls = []
    real = q.fmt.linear
    monkeypatch.setattr(q.fmt, "linear", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    torch.compile(q, backend="eager", fullgraph=True)(few)
    assert not calls  # decoded in the graph
    monkeypatch.setattr(F.fp8, "FP8_WEIGHT_ONLY_MAX_PARAMS", 96 * 256)  # the same layer now at the threshold
    torch._dynamo.reset()
    torch.compile(q, backend="eager", fullgraph=True)(few)
    assert calls  # the W8A8 op


def test_few_tokens_keep_the_custom_op(monkeypatch):
    """Below the dense route's token count the compiled graph calls the fused-kernel op, as eager does."""
    calls = []
    q = _layer("nvfp4")
    real = q.fmt.linear
    monkeypatch.setattr(q.fmt, "linear", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    torch.compile(q, backend="eager", fullgraph=True)(x)
    assert calls
