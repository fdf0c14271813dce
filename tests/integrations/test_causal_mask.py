"""surogate_hf.integrations.causal_mask: transformers' SDPA causal-mask skip under torch.compile on torch < 2.13.

The rule is checked against transformers' own (`_ignore_causal_mask_sdpa`, called in eager where the export flag is
read for real) over a grid of lengths, offsets and windows, so this fails when upstream changes it; the registered
function is checked inside compiled frames (forced on: this CPU runs torch 2.13, where dynamo reads the flag)."""

from __future__ import annotations

import itertools

import pytest
import torch

from surogate_hf.integrations import causal_mask as CM

masking_utils = pytest.importorskip("transformers.masking_utils")


@pytest.fixture
def installed():
    was = CM.is_compiled_causal_mask_skip_installed()
    assert CM.install_compiled_causal_mask_skip(force=True)
    yield
    if not was:
        CM.uninstall_compiled_causal_mask_skip()


def test_version_bound_matches_what_dynamo_does():
    """dynamo_folds_is_exporting() says what a compiled frame reads for torch.compiler.is_exporting()."""
    torch._dynamo.reset()
    probe = torch.compile(lambda x: x + int(torch.compiler.is_exporting()), backend="eager", fullgraph=True)
    folded = bool(probe(torch.zeros(())).item())
    assert folded == CM.dynamo_folds_is_exporting()


def test_rule_is_transformers_rule_without_padding(monkeypatch):
    """With compiling on and the export flag off, our decision equals transformers' eager decision for a
    padding-free batch, case by case (including sliding windows and the allow_is_causal_skip switch)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    cases = itertools.product([1, 5, 8], [5, 8, 16], [0, 3], [0, 2], [None, 4, 32], [True, False])
    for q, kv, q_off, kv_off, local, allow in cases:
        ours = CM._skips_causal_mask(dict(q_length=q, kv_length=kv, q_offset=q_off, kv_offset=kv_off,
                                          local_size=local, attention_mask=None, allow_is_causal_skip=allow))
        stock = allow and masking_utils._ignore_causal_mask_sdpa(None, q, kv, q_off, kv_off, local)
        assert ours == stock, (q, kv, q_off, kv_off, local, allow)


def test_rule_defers_to_the_stock_function(monkeypatch):
    """Outside a compiled frame, while exporting, with a padding mask, a tensor offset or positional arguments, the
    stock function decides."""
    base = dict(batch_size=2, q_length=8, kv_length=8, attention_mask=None, allow_is_causal_skip=True)
    assert not CM._skips_causal_mask(base)  # eager: stock function (which skips by itself there)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert CM._skips_causal_mask(base)
    assert not CM._skips_causal_mask({**base, "attention_mask": torch.ones(2, 8, dtype=torch.bool)})
    assert not CM._skips_causal_mask({**base, "q_offset": torch.tensor(0)})
    assert not CM._skips_causal_mask({k: v for k, v in base.items() if k != "attention_mask"})
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True, raising=False)
    assert not CM._skips_causal_mask(base)


def test_compiled_mask_function(installed):
    """The registered "sdpa" mask function in a compiled frame: None for a padding-free causal batch, the stock
    mask with padding or a sliding window shorter than the keys."""
    fn = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert fn is CM._sdpa_mask

    def mask(pad, local):
        return fn(batch_size=2, q_length=8, kv_length=8, q_offset=0, kv_offset=0, attention_mask=pad,
                  local_size=local, allow_is_causal_skip=True, device="cpu")

    torch._dynamo.reset()
    compiled = torch.compile(lambda pad: (mask(None, None), mask(pad, None), mask(None, 4)), backend="eager",
                             fullgraph=True)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, :2] = False
    none, padded, window = compiled(pad)
    assert none is None
    assert torch.equal(padded, CM._STOCK["sdpa"](batch_size=2, q_length=8, kv_length=8, attention_mask=pad))
    # local_size only stops the skip (the caller passes the window's mask_function): the stock mask comes back
    assert torch.equal(window, CM._STOCK["sdpa"](batch_size=2, q_length=8, kv_length=8, local_size=4))


def test_uninstall_restores_the_stock_function(installed):
    CM.uninstall_compiled_causal_mask_skip()
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is masking_utils.sdpa_mask
    assert not CM.is_compiled_causal_mask_skip_installed()


def _sdpa_calls(model, **inputs):
    """(attn_mask is None, is_causal) of each SDPA call in the graph dynamo captures for model(**inputs)."""
    calls = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
                calls.append((n.kwargs.get("attn_mask") is None, n.kwargs.get("is_causal")))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(**inputs)
    return calls, out


def test_whole_model_compile_runs_causal_sdpa_and_trains_like_eager(installed):
    """A whole tiny Llama compiled: causal SDPA without a mask, the same loss and gradients as eager; with a padding
    mask the mask stays."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    eager = model(input_ids=ids, labels=ids)
    eager.loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    calls, out = _sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(True, True)] * 2
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for p, g in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
    pad = torch.ones_like(ids)
    pad[0, :3] = 0
    calls, _ = _sdpa_calls(model, input_ids=ids, attention_mask=pad)
    assert calls == [(False, False)] * 2
