"""QLoRA x recipe (recipes.qlora): the base stores its format, the recipe sets the precision of the base GEMMs.
Each (format, recipe) cell against its reference numerics on CPU, and QLoRA training with every recipe."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn

import surogate_hf.recipes as R
from surogate_hf.testing.models import build_tiny_model
from surogate_hf import formats as F
from surogate_hf.nn import linear as L

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _base(fmt, n=160, k=256):
    """fmt: a format name, or "fp8-64" (fp8 in 64x64 blocks: not the 128x128 layout whose own GEMMs the FP8 recipes
    keep)."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    opts = {"block_size": (64, 64)} if fmt == "fp8-64" else {}
    base = L.LINEAR_CLASSES[fmt.split("-")[0]].from_linear(lin.bfloat16(), **opts)
    return nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": base})])}), base


def _run(base, x, dy):
    x = x.clone().requires_grad_()
    y = base(x)
    y.backward(dy)
    return y, x.grad


def _inputs(k=256, n=160):
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 7, k, generator=g).bfloat16(), torch.randn(3, 7, n, generator=g).bfloat16()


@pytest.mark.parametrize("fmt", [*FORMATS, "fp8-w8a8"])
def test_bf16_recipe_is_weight_only(fmt, monkeypatch):
    if fmt == "fp8-w8a8":  # every fp8 base W8A8 (this small one is weight-only by formats.fp8_linear_weight_only)
        monkeypatch.setattr(F.fp8, "FP8_WEIGHT_ONLY_MAX_PARAMS", 0)
    model, base = _base(fmt.removesuffix("-w8a8"))
    x, dy = _inputs()
    before = _run(base, x, dy)
    R.apply_recipe(model, "bf16", model_dtype="bf16")
    y, dx = _run(base, x, dy)
    w = base.dequantize(torch.bfloat16)
    if fmt.startswith("fp8"):  # weight-only (bf16 activations) under the bf16 recipe; a W8A8 base differed before
        assert base.recipe_gemm.kind == "float"
        assert torch.equal(y, Fn.linear(x, w)) and torch.equal(dx, Fn.linear(dy, w.t()))
        assert torch.equal(y, before[0]) == (fmt == "fp8")
    else:  # the format's own GEMM already is weight-only in bf16
        assert base.recipe_gemm.kind == "native"
        assert torch.equal(y, before[0]) and torch.equal(dx, before[1])


def _fp8_ref(a, fmt):
    s = F.fp8_scale_from_amax(a.float().abs().amax(), fmt)
    return F.cast_to_fp8(a.float() * s, fmt), s.reciprocal()


@pytest.mark.parametrize("fmt", ["fp8-64", "nvfp4", "mxfp4", "nf4"])
def test_fp8_hybrid_delayed_on_any_base(fmt):
    """First step (current scaling): E4M3 x and decoded W forward, E5M2 dy x E4M3 W^T backward; the base's three
    state rows record amax(x), amax(W), amax(dy)."""
    model, base = _base(fmt)
    x, dy = _inputs()
    R.apply_recipe(model, "fp8-hybrid", model_dtype="bf16")
    assert base.recipe_gemm.kind == "fp8"
    y, dx = _run(base, x, dy)
    w = base.dequantize(torch.bfloat16)
    xq, xs = _fp8_ref(x.reshape(-1, 256), F.E4M3)
    wq, ws = _fp8_ref(w, F.E4M3)
    ref = torch.ops.surogate.fp8_scaled_mm(xq, wq, xs, ws, None, torch.bfloat16)
    assert torch.equal(y.reshape(-1, 160), ref)
    dq, ds = _fp8_ref(dy.reshape(-1, 160), F.E5M2)
    wtq, wts = _fp8_ref(w.t().contiguous(), F.E4M3)
    assert torch.equal(dx.reshape(-1, 256), torch.ops.surogate.fp8_scaled_mm(dq, wtq, ds, wts, None, torch.bfloat16))
    st = model.surogate_fp8_state
    rx, rw, _ = base.fp8_rows
    assert st.amax[rx] == x.float().abs().max() and st.amax[rw] == w.float().abs().max()
    assert base.fp8_dy_amax.item() == dy.float().abs().max().item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_fp8_blockwise_on_a_non_fp8_base(fmt):
    model, base = _base(fmt)
    x, dy = _inputs()
    R.apply_recipe(model, "fp8-hybrid", model_dtype="bf16", fp8_scaling="blockwise")
    assert base.recipe_gemm.kind == "blockwise"
    y, dx = _run(base, x, dy)
    wq, ws = F.quantize_fp8_blocks(base.dequantize(torch.bfloat16))
    assert torch.equal(y, torch.ops.surogate.fp8_block_linear(x, wq, ws, 128, 128))
    assert torch.equal(dx, torch.ops.surogate.fp8_block_linear_dgrad(dy, wq, ws, 128, 128))


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("scaling", ["delayed", "blockwise"])
def test_fp8_recipes_keep_a_128x128_fp8_base_on_its_own_gemm(scaling, small, monkeypatch):
    """Its weight already is E4M3 in 128x128 blocks: no second quantization of it, the W8A8 block GEMM on its stored
    blocks, and no rows of the delayed-scaling state. A base from formats.FP8_WEIGHT_ONLY_MAX_PARAMS elements on runs its own linear, which is that
    GEMM; a smaller one's own linear is weight-only (formats.fp8_linear_weight_only), so the recipe, which asks for
    FP8 compute, calls the W8A8 op on the stored blocks itself."""
    if not small:
        monkeypatch.setattr(F.fp8, "FP8_WEIGHT_ONLY_MAX_PARAMS", 0)
    model, base = _base("fp8")
    x, dy = _inputs()
    before = _run(base, x, dy)
    R.apply_recipe(model, "fp8-hybrid", model_dtype="bf16", fp8_scaling=scaling)
    assert base.recipe_gemm.kind == ("fp8_stored" if small else "native")
    assert getattr(model, "surogate_fp8_state", None) is None and not hasattr(base, "fp8_rows")
    after = _run(base, x, dy)
    q, s = base._tensors().values()
    assert torch.equal(after[0], torch.ops.surogate.fp8_block_linear(x, q, s, 128, 128))
    assert torch.equal(after[1], torch.ops.surogate.fp8_block_linear_dgrad(dy, q, s, 128, 128))
    assert torch.equal(before[0], after[0]) != small and torch.equal(before[1], after[1]) != small


@pytest.mark.parametrize("blocks", ["1d", "2d"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_nvfp4_recipe_on_any_base(fmt, blocks):
    model, base = _base(fmt)
    x, dy = _inputs()
    R.apply_recipe(model, "nvfp4", model_dtype="bf16", no_fp4_stochastic_rounding=True, fp4_weight_blocks=blocks)
    assert base.recipe_gemm.kind == "nvfp4"
    y, dx = _run(base, x, dy)
    w = base.dequantize(torch.float32)
    dq = F.quantize_nvfp4(dy.reshape(-1, 160))
    xq = F.quantize_nvfp4(x.reshape(-1, 256))
    if blocks == "2d":
        wq = F.quantize_nvfp4(w, block_2d=True)
        # W^T of the 2D-block weight: 16x16 tiles, so the transposed codes keep their tile scales
        codes_t = F.unpack_e2m1(wq.packed).t().contiguous()
        scale_t = wq.block_scale[::16].t().repeat_interleave(16, dim=0).contiguous()
        wt = (F.pack_e2m1(codes_t), scale_t, wq.global_scale)
    else:  # 1x16 blocks along each GEMM's reduction dim: K for the forward, N for the dgrad
        wq, wt = F.quantize_nvfp4(w), F.quantize_nvfp4(w.t())
    assert torch.equal(y.reshape(-1, 160), torch.ops.surogate.nvfp4_mm(*xq, *wq, None, torch.bfloat16))
    assert torch.equal(dx.reshape(-1, 256), torch.ops.surogate.nvfp4_mm(*dq, *wt, None, torch.bfloat16))


def test_nvfp4_recipe_refuses_a_base_it_cannot_block_by_name():
    model, _ = _base("fp8", n=40)
    with pytest.raises(ValueError, match=r"quantized base layers\.0\.proj needs out_features to be a multiple of 16"):
        R.apply_recipe(model, "nvfp4", model_dtype="bf16")


def _qlora(fmt, layers=2):
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model("qwen3", num_hidden_layers=layers, vocab_size=128).train()
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and ".layers." in f".{name}":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, L.LINEAR_CLASSES[fmt].from_linear(m))
    for p in model.parameters():
        p.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))


def _train_lora(model, steps):
    """AdamW on the adapters over one fixed batch; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe, kw", [("bf16", {}), ("fp8-hybrid", {}), ("fp8-hybrid", {"fp8_scaling": "blockwise"}),
                                        ("nvfp4", {})])
@pytest.mark.parametrize("fmt", ["fp8", "nf4"])
def test_qlora_trains_with_every_recipe(fmt, recipe, kw):
    model = _qlora(fmt)
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    R.apply_recipe(model, recipe, **kw)
    bases = [m for m in model.modules() if isinstance(m, L.QuantizedLinear)]
    assert bases and all(b.__dict__.get("recipe_gemm") is not None for b in bases)
    losses = _train_lora(model, 5)
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if "base_layer" in n:
            assert torch.equal(p, packed[n]), f"{n}: the frozen base changed"
    if recipe == "fp8-hybrid" and not kw and fmt != "fp8":  # (a 128x128 fp8 base runs its own GEMMs: no rows)
        (st,) = [m for m in model.modules() if isinstance(m, R.Fp8ScalingState)]
        rows = [r for b in bases for r in b.fp8_rows[:2]]
        assert (st.amax_history[rows, :4] > 0).all(), "every base's x and W rows were recorded and pushed"
        # layer 0's q/k/v see a frozen embedding (no input gradient, no dy cast); every other base casts its dy
        dy_rows = [b.fp8_rows[2] for b in bases[3:]]
        assert (st.amax_history[dy_rows, :4] > 0).all()


@pytest.mark.parametrize("fmt, recipe, kw", [("mxfp4", "fp8-hybrid", {}), ("fp8", "bf16", {}), ("nf4", "nvfp4", {}),
                                             ("nvfp4", "fp8-hybrid", {"fp8_scaling": "blockwise"}),
                                             ("nf4", "fp8-hybrid", {})])
def test_qlora_recipe_compiles_fullgraph_and_trains_like_eager(fmt, recipe, kw):
    """Decoder layers compiled with fullgraph=True train like eager."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = _qlora(fmt, layers=1)
        R.apply_recipe(model, recipe, **kw)
        if compiled:
            for layer in model.base_model.model.model.layers:
                layer.compile(fullgraph=True)
        losses = _train_lora(model, 3)
        runs.append(losses)
    # fp32 reassociation in the compiled adapters moves amaxes by an ulp; blockwise scales every 1x128 tile by its own
    # amax (current scaling), which flips codes, and three steps at lr 1e-2 carry that to ~1.5e-3 of the loss. Delayed
    # per-tensor scaling moves less, but a full CI run once read 1.07e-3 at step 3 (mxfp4 base; 5.9e-4 run alone)
    assert runs[1] == pytest.approx(runs[0], rel=3e-3 if kw.get("fp8_scaling") == "blockwise" else 2e-3)


def test_nvfp4_base_recompute_reuses_the_forward_draw():
    """Activation checkpointing: a recompute of a base's forward takes no new stochastic-rounding step, so the second
    step draws what it draws without checkpointing and the gradients match."""
    grads = []
    for ckpt in (False, True):
        model = _qlora("nf4", layers=2)
        R.apply_recipe(model, "nvfp4")
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


@pytest.mark.parametrize("surogate_lora_layer", [False, True])
def test_fp8_bases_take_the_norms_handoff(surogate_lora_layer):
    """fp8-hybrid QLoRA (nf4 bases, cast per tensor by the recipe) with FusedRMSNorm: the q/k/v and gate/up bases link to their norm and share its x row (the
    fp32 adapters here see an fp32 copy of x, another tensor, and cast for themselves); training is bit-identical
    to the run without the swap, and a reloaded model casts its bases with the shared rows. Through stock PEFT's
    LoRA layer and through surogate's (installed by prepare_for_training; it flattens x before the base)."""
    from surogate_hf.integrations import peft as P

    was_installed = P.is_peft_dispatch_installed()
    (P.install_peft_dispatch if surogate_lora_layer else P.uninstall_peft_dispatch)()
    try:
        _check_bases_handoff(surogate_lora_layer)
    finally:
        (P.install_peft_dispatch if was_installed else P.uninstall_peft_dispatch)()


def _check_bases_handoff(surogate_lora_layer):
    from surogate_hf.integrations.peft import set_lora_dtype

    runs = []
    for fused in (False, True):
        model = _qlora("nf4", layers=2)
        if surogate_lora_layer:
            set_lora_dtype(model, torch.bfloat16)  # its fast path: bf16 adapters on the flattened input
        R.apply_recipe(model, "fp8-hybrid", fused_norms=fused)
        losses = _train_lora(model, 4)
        runs.append((losses, model))
    assert runs[0][0] == runs[1][0]
    model = runs[1][1]
    attn = model.base_model.model.model.layers[1].self_attn
    rows = {attn.q_proj.base_layer.fp8_rows[0], attn.k_proj.base_layer.fp8_rows[0], attn.v_proj.base_layer.fp8_rows[0]}
    assert len(rows) == 1, "one x row for every consumer of input_layernorm"
    assert attn.o_proj.base_layer.fp8_rows[0] not in rows

    fresh = _qlora("nf4", layers=2)
    if surogate_lora_layer:
        set_lora_dtype(fresh, torch.bfloat16)
    R.apply_recipe(fresh, "fp8-hybrid")
    fresh.load_state_dict(model.state_dict())
    fattn = fresh.base_model.model.model.layers[1].self_attn
    assert fattn.k_proj.base_layer.fp8_rows == attn.k_proj.base_layer.fp8_rows
    assert int(fattn.k_proj.base_layer.fp8_rows_t[0]) == attn.q_proj.base_layer.fp8_rows[0]
