"""save_pretrained writes the standard layouts; stock transformers (fp8, nf4) and surogate_hf read them back."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from surogate_hf.testing.models import sample_input_ids, save_tiny_model, sqnr_db
from surogate_hf import SurogateConfig
from surogate_hf.nn import QuantizedExperts, QuantizedLinear
from surogate_hf.nn.slots import get_slot, set_slot

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")


def _load(path, **cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), quantization_config=SurogateConfig(**cfg))


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    return {kind: str(save_tiny_model(kind, tmp_path_factory.mktemp(kind), num_hidden_layers=2))
            for kind in ("llama", "qwen3_moe")}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _saved(tmp_path, model):
    model.save_pretrained(str(tmp_path))
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    return sd, cfg


# ---------------------------------------------------------------------------- layouts on disk
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_tensors_are_written_in_the_standard_layout(bf16_dirs, tmp_path, fmt):
    model = _load(bf16_dirs["llama"], format=fmt)
    q_proj = model.model.layers[1].self_attn.q_proj
    sd, cfg = _saved(tmp_path, model)
    pre = "model.layers.1.self_attn.q_proj."
    if fmt == "fp8":
        assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
        assert cfg["activation_scheme"] == "dynamic" and cfg["modules_to_not_convert"] == ["lm_head"]
        names = {"weight": "weight", "weight_scale_inv": "weight_scale_inv"}
    elif fmt == "nvfp4":
        assert (cfg["quant_method"], cfg["quant_algo"], cfg["group_size"]) == ("modelopt", "NVFP4", 16)
        assert cfg["exclude_modules"] == ["lm_head"]
        names = {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2"}
        assert sd[pre + "weight_scale_2"].shape == () and sd[pre + "weight_scale"].dtype == torch.float8_e4m3fn
    elif fmt == "mxfp4":
        assert cfg["quant_method"] == "mxfp4" and cfg["modules_to_not_convert"] == ["lm_head"]
        names = {"weight": "weight", "weight_scale": "weight_scale"}
    else:
        assert cfg["quant_method"] == "bitsandbytes" and cfg["load_in_4bit"] and cfg["bnb_4bit_quant_type"] == "nf4"
        assert cfg["bnb_4bit_use_double_quant"] is True and cfg["llm_int8_skip_modules"] == ["lm_head"]
        names = {"weight": "weight", "weight.absmax": "weight_absmax", "weight.quant_map": "weight_quant_map",
                 "weight.nested_absmax": "weight_nested_absmax", "weight.nested_quant_map": "weight_nested_quant_map"}
        state = json.loads(bytes(sd[pre + "weight.quant_state.bitsandbytes__nf4"].tolist()))
        assert state["quant_type"] == "nf4" and state["blocksize"] == 64 and state["shape"] == [128, 128]
    for disk, buf in names.items():
        assert torch.equal(_bits(sd[pre + disk]), _bits(get_slot(q_proj, buf))), disk
    assert sd["lm_head.weight"].dtype == torch.bfloat16 and sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    internal = ("weight_offset", "weight_absmax", "weight_nested", "weight_quant_map")  # module buffer names only
    assert not any(name in k for k in sd for name in internal)


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_are_saved_per_expert_as_the_checkpoint_stores_them(bf16_dirs, tmp_path, fmt):
    model = _load(bf16_dirs["qwen3_moe"], format=fmt)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts)
    sd, _ = _saved(tmp_path, model)
    assert not any(".experts.gate_up_proj" in k or ".experts.down_proj" in k for k in sd)
    for e in range(experts.num_experts):
        gu = experts.dequantize("gate_up_proj")[e]
        half = gu.shape[0] // 2
        for name, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            assert key in sd
            # each per-expert tensor group decodes (as a linear of the format) to that expert's rows
            lin = _linear_from_disk(sd, key[: -len("weight")], fmt, gu[rows].shape)
            assert torch.equal(lin.dequantize(torch.bfloat16), gu[rows]), key
        key = f"model.layers.0.mlp.experts.{e}.down_proj."
        lin = _linear_from_disk(sd, key, fmt, experts.dequantize("down_proj")[e].shape)
        assert torch.equal(lin.dequantize(torch.bfloat16), experts.dequantize("down_proj")[e])


def _linear_from_disk(sd, prefix, fmt, shape):
    """A quantized linear filled straight from the saved tensors (the on-disk layout = the module slots)."""
    from surogate_hf.nn import LINEAR_CLASSES

    n, k = shape
    lin = LINEAR_CLASSES[fmt](k, n, bias=False, device="cpu", dtype=torch.bfloat16)
    for buf in lin.slot_names():
        disk = buf if fmt != "nf4" else buf.replace("weight_", "weight.")
        if fmt == "nf4" and buf == "weight_offset":
            state = json.loads(bytes(sd[prefix + "weight.quant_state.bitsandbytes__nf4"].tolist()))
            set_slot(lin, buf, torch.tensor(state["nested_offset"], dtype=torch.float32))
            continue
        set_slot(lin, buf, sd[prefix + disk].reshape(get_slot(lin, buf).shape))
    return lin


# ---------------------------------------------------------------------------- stock transformers reads fp8 / nf4
_STOCK = r"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert "surogate_hf" not in sys.modules
ids = torch.load(sys.argv[2])
w = {}  # read before any forward: bitsandbytes repacks 4-bit weights for its CPU kernel on first use
for name, mod in m.named_modules():
    if hasattr(mod, "weight") and getattr(mod.weight, "quant_state", None) is not None:  # bitsandbytes Linear4bit
        import bitsandbytes.functional as bf
        w[name] = bf.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
    elif type(mod).__name__ == "Linear" and "layers" in name:
        w[name] = mod.weight.detach()
    elif type(mod).__name__.endswith("Experts"):
        w[name + ".gate_up_proj"] = mod.gate_up_proj.detach()
        w[name + ".down_proj"] = mod.down_proj.detach()
with torch.no_grad():
    logits = m(ids).logits
torch.save({"logits": logits, "weights": w, "classes": sorted({type(x).__name__ for x in m.modules()})}, sys.argv[3])
"""


def _stock_load(path, ids):
    torch.save(ids, os.path.join(path, "ids.pt"))
    out = os.path.join(path, "stock.pt")
    # a fresh interpreter that never imports surogate_hf: the registry holds stock transformers only
    r = subprocess.run([sys.executable, "-c", _STOCK, str(path), os.path.join(path, "ids.pt"), out],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("kind", ("llama", "qwen3_moe"))
def test_fp8_directory_loads_in_stock_transformers_with_the_same_logits(bf16_dirs, tmp_path, kind):
    model = _load(bf16_dirs[kind], format="fp8")
    ids = sample_input_ids(model.config.vocab_size)
    with torch.no_grad():
        q_logits = model(ids).logits
    model.save_pretrained(str(tmp_path))
    stock = _stock_load(tmp_path, ids)
    # on CPU stock transformers dequantizes fine-grained FP8 to the model dtype: it must decode our
    # tensors to exactly our dequantize(), and so give exactly our dequantized model's logits
    dense = {n: m.dequantize() for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for n, m in model.named_modules():
        if isinstance(m, QuantizedExperts):
            dense.update({f"{n}.{p}": w for p, w in m.dequantize().items()})
    assert set(dense) == set(stock["weights"])
    for n, w in dense.items():
        assert torch.equal(w, stock["weights"][n]), n
    model.dequantize()
    with torch.no_grad():
        d_logits = model(ids).logits
    assert torch.equal(stock["logits"], d_logits)
    # and our W8A8 forward (activations in 1x128 tiles) stays close to it
    s = sqnr_db(stock["logits"], q_logits)
    print(f"fp8 {kind}: quantized forward vs stock dequantized load: {s:.1f} dB")
    assert s > 20


def test_nf4_directory_loads_in_stock_transformers_and_bitsandbytes(bf16_dirs, tmp_path):
    model = _load(bf16_dirs["llama"], format="nf4")
    ids = sample_input_ids(model.config.vocab_size)
    with torch.no_grad():
        q_logits = model(ids).logits
    model.save_pretrained(str(tmp_path))
    stock = _stock_load(tmp_path, ids)
    assert "Linear4bit" in stock["classes"]
    dense = {n: m.dequantize() for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(dense) == set(stock["weights"])
    for n, w in dense.items():
        assert torch.equal(w, stock["weights"][n]), n  # bit-identical decode of the same tensors
    # bitsandbytes' own CPU matmul path rounds differently from our decode-then-linear
    s = sqnr_db(stock["logits"], q_logits)
    print(f"nf4 llama: our forward vs stock bitsandbytes: {s:.1f} dB")
    assert s > 30


def test_gpt_oss_mxfp4_directory_loads_in_stock_transformers(tmp_path):
    """GPT-OSS experts are written as `{P}_blocks` / `{P}_scales`: stock transformers decodes them (on CPU
    it dequantizes to bf16) to exactly our weights, and its logits equal ours."""
    src = tmp_path / "bf16"
    save_tiny_model("gpt_oss", src, num_hidden_layers=2)
    model = _load(src, format="mxfp4", modules_to_not_convert=["self_attn"])
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    ids = sample_input_ids(model.config.vocab_size)
    with torch.no_grad():
        q_logits = model(ids).logits
    out = tmp_path / "mxfp4"
    sd, cfg = _saved(out, model)
    assert cfg["quant_method"] == "mxfp4" and "model.layers.0.self_attn.q_proj" in cfg["modules_to_not_convert"]
    ex = model.model.layers[0].mlp.experts
    assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj_blocks"], ex.gate_up_proj)
    assert sd["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 128, 4, 16)
    assert torch.equal(sd["model.layers.0.mlp.experts.down_proj_scales"], ex.down_proj_scales)
    stock = _stock_load(out, ids)
    assert torch.equal(stock["weights"]["model.layers.0.mlp.experts.gate_up_proj"], ex.dequantize("gate_up_proj"))
    assert torch.equal(stock["weights"]["model.layers.1.mlp.experts.down_proj"],
                       model.model.layers[1].mlp.experts.dequantize("down_proj"))
    assert torch.equal(stock["logits"], q_logits)  # weight-only: our packed forward is the dense forward


# ---------------------------------------------------------------------------- round trip through surogate_hf
@pytest.mark.parametrize("kind", ("llama", "qwen3_moe"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_through_surogate_hf_is_bit_identical(bf16_dirs, tmp_path, kind, fmt):
    model = _load(bf16_dirs[kind], format=fmt)
    ids = sample_input_ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids).logits
    before = {n: (m.dequantize() if isinstance(m, QuantizedLinear) else m.dequantize())
              for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))}
    model.save_pretrained(str(tmp_path))
    again = _load(tmp_path)
    after = {n: m.dequantize() for n, m in again.named_modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))}
    assert set(before) == set(after)
    for n in before:
        b, a = before[n], after[n]
        if isinstance(b, dict):
            assert all(torch.equal(b[p], a[p]) for p in b), n
        else:
            assert torch.equal(b, a), n
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)
