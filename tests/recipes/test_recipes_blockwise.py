"""fp8_scaling='blockwise' (DeepSeek-V3's fine-grained FP8): numerics against the formats' reference, the knob's
errors, training, torch.compile."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import surogate_hf.recipes as R
from surogate_hf.testing.models import build_tiny_model
from surogate_hf import formats as F
from surogate_hf.recipes.config import RecipeConfig


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _tiles_deq(t, tile=128):
    q, s = F.quantize_fp8_tiles(t, tile)
    return F.dequantize_fp8_tiles(q, s, tile, torch.float32)


@pytest.mark.parametrize("n, k, tokens", [(160, 256, 6), (192, 576, 200), (96, 96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_formats_reference(n, k, tokens, bias):
    """forward x(1x128 along K) x W(128x128), dgrad dy(1x128 along N) x W, wgrad dy^T x x^T (128 tiles along the
    tokens), fp32 accumulation, for shapes that are not multiples of 128; an fp32 master gets an fp32 gradient."""
    g = torch.Generator().manual_seed(n + k)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    m = R.apply_recipe(nn.ModuleDict({"layers": nn.ModuleList([nn.Sequential(lin)])}), "fp8-hybrid",
                       fp8_scaling="blockwise", model_dtype="bf16", master_dtype="fp32")
    layer = m.layers[0][0]
    assert isinstance(layer, R.RecipeLinear) and "blockwise" in repr(layer) and not hasattr(m, "surogate_fp8_state")
    x = torch.randn(tokens, k, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(tokens, n, generator=g).bfloat16()
    y = layer(x)
    y.backward(dy)

    wq, ws = F.quantize_fp8_blocks(lin.weight.detach())
    wd = F.dequantize_fp8_blocks(wq, ws, (128, 128), torch.float32)
    ref = (_tiles_deq(x.detach()) @ wd.t()).bfloat16()
    if bias:  # the block GEMM rounds its output; the bias is added to that in fp32 and rounded again
        ref = (ref.float() + lin.bias.detach().float()).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert torch.equal(x.grad, (_tiles_deq(dy) @ wd).bfloat16())
    dw = _tiles_deq(dy.t()) @ _tiles_deq(x.detach().t()).t()
    assert layer.weight.grad.dtype == torch.float32 and torch.equal(layer.weight.grad, dw)
    if bias:
        assert torch.equal(lin.bias.grad, dy.float().sum(0))


def test_knob_errors_name_the_knob():
    with pytest.raises(ValueError, match="fp8_scaling='fp9'"):
        RecipeConfig.from_recipe_name("fp8-hybrid", fp8_scaling="fp9")
    for knob, value in (("margin", 1), ("amax_history_len", 16), ("amax_compute_algo", "most_recent"),
                        ("reduce_amax", False)):
        with pytest.raises(ValueError, match=f"{knob} is a delayed-scaling knob"):
            RecipeConfig.from_recipe_name("fp8-hybrid", fp8_scaling="blockwise", **{knob: value})
    with pytest.raises(ValueError, match="fp8_scaling"):
        RecipeConfig.from_recipe_name("nvfp4", fp8_scaling="blockwise")
    cfg = RecipeConfig.from_recipe_name("bf16", matmul_dtype="e4m3", gradient_dtype="bf16", fp8_scaling="blockwise")
    assert RecipeConfig.from_dict(cfg.to_dict()) == cfg


def _qwen3(layers=2):
    return build_tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=layers, vocab_size=128, hidden_size=128, intermediate_size=192).train()


def _train(model, steps=6, run=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    losses = []
    for _ in range(steps):
        loss = (model if run is None else run)(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_trains_and_records_the_recipe():
    m = R.apply_recipe(_qwen3(), "fp8-hybrid", fp8_scaling="blockwise")
    assert m.config.surogate_recipe == {"recipe": "fp8-hybrid", "fp8_scaling": "blockwise", "model_dtype": "fp32"}
    assert not any(k.startswith("surogate_fp8_state") for k in m.state_dict())
    losses = _train(m)
    assert losses[-1] < losses[0] - 0.5
    ref = _train(R.apply_recipe(_qwen3(), "bf16"))
    assert losses[-1] == pytest.approx(ref[-1], rel=0.1)


def test_bf16_recipe_with_e4m3_matmul_and_float_gradients():
    """matmul_dtype e4m3 + gradient_dtype bf16: blockwise forward, the bf16 backward on the master weight."""
    m = R.apply_recipe(_qwen3(layers=1), "bf16", matmul_dtype="e4m3", gradient_dtype="bf16", fp8_scaling="blockwise")
    losses = _train(m, steps=3)
    assert losses[-1] < losses[0]


def test_compiled_fullgraph_trains_like_eager():
    torch._dynamo.reset()
    base = _qwen3(layers=1)
    eager = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid", fp8_scaling="blockwise"), steps=3)
    m = R.apply_recipe(copy.deepcopy(base), "fp8-hybrid", fp8_scaling="blockwise")
    compiled = _train(m, steps=3, run=torch.compile(m, fullgraph=True))
    assert compiled == pytest.approx(eager, rel=1e-4)
