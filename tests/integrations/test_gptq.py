"""GPTQ codes on every format's own scales (integrations/gptq.py) and loftq_init(quantizer="gptq"): with
uncorrelated inputs GPTQ is round-to-nearest exactly, with correlated ones it lowers the layer's output error;
what is encoded is what the loop chose; bad input is named."""

import pytest
import torch
from torch import nn

from surogate_hf.integrations.gptq import gptq_quantize, gptq_round
from surogate_hf.nn import slots as S
from surogate_hf.nn.linear import LINEAR_CLASSES


FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
OPTIONS = {"fp8": {"block_size": (32, 32)}}  # several fp8 blocks per test weight


def _base(fmt, w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    return LINEAR_CLASSES[fmt].from_linear(lin, **OPTIONS.get(fmt, {}))


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _correlated_inputs(k, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k))
    x[:, :4] *= 6  # a few heavy channels, as LLM activations have
    return x


def _unit(slots):
    return {s[len("weight"):]: v for s, v in slots.items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_uncorrelated_inputs_give_round_to_nearest(fmt):
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    base = _base(fmt, w)
    slots = gptq_quantize(base, w, torch.eye(128, dtype=torch.float64) * 3.0)
    for name, v in slots.items():
        assert torch.equal(_bits(v), _bits(S.get_slot(base, name))), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_lowers_the_output_error_and_encodes_what_it_chose(fmt):
    n, k = 96, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.02
    x = _correlated_inputs(k)
    h = (x.T @ x / x.shape[0]).double()
    h += 0.01 * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    base = _base(fmt, w)
    fmt_obj = base.fmt
    t = {s[len("weight"):]: v for s, v in base.quantize_weight(w).items()}
    chosen = gptq_round(w, h, fmt_obj.element_scales(t, n, k), fmt_obj.round_to_grid)
    deq = fmt_obj.dequantize(_unit(gptq_quantize(base, w, h)), n, k, torch.float32)
    torch.testing.assert_close(deq, chosen, rtol=1e-6, atol=1e-9)  # the codes the loop chose, encoded
    rtn = base.dequantize(torch.float32)

    def out_err(d):
        return float(((w - d) @ x.T).norm() / (w @ x.T).norm())

    assert out_err(deq) < 0.85 * out_err(rtn), (out_err(deq), out_err(rtn))
    # the scales are the format's own: only codes moved
    for name, v in gptq_quantize(base, w, h).items():
        if name != "weight":
            assert torch.equal(_bits(v), _bits(S.get_slot(base, name))), name


def test_gptq_bad_input_is_named():
    w = torch.randn(32, 64)
    scales = torch.ones(32, 64)
    with pytest.raises(ValueError, match="second moment of shape"):
        gptq_round(w, torch.eye(32, dtype=torch.float64), scales, torch.round)
    with pytest.raises(ValueError, match="element scales of shape"):
        gptq_round(w, torch.eye(64, dtype=torch.float64), torch.ones(32, 32), torch.round)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_round(w, -torch.eye(64, dtype=torch.float64), scales, torch.round)
