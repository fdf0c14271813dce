"""recipes.norm.FusedRMSNorm: the stock transformers formulas bit for bit (a drift test per recognised class),
the swap in apply_recipe (same Parameters, same keys), and the FP8 hand-off to the linears a norm feeds."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

import surogate_hf.recipes as R
from surogate_hf.testing.models import build_tiny_model
from surogate_hf.recipes import fp8_hybrid
from surogate_hf.recipes.norm import NORM_FORMULAS, FusedRMSNorm, fuse_norms


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _stock_norm(cls_name: str, dim: int):
    """An instance of transformers' class `cls_name` (None when the installed transformers lacks it)."""
    model = {"Qwen3MoeRMSNorm": "qwen3_moe"}.get(cls_name, cls_name.removesuffix("RMSNorm").lower())
    try:
        mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    except ImportError:
        return None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return None
    return cls(dim, eps=1e-5)


@pytest.mark.parametrize("cls_name", sorted(NORM_FORMULAS))
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32)])
def test_formula_matches_the_stock_module_bit_for_bit(cls_name, x_dtype, w_dtype):
    stock = _stock_norm(cls_name, 96)
    if stock is None:
        pytest.skip(f"transformers has no {cls_name}")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        stock.weight.copy_(torch.randn(96, generator=g) * 0.3 + (0.0 if NORM_FORMULAS[cls_name] == "gemma" else 1.0))
    stock = stock.to(w_dtype)
    fused = FusedRMSNorm(copy.deepcopy(stock))
    assert fused.norm_eps == 1e-5
    x = (torch.randn(3, 5, 96, generator=g) * 2).to(x_dtype)
    dy = torch.randn(3, 5, 96, generator=g)
    outs = []
    for m in (stock, fused):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy.to(y.dtype))
        outs.append((y, xi.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_out_dtype_is_the_stock_output_cast():
    """fp32 master weight, bf16 activations: FusedRMSNorm(out_dtype=bf16) = the stock module followed by .to(bf16)
    (what apply_recipe's output-cast hook did), forward and backward."""
    stock = _stock_norm("LlamaRMSNorm", 64).float()
    with torch.no_grad():
        stock.weight.normal_(1.0, 0.2)
    fused = FusedRMSNorm(copy.deepcopy(stock), torch.bfloat16)
    x = torch.randn(7, 64).bfloat16()
    outs = []
    for f in (lambda t: stock(t).bfloat16(), fused):
        xi = x.clone().requires_grad_()
        y = f(xi)
        y.float().square().sum().backward()
        outs.append((y, xi.grad))
    assert outs[1][0].dtype == torch.bfloat16
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _qwen3(layers=2):
    return build_tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=layers, vocab_size=128, hidden_size=64, intermediate_size=96, head_dim=16).train()


def _train(model, steps=4, checkpointing=False, seq=16):
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, seq), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_apply_recipe_swaps_norms_and_keeps_the_state_dict():
    base = _qwen3()
    keys = list(base.state_dict())
    weights = {n: m.weight for n, m in base.named_modules() if type(m).__name__ == "Qwen3RMSNorm"}
    m = R.apply_recipe(base, "bf16")
    fused = {n: x for n, x in m.named_modules() if isinstance(x, FusedRMSNorm)}
    # per layer: input/post-attention norms and q/k norms; plus the final norm
    assert set(fused) == set(weights) and len(fused) == 2 * 4 + 1
    assert all(fused[n].weight is weights[n] for n in fused), "the same Parameter objects"
    assert list(m.state_dict()) == keys
    kept = R.apply_recipe(_qwen3(), "bf16", fused_norms=False)
    assert not any(isinstance(x, FusedRMSNorm) for x in kept.modules())


@pytest.mark.parametrize("recipe, kw", [("bf16", {}), ("fp8-hybrid", {}),
                                        ("fp8-hybrid", dict(model_dtype="fp32", master_dtype="fp32")),
                                        ("nvfp4", {})])
def test_fused_norms_train_bit_identically(recipe, kw):
    """With or without the swap (and the FP8 hand-off), the same losses and the same trained weights on CPU."""
    base = _qwen3()
    runs = []
    for fused in (False, True):
        m = R.apply_recipe(copy.deepcopy(base), recipe, fused_norms=fused, **kw)
        runs.append((_train(m), {k: v for k, v in m.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k


def test_fp32_masters_bf16_model_with_fused_norms():
    base = _qwen3().bfloat16()
    kw = dict(model_dtype="bf16", master_dtype="fp32")
    a = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid", fused_norms=False, **kw))
    b = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid", **kw))
    assert a == b


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_handoff_casts_once_per_norm(monkeypatch, fused):
    """After the first (current-scaling) step the linears fed by one norm share its x row and take the cast the
    norm wrote: per layer and step, the x casts of q/k/v and gate/up come from the two norms (one each), o and
    down cast their own inputs, and the 7 output gradients are cast as before: 11 casts instead of 14."""
    m = R.apply_recipe(_qwen3(layers=3), "fp8-hybrid", fused_norms=fused)
    _train(m, steps=1)  # links the consumers (step 1 scales by each tensor's own amax: no hand-off yet)
    calls = []
    real = fp8_hybrid.cast

    def counting(x2d, *a, **k):
        calls.append(x2d.shape[0])
        return real(x2d, *a, **k)

    monkeypatch.setattr(fp8_hybrid, "cast", counting)
    _train(m, steps=1, seq=13)
    token_casts = calls.count(2 * 13)  # activations and gradients have 26 rows; no weight has
    assert token_casts == 3 * (11 if fused else 14)
    for layer in m.model.layers:
        a, p = layer.self_attn, layer.mlp
        shared = a.q_proj.fp8_rows[0] == a.k_proj.fp8_rows[0] == a.v_proj.fp8_rows[0]
        assert shared == fused and (p.gate_proj.fp8_rows[0] == p.up_proj.fp8_rows[0]) == fused
        assert len({a.q_proj.fp8_rows[0], a.o_proj.fp8_rows[0], p.gate_proj.fp8_rows[0], p.down_proj.fp8_rows[0]}) == 4
        assert int(a.k_proj.fp8_rows_t[0]) == a.k_proj.fp8_rows[0]


def test_handoff_refused_when_the_tensor_changed_in_place():
    m = R.apply_recipe(_qwen3(layers=1), "fp8-hybrid")
    _train(m, steps=1)
    layer = m.model.layers[0]
    x = torch.randn(1, 4, 64)
    y = layer.input_layernorm(x)
    assert getattr(y, "_surogate_fp8", None) is not None
    ref = layer.self_attn.q_proj(y.detach().clone() * 2)  # no hand-off: casts for itself
    with torch.no_grad():
        y.mul_(2)
    out = layer.self_attn.q_proj(y)
    assert torch.equal(out, ref)


def test_gradient_checkpointing_with_handoff():
    base = _qwen3()
    a = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid", fused_norms=False), checkpointing=True)
    b = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid"), checkpointing=True)
    assert a == b


def test_compiled_fullgraph_with_fused_norms_trains_like_eager():
    torch._dynamo.reset()
    base = _qwen3(layers=1)
    eager = _train(R.apply_recipe(copy.deepcopy(base), "fp8-hybrid"), steps=3)
    m = R.apply_recipe(copy.deepcopy(base), "fp8-hybrid")
    for layer in m.model.layers:
        layer.compile(fullgraph=True)
    compiled = _train(m, steps=3)
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_unrecognised_module_is_refused_by_name():
    with pytest.raises(ValueError, match="LayerNorm is not a recognised RMSNorm"):
        FusedRMSNorm(torch.nn.LayerNorm(8))
    assert fuse_norms(torch.nn.Sequential(torch.nn.LayerNorm(8)), None) == 0


def test_shared_rows_survive_a_checkpoint():
    """The rows a FusedRMSNorm's consumers share are state (x_row): a reloaded model casts with them before any
    eager forward links anything (a compiled model never links), so k_proj never reads an empty history."""
    m = R.apply_recipe(_qwen3(layers=1), "fp8-hybrid")
    _train(m, steps=2)
    sd = m.state_dict()
    fresh = R.apply_recipe(_qwen3(layers=1), "fp8-hybrid")
    attn = fresh.model.layers[0].self_attn
    assert attn.k_proj.fp8_rows[0] != attn.q_proj.fp8_rows[0]
    fresh.load_state_dict(sd)
    assert attn.k_proj.fp8_rows[0] == attn.v_proj.fp8_rows[0] == attn.q_proj.fp8_rows[0]
    assert int(attn.k_proj.fp8_rows_t[0]) == attn.q_proj.fp8_rows[0]
    assert torch.equal(attn.k_proj.fp8_scale(), m.model.layers[0].self_attn.k_proj.fp8_scale())
