"""SurogateConfig + SurogateHfQuantizer: online quantization of bf16 checkpoints through from_pretrained.

Logit SQNR floors (dB) against the bf16 model, tiny random 4-layer models (hidden 128), 2x16 tokens.
Errors compound over 28 quantized linears (fp8 also quantizes activations) of a random network, so these
sit well below per-layer figures (tests/nn/test_modules.py). Measured (llama / qwen3 / qwen3_moe):
fp8 20.6 / 20.3 / 21.4, nvfp4 14.5 / 13.4 / 14.0, mxfp4 9.2 / 8.8 / 11.4, nf4 11.9 / 12.3 / 13.8.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from surogate_hf.testing.models import TINY_KINDS, build_tiny_model, sample_input_ids, save_tiny_model, sqnr_db
from surogate_hf import SurogateConfig
from surogate_hf.nn import QuantizedExperts, QuantizedLinear, SurogateWarning

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
LOGIT_SQNR_FLOOR = {"fp8": 17.0, "nvfp4": 11.0, "mxfp4": 6.5, "nf4": 9.0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One bf16 checkpoint per tiny model kind, with the bf16 model's logits."""
    out = {}
    for kind in TINY_KINDS:
        path = tmp_path_factory.mktemp(kind)
        model = build_tiny_model(kind)
        model.save_pretrained(str(path))
        ids = sample_input_ids(model.config.vocab_size)
        with torch.no_grad():
            out[kind] = (str(path), ids, model(ids).logits)
    return out


def _load(path, **cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(**cfg))


# ---------------------------------------------------------------------------- config
def test_config_validation_names_the_option():
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        SurogateConfig(format="int4")
    with pytest.raises(ValueError, match="unsupported block_size"):
        SurogateConfig(format="fp8", block_size=(100, 128))
    with pytest.raises(ValueError, match="block_size must be two ints"):
        SurogateConfig(format="fp8", block_size=(128,))
    with pytest.raises(ValueError, match="unsupported nf4_block_size"):
        SurogateConfig(format="nf4", nf4_block_size=32)
    with pytest.raises(ValueError, match="four_over_six_rule"):
        SurogateConfig(format="nvfp4", four_over_six_rule="max")
    with pytest.raises(ValueError, match="skip_quant_first_layers"):
        SurogateConfig(format="nvfp4", skip_quant_first_layers=-1)
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        SurogateConfig(format="nvfp4", modules_to_not_convert="lm_head")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['blocksize'\]"):
        SurogateConfig(format="fp8", blocksize=64)
    with pytest.raises(ValueError, match="ue8m0"):
        SurogateConfig(format="fp8", block_size=None, ue8m0=True)


@pytest.mark.parametrize(
    "fmt,option,value",
    [
        ("mxfp4", "block_size", (16, 16)),
        ("nvfp4", "block_size", (64, 64)),
        ("nf4", "block_size", None),
        (None, "block_size", (64, 64)),
        ("nvfp4", "ue8m0", True),
        ("fp8", "four_over_six", False),
        ("mxfp4", "four_over_six_rule", "mae"),
        ("fp8", "nf4_block_size", 128),
        ("nvfp4", "nf4_double_quant", False),
    ],
)
def test_option_of_another_format_is_an_error_not_ignored(fmt, option, value):
    with pytest.raises(ValueError, match=rf"{option}=.* is an option of format=.* ignored with format={fmt!r}"):
        SurogateConfig(format=fmt, **{option: value})


def test_options_at_their_defaults_are_accepted_for_every_format():
    for fmt in (None, *FORMATS):
        SurogateConfig(format=fmt, block_size=[128, 128], ue8m0=False, four_over_six=True, nf4_block_size=64)


def test_corrupt_safetensors_is_named_and_nothing_loads(tmp_path):
    from surogate_hf.integrations.checkpoint_files import CheckpointFileError

    build_tiny_model("llama").save_pretrained(str(tmp_path))
    file = os.path.join(tmp_path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: not a readable safetensors file.*nothing was loaded"):
        _load(str(tmp_path), format="fp8")


def test_config_round_trip_and_registration():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, AutoQuantizationConfig

    from surogate_hf.integrations.transformers import SurogateHfQuantizer

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["surogate"] is SurogateConfig
    assert AUTO_QUANTIZER_MAPPING["surogate"] is SurogateHfQuantizer
    cfg = SurogateConfig(format="FP8", block_size="tensor", modules_to_not_convert=["o_proj"], skip_quant_last_layers=2)
    assert cfg.format == "fp8" and cfg.block_size is None
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["quant_method"] == "surogate"
    back = AutoQuantizationConfig.from_dict(d)
    assert isinstance(back, SurogateConfig) and back == cfg and back.to_dict() == cfg.to_dict()
    cfg2 = SurogateConfig(format="nvfp4", four_over_six=False, four_over_six_rule="mae")
    assert SurogateConfig.from_dict(cfg2.to_dict()) == cfg2
    q = SurogateHfQuantizer(SurogateConfig(format="nf4"), pre_quantized=False)
    assert q.is_trainable and q.is_serializable() and not q.is_qat_trainable


def test_format_none_goes_to_the_prequantized_quantizer():
    from surogate_hf.integrations.transformers import SurogateHfQuantizer

    try:
        from surogate_hf.integrations.prequantized import PrequantizedHfQuantizer
    except ModuleNotFoundError:
        with pytest.raises(ImportError, match="integrations.prequantized"):
            SurogateHfQuantizer(SurogateConfig(), pre_quantized=True)
    else:
        assert isinstance(SurogateHfQuantizer(SurogateConfig(), pre_quantized=True), PrequantizedHfQuantizer)


def test_import_registers_without_triton_or_native_code():
    # transformers' quantizer registry itself imports torchao (and through it triton) when installed;
    # what surogate_hf adds on top must hold neither triton nor the modules that need it or the native
    # extension. The kernels package's registry (thin CUDA wrappers) is expected: it makes GPU calls fast.
    code = (
        "import sys, transformers.quantizers.auto;"
        "before = set(sys.modules);"
        "import surogate_hf;"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M;"
        "assert 'surogate' in M;"
        "new = set(sys.modules) - before;"
        "heavy = ('surogate_hf.kernels.triton_quant', 'surogate_hf.kernels.triton_gemm', 'surogate_hf.kernels.fp8_gemm');"
        "bad = [m for m in new if m == 'triton' or m.startswith('triton.') or m in heavy or 'surogate_hf_ext' in m];"
        "assert not bad, bad;"
        "assert 'surogate_hf.kernels.registry' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------- loading
@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_online_quantization_of_tiny_models(checkpoints, kind, fmt):
    path, ids, ref_logits = checkpoints[kind]
    model = _load(path, format=fmt)
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers):
        layer = model.model.layers[i]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, proj), QuantizedLinear)
            assert getattr(layer.self_attn, proj).quant_format == fmt
        if kind == "qwen3_moe":
            assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.quant_format == fmt
            assert isinstance(layer.mlp.gate.weight, nn.Parameter) and layer.mlp.gate.weight.dtype == torch.bfloat16
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert isinstance(getattr(layer.mlp, proj), QuantizedLinear)
    # embeddings, norms and lm_head stay bf16
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert type(model.model.embed_tokens) is nn.Embedding and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedExperts)) for p in m.parameters())
    assert model.is_quantized and model.hf_quantizer.quantization_config.format == fmt
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16
    s = sqnr_db(ref_logits, logits)
    print(f"SQNR {kind} {fmt}: {s:.2f} dB")
    assert s > LOGIT_SQNR_FLOOR[fmt], (kind, fmt, s)


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "nvfp4"), ("llama", "nf4")])
def test_model_dequantize_through_transformers(checkpoints, kind, fmt):
    path, ids, _ = checkpoints[kind]
    model = _load(path, format=fmt)
    with torch.no_grad():
        q_logits = model(ids).logits
    model.dequantize()
    assert not any(isinstance(m, (QuantizedLinear, QuantizedExperts)) for m in model.modules())
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    if kind == "qwen3_moe":
        assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
        assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert not getattr(model, "is_quantized", False)
    with torch.no_grad():
        d_logits = model(ids).logits
    # weight-only formats: the quantized forward is the dense forward with the decoded weights
    assert sqnr_db(d_logits, q_logits) > 35


def test_skip_rules(checkpoints):
    path, ids, ref = checkpoints["llama"]
    model = _load(path, format="nvfp4", modules_to_not_convert=["o_proj", "model.layers.1.mlp"],
                  skip_quant_first_layers=1, skip_quant_last_layers=1)
    layers = model.model.layers
    for i in (0, 3):  # first / last decoder layers stay dense entirely
        assert not any(isinstance(m, QuantizedLinear) for m in layers[i].modules())
    for i in (1, 2):
        assert type(layers[i].self_attn.o_proj) is nn.Linear  # suffix pattern
        assert isinstance(layers[i].self_attn.q_proj, QuantizedLinear)
    assert type(layers[1].mlp.up_proj) is nn.Linear and isinstance(layers[2].mlp.up_proj, QuantizedLinear)
    report = model._surogate_report
    assert "model.layers.0.self_attn.q_proj" in report.skipped and "model.layers.2.mlp.down_proj" in report.quantized
    with torch.no_grad():
        assert sqnr_db(ref, model(ids).logits) > LOGIT_SQNR_FLOOR["nvfp4"] + 3  # fewer layers quantized
    with pytest.raises(ValueError, match="exceed the model's 4 decoder layers"):
        _load(path, format="nvfp4", skip_quant_first_layers=3, skip_quant_last_layers=2)


def test_unmatched_modules_to_not_convert_pattern_warns(checkpoints):
    path, _, _ = checkpoints["llama"]
    with pytest.warns(SurogateWarning, match="'visual.proj' matches no module"):
        model = _load(path, format="fp8", modules_to_not_convert=["visual.proj", "down_proj"])
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_dims_the_format_cannot_tile_stay_dense_with_one_warning(tmp_path):
    # intermediate 200: down_proj has in_features 200 (not a multiple of 16 or 32)
    save_tiny_model("llama", tmp_path, intermediate_size=200, num_hidden_layers=2)
    for fmt in ("nvfp4", "mxfp4"):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            model = _load(str(tmp_path), format=fmt)
        msgs = [str(w.message) for w in rec if issubclass(w.category, SurogateWarning)]
        assert len(msgs) == 1 and "model.layers.0.mlp.down_proj" in msgs[0] and "model.layers.1.mlp.down_proj" in msgs[0]
        assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
        assert isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear)  # in_features 128 is fine
    # fp8 tiles any shape (partial edge blocks)
    model = _load(str(tmp_path), format="fp8")
    assert model.model.layers[0].mlp.down_proj.weight_scale_inv.shape == (1, 2)


def test_non_floating_checkpoint_tensor_is_an_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model("llama", tmp_path, num_hidden_layers=2)
    f = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(f)
    key = "model.layers.1.self_attn.k_proj.weight"
    sd[key] = torch.randint(-8, 8, sd[key].shape, dtype=torch.int8)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(TypeError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*I8"):
        _load(str(tmp_path), format="nvfp4")


def test_already_quantized_checkpoint_with_a_format_is_an_error(tmp_path):
    save_tiny_model("llama", tmp_path, num_hidden_layers=1)
    cfg_path = os.path.join(tmp_path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = SurogateConfig(format="fp8").to_dict()
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="already quantized"):
        _load(str(tmp_path), format="fp8")


# ---------------------------------------------------------------------------- memory
_PROBE = r"""
import ctypes, gc, json, sys, threading, time
import torch, surogate_hf
from surogate_hf import SurogateConfig
from transformers import AutoModelForCausalLM

class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI2
def inuse():  # bytes malloc has handed out (torch CPU tensors come from malloc; the mmapped checkpoint does not)
    mi = libc.mallinfo2(); return mi.uordblks + mi.hblkhd
warm, paths, fmts = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
for fmt in fmts:  # first load imports code and builds caches: not part of the measurement
    AutoModelForCausalLM.from_pretrained(warm, quantization_config=SurogateConfig(format=fmt))
gc.collect()
out = {}
for fmt in fmts:
    for path in paths:
        # a sampler can miss a short peak on a busy host: the largest of three loads counts
        for _ in range(3):
            peak, stop = [0], [False]
            def sample():
                while not stop[0]:
                    peak[0] = max(peak[0], inuse()); time.sleep(0.0002)
            base = inuse(); th = threading.Thread(target=sample, daemon=True); th.start()
            m = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format=fmt))
            stop[0] = True; th.join()
            q = sum(t.numel() * t.element_size() for n, t in m.state_dict().items() if "layers." in n)
            prev = out.get(f"{fmt}:{path}", {"peak": 0})
            out[f"{fmt}:{path}"] = {"peak": max(prev["peak"], peak[0] - base), "final": inuse() - base,
                                    "quantized_layers": q}
            del m; gc.collect()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def memory_profile(tmp_path_factory):
    kw = dict(hidden_size=384, intermediate_size=1152, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
              vocab_size=512)
    paths = {}
    for layers in (1, 2, 4):
        p = tmp_path_factory.mktemp(f"mem{layers}")
        save_tiny_model("llama", p, num_hidden_layers=layers, **kw)
        paths[layers] = str(p)
    args = [paths[1], f"{paths[2]},{paths[4]}", "fp8,nvfp4"]
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return paths, res


@pytest.mark.parametrize("fmt", ("fp8", "nvfp4"))
def test_peak_memory_while_loading_is_quantized_size_plus_one_tensor(memory_profile, fmt):
    """Peak malloc'd bytes during from_pretrained, over the quantized result: the work space does not
    grow with depth (tensors are quantized one at a time) and stays within one dense tensor plus the
    reference quantizer's fp32 work space for one row chunk (nn/linear.py QUANTIZE_CHUNK_ELEMENTS)."""
    from surogate_hf.nn.linear import QUANTIZE_CHUNK_ELEMENTS

    paths, res = memory_profile
    largest = 1152 * 384 * 2  # the biggest layer weight, bf16 bytes
    work = 32 * min(QUANTIZE_CHUNK_ELEMENTS, largest // 2)  # <= 8 fp32 temporaries per element of a chunk
    two, four = res[f"{fmt}:{paths[2]}"], res[f"{fmt}:{paths[4]}"]
    dense4 = os.path.getsize(os.path.join(paths[4], "model.safetensors"))
    over2, over4 = two["peak"] - two["final"], four["peak"] - four["final"]
    print(f"{fmt}: 4 layers: dense checkpoint {dense4/1e6:.1f} MB, quantized layers {four['quantized_layers']/1e6:.2f} MB, "
          f"held after load {four['final']/1e6:.2f} MB, peak {four['peak']/1e6:.2f} MB, transient {over4/1e6:.2f} MB "
          f"(2 layers: {over2/1e6:.2f} MB); largest dense tensor {largest/1e6:.2f} MB")
    assert four["final"] <= four["quantized_layers"] * 1.1 + 2 * largest  # nothing dense is kept around
    assert over4 <= over2 * 1.25 + largest  # one tensor at a time: depth does not raise the peak
    assert four["peak"] <= four["final"] + 2 * largest + work
