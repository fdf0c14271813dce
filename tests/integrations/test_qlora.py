"""QLoRA through stock PEFT calls on every format: targeting, gradients vs a dense model, lora_dtype,
merge / unmerge / merge_and_unload, and adapter save + reload (PeftModel.from_pretrained, model.load_adapter)."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import layer as lora_layer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from surogate_hf import SurogateConfig
from surogate_hf.data import (
    CharTokenizer, PadCollator, SyntheticTaskDataset, TaskSpec, build_tiny_model, tiny_llama_config,
)
from surogate_hf.integrations.peft import SurogateLoraLinear, lora_parameters_dtype, merge_to_dense, set_lora_dtype
from surogate_hf.nn import QuantizedLinear, dequantize_model
from surogate_hf.training import prepare_for_training

FORMATS = ["fp8", "nvfp4", "mxfp4", "nf4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tiny_llama_config(CharTokenizer().vocab_size, num_layers=2), seed=0).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def batch():
    ds = SyntheticTaskDataset(TaskSpec(), 16, seed=0)
    return PadCollator(0)([ds[i] for i in range(len(ds))])


def load(path, fmt, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format=fmt), dtype=dtype)
    return prepare_for_training(model, gradient_checkpointing=False)


def lora_cfg(**kw):
    base = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    base.update(kw)
    return LoraConfig(**base)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_linear_wraps_every_quantized_linear(tiny_dir, fmt):
    pm = get_peft_model(load(tiny_dir, fmt), lora_cfg())
    wrapped = [m for m in pm.modules() if isinstance(m, SurogateLoraLinear)]
    bases = [m for m in pm.modules() if isinstance(m, QuantizedLinear)]
    assert len(wrapped) == len(bases) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(isinstance(m.get_base_layer(), QuantizedLinear) for m in wrapped)
    assert not any(type(m) is lora_layer.Linear for m in pm.modules())
    # the base stays packed and frozen; adapters are fp32 masters and the only trainable tensors
    for b in bases:
        assert not b.weight.is_floating_point() or b.weight.dtype == torch.float8_e4m3fn
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert lora_parameters_dtype(pm) == {torch.float32}
    assert type(pm.base_model.model.lm_head) is torch.nn.Linear  # all-linear leaves the output layer alone


@pytest.mark.parametrize(
    "fmt,dtype",
    [(f, torch.float32) for f in FORMATS] + [("fp8", torch.bfloat16), ("nf4", torch.bfloat16)],
    ids=[f"{f}-fp32" for f in FORMATS] + ["fp8-bf16", "nf4-bf16"],
)
def test_lora_grads_match_dense_dequantized_model(tiny_dir, batch, fmt, dtype):
    q = load(tiny_dir, fmt, dtype)
    d = prepare_for_training(dequantize_model(copy.deepcopy(q)), gradient_checkpointing=False)
    assert not any(isinstance(m, QuantizedLinear) for m in d.modules())
    cfg = lora_cfg(init_lora_weights=False)  # random A and B: with B = 0 the A gradients would be zero
    torch.manual_seed(0)
    pq, pd = get_peft_model(q, cfg), get_peft_model(d, cfg)
    set_peft_model_state_dict(pd, get_peft_model_state_dict(pq))
    for pm in (pq, pd):
        pm(**batch).loss.backward()
    gq = {n: p.grad for n, p in pq.named_parameters() if p.requires_grad}
    gd = {n: p.grad for n, p in pd.named_parameters() if p.requires_grad}
    assert gq.keys() == gd.keys() and len(gq) == 2 * 7 * 2
    overall = cosine(torch.cat([g.flatten() for g in gq.values()]), torch.cat([g.flatten() for g in gd.values()]))
    worst = min(cosine(gq[n], gd[n]) for n in gq)
    print(f"{fmt} {dtype}: grad cosine overall {overall:.6f}, worst tensor {worst:.6f}")
    assert overall >= 0.999
    # weight-only bases match the dense reference closely; so does this tiny model's fp8 (every weight below 2M
    # elements is weight-only, formats.fp8_linear_weight_only). A W8A8 fp8 base would also quantize activations
    # and output gradients (1x128 tiles), which the dense reference does not: single tensors drift more there.
    assert worst >= 0.999


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "linear"):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_lora_dtype_fp32_masters_compute_in_bf16(tiny_dir, batch):
    """fp32 masters, bf16 compute: no fp32 matmul in forward or backward, fp32 gradients on the masters.
    Stock PEFT on the same (dense bf16) model runs its adapter matmuls in fp32."""
    pm = get_peft_model(load(tiny_dir, "nvfp4", torch.bfloat16), lora_cfg())
    assert lora_parameters_dtype(pm) == {torch.float32}
    with _MatmulDtypes() as rec:
        pm(**batch).loss.backward()
    assert rec.dtypes and set(rec.dtypes) == {torch.bfloat16}, set(rec.dtypes)
    grads = {p.grad.dtype for n, p in pm.named_parameters() if "lora_" in n}
    assert grads == {torch.float32}

    dense = dequantize_model(load(tiny_dir, "nvfp4", torch.bfloat16))
    stock = get_peft_model(dense, lora_cfg())  # plain lora.Linear: PEFT upcasts the adapter path to fp32
    assert any(type(m) is lora_layer.Linear for m in stock.modules())
    with _MatmulDtypes() as rec:
        stock(**batch).loss.backward()
    assert torch.float32 in rec.dtypes
    # set_lora_dtype switches those layers to our compute path too (methods only, parameters kept)
    assert set_lora_dtype(stock, "fp32") == 14
    with _MatmulDtypes() as rec:
        stock(**batch).loss.backward()
    assert set(rec.dtypes) == {torch.bfloat16}


class _FullOutputElementwise(TorchDispatchMode):
    """Records elementwise mul/add ops whose output has `numel` elements (passes over the layer output)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("mul", "add", "mul_", "add_") and getattr(out, "numel", lambda: 0)() == self.numel:
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("base_kind", ["fp8", "nf4", "dense"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_adapter_path_matches_lora_math(base_kind, dropout):
    """y = base(x) + s (x A^T) B^T through one addmm per adapter: same output and gradients as the plain
    formula, and no elementwise pass over the [tokens, out_features] output in forward or backward."""
    from surogate_hf.nn import FP8Linear, NF4Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 192, bias=False, dtype=torch.bfloat16)
    base = {"fp8": FP8Linear.from_linear, "nf4": NF4Linear.from_linear, "dense": lambda m: m}[base_kind](dense)
    model = torch.nn.Sequential(base)
    model.register_parameter("anchor", torch.nn.Parameter(torch.zeros(1)))  # PEFT wants one parameter
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["0"], lora_dropout=dropout))
    set_lora_dtype(pm, "fp32")
    layer = pm.base_model.model[0]
    assert isinstance(layer, SurogateLoraLinear)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_()  # PEFT starts B at zero, which would hide a wrong B gradient path
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 5, 192, dtype=torch.bfloat16)

    torch.manual_seed(1)
    with _FullOutputElementwise(2 * 5 * 192) as rec:
        y = pm(x)
        y.backward(dy)
    assert y.shape == (2, 5, 192) and y.dtype == torch.bfloat16
    assert rec.ops == [], rec.ops
    got = (y.detach(), x.grad.clone(), a.grad.clone(), b.grad.clone())

    x.grad = a.grad = b.grad = None
    torch.manual_seed(1)  # same dropout mask
    h = layer.lora_dropout["default"](x) @ a.to(torch.bfloat16).t()
    ref = layer.get_base_layer()(x) + (h @ b.to(torch.bfloat16).t()) * layer.scaling["default"]
    ref.backward(dy)
    want = (ref.detach(), x.grad, a.grad, b.grad)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_set_lora_dtype_bf16_and_bad_values(tiny_dir, batch):
    pm = get_peft_model(load(tiny_dir, "fp8", torch.bfloat16), lora_cfg())
    ids = {id(p) for n, p in pm.named_parameters() if "lora_" in n}
    assert set_lora_dtype(pm, torch.bfloat16) == 14
    assert lora_parameters_dtype(pm) == {torch.bfloat16}
    assert ids == {id(p) for n, p in pm.named_parameters() if "lora_" in n}  # same Parameter objects
    pm(**batch).loss.backward()
    assert {p.grad.dtype for n, p in pm.named_parameters() if "lora_" in n} == {torch.bfloat16}
    with pytest.raises(ValueError, match="lora_dtype"):
        set_lora_dtype(pm, "int8")
    with pytest.raises(ValueError, match="no LoRA linear layers"):
        set_lora_dtype(torch.nn.Sequential(torch.nn.Linear(4, 4)), "bf16")


@pytest.mark.parametrize("fmt", FORMATS)
def test_merge_unmerge_and_merge_and_unload(tiny_dir, batch, fmt):
    q = load(tiny_dir, fmt)
    packed = {n: b.clone() for n, b in q.named_parameters() if "weight" in n and not b.is_floating_point()}
    assert packed
    pm = get_peft_model(q, lora_cfg(init_lora_weights=False))
    pm.eval()
    # the yardstick: the same adapters over dense dequantize(W) bases (LoRA wrappers kept, bases swapped)
    dense_ref = dequantize_model(copy.deepcopy(pm))
    assert not any(isinstance(m, QuantizedLinear) for m in dense_ref.modules())
    with torch.no_grad():
        want = dense_ref(**batch).logits
        ref = pm(**batch).logits
        pm.merge_adapter()
        merged_fwd = pm(**batch).logits
        pm.unmerge_adapter()
        unmerged = pm(**batch).logits
    # unmerge restores the quantized base exactly: buffers untouched, outputs bit-identical
    assert torch.equal(unmerged, ref)
    seen = 0
    for n, b in pm.named_parameters():
        key = n.replace("base_model.model.", "").replace(".base_layer", "")
        if key in packed:
            seen += 1
            assert torch.equal(b, packed[key]), n
    assert seen == len(packed)
    merged_model = pm.merge_and_unload()
    assert not any(isinstance(m, (SurogateLoraLinear, QuantizedLinear)) for m in merged_model.modules())
    with torch.no_grad():
        out = merged_model(**batch).logits
    assert torch.equal(out, merged_fwd)  # the exported dense layers are exactly the merged weights
    rel = lambda a, b: (a - b).abs().max().item() / b.abs().max().item()  # noqa: E731
    err, err_q = rel(out, want), rel(out, ref)
    print(f"{fmt}: merge_and_unload max rel err {err:.2e} vs dense+adapter, {err_q:.2e} vs unmerged quantized")
    assert err <= 1e-5
    # weight-only bases (every format here: this tiny model's fp8 weights are below the weight-only threshold):
    # the unmerged quantized model computes the same product up to fp32 rounding. A W8A8 fp8 base would also round
    # activations to e4m3 (1x128 tiles), which no dense merge reproduces.
    assert err_q <= 1e-5


def test_merge_safe_merge_detects_nan(tiny_dir):
    pm = get_peft_model(load(tiny_dir, "nf4"), lora_cfg())
    layer = next(m for m in pm.modules() if isinstance(m, SurogateLoraLinear))
    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        layer.merge(safe_merge=True)
    assert not layer.merged


def test_variants_needing_the_dense_weight_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="not supported on a nvfp4 base"):
        get_peft_model(load(tiny_dir, "nvfp4"), lora_cfg(use_dora=True))
    with pytest.raises(ValueError, match="decomposes the base weight"):
        get_peft_model(load(tiny_dir, "fp8"), lora_cfg(init_lora_weights="pissa"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_adapter_save_and_reload_give_identical_logits(tiny_dir, batch, tmp_path, fmt):
    pm = get_peft_model(load(tiny_dir, fmt), lora_cfg(init_lora_weights=False))
    pm.eval()
    with torch.no_grad():
        ref = pm(**batch).logits
    pm.save_pretrained(tmp_path / "adapter")

    fresh = PeftModel.from_pretrained(load(tiny_dir, fmt), tmp_path / "adapter")
    assert any(isinstance(m, SurogateLoraLinear) for m in fresh.modules())
    with torch.no_grad():
        assert torch.equal(fresh.eval()(**batch).logits, ref)

    model = load(tiny_dir, fmt)
    model.load_adapter(str(tmp_path / "adapter"))  # transformers' PeftAdapterMixin -> peft inject_adapter
    assert any(isinstance(m, SurogateLoraLinear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, ref)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_merge_to_dense_from_prequantized_checkpoint(tiny_dir, batch, tmp_path, fmt):
    """A pre-quantized base (fine-grained FP8 / ModelOpt NVFP4 written by save_pretrained) merges into a plain
    dense checkpoint that stock transformers loads; LoRA on part of the layers, the rest dequantized."""
    AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=SurogateConfig(format=fmt)).save_pretrained(
        tmp_path / "pq")
    model = prepare_for_training(
        AutoModelForCausalLM.from_pretrained(tmp_path / "pq", quantization_config=SurogateConfig()),
        gradient_checkpointing=False,
    )
    assert all(m.prequantized for m in model.modules() if isinstance(m, QuantizedLinear))
    pm = get_peft_model(model, lora_cfg(target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    # reference: the same adapters over dense dequantized bases (the LoRA wrappers kept, their bases swapped); the
    # unmerged quantized model computes the same product here (weight-only bases: this tiny model's fp8 too)
    ref_model = dequantize_model(copy.deepcopy(pm))
    assert not any(isinstance(m, QuantizedLinear) for m in ref_model.modules())
    with torch.no_grad():
        ref = ref_model.eval()(**batch).logits
        unmerged = pm.eval()(**batch).logits
    dense = merge_to_dense(pm)
    assert not any(isinstance(m, QuantizedLinear) for m in dense.modules())
    assert getattr(dense.config, "quantization_config", None) is None
    dense.save_pretrained(tmp_path / "dense")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        out = plain.eval()(**batch).logits
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    err_q = (out - unmerged).abs().max().item() / unmerged.abs().max().item()
    print(f"prequantized {fmt}: merged dense export max rel err {err:.2e} (vs quantized unmerged {err_q:.2e})")
    assert err <= 1e-5 and err_q <= 1e-5


@pytest.mark.parametrize("fmt,traced,ckpt,whole", [("fp8", False, False, False), ("nf4", False, False, False),
                                                   ("nf4", True, False, False), ("nvfp4", True, False, False),
                                                   ("mxfp4", True, False, False), ("nvfp4", True, True, False),
                                                   ("nf4", False, False, True), ("mxfp4", True, True, True)])
def test_compiled_decoder_layers_train_like_eager(tiny_dir, batch, fmt, traced, ckpt, whole, monkeypatch):
    """What the README recommends for speed, torch.compile: here each decoder layer (fullgraph, so a graph break
    in our LoRA layer or quantized base fails here), same loss and adapter gradients as eager. traced: with the
    token threshold at 0, the 4-bit bases take the in-graph decode (nn.linear.decoded_linear) a real batch takes;
    ckpt: under non-reentrant activation checkpointing as well (a checkpoint region inside a checkpointed layer);
    whole: the whole PeftModel in one compile instead (fullgraph unless checkpointed), loss included, as
    TrainingArguments(torch_compile=True) compiles it through accelerate (torch.compile(model))."""
    from surogate_hf.kernels import paths

    if traced:
        monkeypatch.setattr(paths, "DENSE_MIN_TOKENS", 0)
    torch._dynamo.reset()
    eager = get_peft_model(load(tiny_dir, fmt, torch.bfloat16), lora_cfg())
    if ckpt:
        eager.config.use_cache = False  # (as prepare_for_training sets it; else transformers' warning, a graph break)
        eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        eager.train()
    set_lora_dtype(eager, "fp32")
    with torch.no_grad():
        for n, p in eager.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)  # B starts at zero; give the adapters a gradient path through A too
    compiled = copy.deepcopy(eager)
    if whole:
        # (with checkpointing, transformers' input-gradient hook on the embedding, requires_grad_ on its output, breaks
        # the whole-model graph, stock PEFT's too: there the graph is allowed to break)
        run = torch.compile(compiled, backend="aot_eager", fullgraph=not ckpt)
    else:
        run = compiled
        for layer in compiled.base_model.model.model.layers:
            layer.compile(backend="aot_eager", fullgraph=True)
    losses, grads = [], []
    for m, call in ((eager, eager), (compiled, run)):
        loss = call(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=1e-3)
    for n, g in grads[0].items():
        assert cosine(grads[1][n], g) > 0.99, n


def test_prepare_for_training_fuses_the_norms(tiny_dir, batch):
    """prepare_for_training swaps the stock RMSNorms for FusedRMSNorm (same Parameter, same key, same numbers on
    CPU); fused_norms=False leaves them."""
    from surogate_hf.recipes.norm import FusedRMSNorm

    runs = []
    for fused in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=SurogateConfig(format="nf4"),
                                                     dtype=torch.float32)
        keys = list(model.state_dict())
        model = prepare_for_training(model, gradient_checkpointing=False, fused_norms=fused)
        norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
        assert len(norms) == (2 * 2 + 1 if fused else 0)  # 2 layers x (input, post-attention) + the final norm
        assert list(model.state_dict()) == keys
        torch.manual_seed(0)  # the adapters' init
        pm = get_peft_model(model, lora_cfg())
        pm(**batch).loss.backward()
        runs.append({n: p.grad for n, p in pm.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys() and runs[0]
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


def test_prepare_for_training_names_a_bad_flag(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=SurogateConfig(format="nf4"))
    with pytest.raises(TypeError, match="fused_norms"):
        prepare_for_training(model, fused_norms="yes")
