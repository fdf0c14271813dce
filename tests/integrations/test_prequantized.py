"""Pre-quantized checkpoints load as stored (issue 3). Oracles: transformers' own fine-grained FP8 code and its
GPT-OSS `convert_moe_packed_tensors`; surogate_hf.formats for the ModelOpt layout (formats.md)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.quantizers import auto as hf_auto

from surogate_hf.testing import prequant as P
import surogate_hf
import surogate_hf.integrations.modelopt  # noqa: F401  (until the package __init__ imports it)
from surogate_hf import SurogateConfig
from surogate_hf import formats as F
from surogate_hf.integrations import prequantized as PQ
from surogate_hf.nn.experts import QuantizedExperts
from surogate_hf.nn.linear import FP8Linear, MXFP4Linear, NF4Linear, NVFP4Linear, QuantizedLinear
from surogate_hf.nn.slots import get_slot, named_slots

MIXED = {"q_proj": "NVFP4", "k_proj": "NVFP4", "v_proj": "FP8", "o_proj": "FP8", "gate_proj": "NVFP4", "down_proj": "FP8"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequant")
    made = {}

    writers = {
        "llama_fp8": lambda d: P.write_fp8(d, "llama"),
        "qwen3_fp8": lambda d: P.write_fp8(d, "qwen3"),
        "llama_fp8ue8m0": lambda d: P.write_fp8(d, "llama", scale_fmt="ue8m0"),
        "llama_fp8tensor": lambda d: P.write_fp8(d, "llama", block=None),  # no weight_block_size: one scale per tensor
        "llama_nvfp4": lambda d: P.write_modelopt(d, "llama", "NVFP4"),
        "qwen3_nvfp4": lambda d: P.write_modelopt(d, "qwen3", "NVFP4"),
        "qwen3_mofp8": lambda d: P.write_modelopt(d, "qwen3", "FP8"),
        "llama_mixed": lambda d: P.write_modelopt(d, "llama", "MIXED_PRECISION", mixed=MIXED),
        "llama_legacy": lambda d: P.write_modelopt(d, "llama", "NVFP4", legacy=True),
        "gptoss_mxfp4": P.write_gpt_oss_mxfp4,
        "qwen3_moe_fp8": lambda d: P.write_fp8(d, P.MOE_ARCH, skip=("lm_head", "mlp.gate")),
        # ModelOpt unifies the amax of gate/up (fused by inference engines): one global scale per expert
        "qwen3_moe_nvfp4": lambda d: P.write_modelopt(d, P.MOE_ARCH, "NVFP4", exclude=("lm_head", "*.mlp.gate"), fused_amax=True),
        "qwen3_moe_nvfp4split": lambda d: P.write_modelopt(d, P.MOE_ARCH, "NVFP4", exclude=("lm_head", "*.mlp.gate")),
        # attention stays bf16 and unlisted: an mxfp4 config quantizes packed-stored linears only
        "llama_mxfp4": lambda d: P.write_mxfp4_linears(d, "llama", only=("gate_proj", "up_proj", "down_proj")),
        "qwen3_moe_mxfp4": lambda d: P.write_mxfp4_linears(d, P.MOE_ARCH, skip=("lm_head", "mlp.gate")),
        "llama_nf4": lambda d: P.write_bnb_nf4(d, "llama"),
        "qwen3_nf4plain": lambda d: P.write_bnb_nf4(d, "qwen3", double_quant=False, block=128),
        # stock bitsandbytes quantizes nn.Linear only: the MoE experts are stored bf16
        "qwen3_moe_nf4": lambda d: P.write_bnb_nf4(d, P.MOE_ARCH, skip=("lm_head", "mlp.gate")),
    }

    def get(name):
        if name not in made:
            made[name] = str(root / name)
            writers[name](made[name])
        return made[name]

    return get


def copy_ckpt(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, **kw)


def quantized(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))}


def dense_twin(model, arch):
    """A dense model of the same architecture holding the quantized model's weights, decoded."""
    dense = P.dense_model(arch)
    with torch.no_grad():
        sd = {k: v for k, v in model.state_dict().items()}
        for name, module in dense.named_modules():
            q = model.get_submodule(name) if name else model
            if isinstance(q, QuantizedLinear):
                module.weight.copy_(q.dequantize(module.weight.dtype))
            elif isinstance(q, QuantizedExperts):
                for p in q.projections:
                    getattr(module, p).copy_(q.dequantize(p, getattr(module, p).dtype))
            else:
                for pname, par in module.named_parameters(recurse=False):
                    par.copy_(sd[f"{name}.{pname}"])
    return dense


def logits(model, seed=0):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def stored_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


# ---------------------------------------------------------------- fine-grained FP8
@pytest.mark.parametrize("name", ["llama_fp8", "qwen3_fp8", "llama_fp8tensor"])
def test_fp8_decodes_like_transformers_bit_for_bit(ckpt, name):
    path = ckpt(name)
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    mods = quantized(model)
    assert len(mods) == 7 * 2 and all(isinstance(m, FP8Linear) and m.prequantized for m in mods.values())
    oracle = Fp8Dequantize(None)
    for name, m in mods.items():
        want = oracle._dequantize_one(stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"], torch.float32)
        assert torch.equal(m.dequantize(torch.float32), want), name
        assert get_slot(m, "weight").dtype == torch.float8_e4m3fn and not any(p.requires_grad for p in m.parameters())
    assert type(model.lm_head) is torch.nn.Linear  # modules_to_not_convert stays dense


@pytest.mark.parametrize("arch", P.ARCHS)
def test_fp8_logits_close_to_dense_decoded(ckpt, arch):
    # FP8 bases run W8A8 (activations in 1x128 E4M3 tiles), so logits differ from the dense-decoded model
    # by activation rounding only.
    model = load(ckpt(f"{arch}_fp8"), quantization_config=SurogateConfig())
    ref = logits(dense_twin(model, arch))
    diff = (logits(model) - ref).abs().max().item()
    print(f"[{arch} fp8] logits max-abs diff vs dense decoded: {diff:.3e} (|logits| max {ref.abs().max():.3f})")
    assert diff < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("as_bytes", [False, True])
def test_fp8_ue8m0_loads_and_saves_as_stored(ckpt, tmp_path, as_bytes):
    # transformers writes float8_e8m0fnu; MXFP8-style exports store the same exponents as uint8 bytes
    path = copy_ckpt(ckpt("llama_fp8ue8m0"), tmp_path / "ue8m0")
    if as_bytes:
        P.rewrite_tensors(path, lambda sd: {k: v.view(torch.uint8) if k.endswith("scale_inv") else v for k, v in sd.items()})
    stored = P.read_tensors(path)
    assert stored["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == (torch.uint8 if as_bytes else torch.float8_e8m0fnu)
    model = load(path, quantization_config=SurogateConfig())
    q = model.model.layers[0].self_attn.q_proj
    assert get_slot(q, "weight_scale_inv").dtype == torch.float32
    want = Fp8Dequantize(None)._dequantize_one(  # the oracle reads uint8 scales as E8M0 exponents too
        stored["model.layers.0.self_attn.q_proj.weight"], stored["model.layers.0.self_attn.q_proj.weight_scale_inv"],
        torch.float32,
    )
    assert torch.equal(q.dequantize(torch.float32), want)
    model.save_pretrained(tmp_path / "out")
    again = P.read_tensors(str(tmp_path / "out"))
    for k, v in stored.items():
        assert again[k].dtype == v.dtype and torch.equal(stored_bytes(again[k]), stored_bytes(v)), k


def test_fp8_scale_alias_is_read_and_written_back(ckpt, tmp_path):
    path = copy_ckpt(ckpt("llama_fp8"), tmp_path / "alias")
    P.rewrite_tensors(path, lambda sd: {k.replace(".weight_scale_inv", ".scale"): v for k, v in sd.items()})
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    q = model.model.layers[1].mlp.up_proj
    want = Fp8Dequantize(None)._dequantize_one(
        stored["model.layers.1.mlp.up_proj.weight"], stored["model.layers.1.mlp.up_proj.scale"], torch.float32
    )
    assert torch.equal(q.dequantize(torch.float32), want)
    model.save_pretrained(tmp_path / "out")
    assert set(P.read_tensors(str(tmp_path / "out"))) == set(stored)


# ---------------------------------------------------------------- ModelOpt
@pytest.mark.parametrize("arch", P.ARCHS)
def test_modelopt_nvfp4_loads_without_surogate_config(ckpt, arch):
    path = ckpt(f"{arch}_nvfp4")
    model = load(path)  # quant_method "modelopt" is registered by surogate_hf
    stored = P.read_tensors(path)
    mods = quantized(model)
    assert len(mods) == 14 and all(isinstance(m, NVFP4Linear) for m in mods.values())
    for name, m in mods.items():
        want = F.dequantize_nvfp4(stored[f"{name}.weight"], stored[f"{name}.weight_scale"], stored[f"{name}.weight_scale_2"], torch.float32)
        assert torch.equal(m.dequantize(torch.float32), want), name
    diff = (logits(model) - logits(dense_twin(model, arch))).abs().max().item()
    print(f"[{arch} nvfp4] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff == 0.0  # weight-only: the same bf16 GEMM on the same decoded weights


def test_modelopt_mixed_precision_per_layer(ckpt):
    path = ckpt("llama_mixed")
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in P.LINEAR_SUFFIXES:
            continue
        algo = MIXED.get(leaf)
        if algo is None:
            assert type(m) is torch.nn.Linear, name  # up_proj is not listed: stays dense
            continue
        if algo == "NVFP4":
            assert isinstance(m, NVFP4Linear), name
            want = F.dequantize_nvfp4(stored[f"{name}.weight"], stored[f"{name}.weight_scale"], stored[f"{name}.weight_scale_2"], torch.float32)
        else:
            assert isinstance(m, FP8Linear) and m.block_size is None, name
            w = stored[f"{name}.weight"]
            want = F.dequantize_fp8_blocks(w, stored[f"{name}.weight_scale"].reshape(1, 1), tuple(w.shape), torch.float32)
        assert torch.equal(m.dequantize(torch.float32), want), name
    diff = (logits(model) - logits(dense_twin(model, "llama"))).abs().max().item()
    print(f"[llama MIXED_PRECISION] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff < 0.05


def test_modelopt_legacy_hf_quant_config(ckpt):
    path = ckpt("llama_legacy")
    assert "quantization_config" not in json.load(open(os.path.join(path, "config.json")))
    model = load(path, quantization_config=SurogateConfig())
    assert len(quantized(model)) == 14
    assert model.config.quantization_config.to_dict()["quant_method"] == "modelopt"


# ---------------------------------------------------------------- GPT-OSS MXFP4
def test_gpt_oss_mxfp4_experts_stay_packed(ckpt):
    path = ckpt("gptoss_mxfp4")
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    experts = {n: m for n, m in quantized(model).items()}
    assert len(experts) == 2 and all(isinstance(m, QuantizedExperts) for m in experts.values())
    total_bytes = total_params = 0
    for name, m in experts.items():
        for p in ("gate_up_proj", "down_proj"):
            want = convert_moe_packed_tensors(stored[f"{name}.{p}_blocks"], stored[f"{name}.{p}_scales"], dtype=torch.float32)
            assert torch.equal(m.dequantize(p, torch.float32), want), f"{name}.{p}"
            n, k, _ = m.projections[p]
            total_params += m.num_experts * n * k
        assert not any(t.is_floating_point() and t.dim() == 3 for t in m.parameters())  # no dense expert weight
        total_bytes += m.quantized_nbytes()
    bpp = total_bytes / total_params
    print(f"[gpt-oss mxfp4] expert bytes/param: {bpp:.5f}")
    assert bpp == 0.5 + 1 / 32
    # the attention and router stay dense (modules_to_not_convert)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    diff = (logits(model) - logits(dense_twin(model, "gpt_oss"))).abs().max().item()
    print(f"[gpt-oss mxfp4] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff == 0.0


# ---------------------------------------------------------------- MXFP4 dense linears
def _mxfp4_oracle(packed, scales):
    """transformers' GPT-OSS decode of one [N, K/2] linear (it returns the experts' [E, K, N] layout)."""
    n, g = scales.shape
    return convert_moe_packed_tensors(packed.reshape(1, n, g, 16), scales[None], dtype=torch.float32)[0].t()


def test_mxfp4_dense_linears_decode_like_transformers(ckpt):
    path = ckpt("llama_mxfp4")
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    mods = quantized(model)
    assert len(mods) == 3 * 2 and all(isinstance(m, MXFP4Linear) and m.prequantized for m in mods.values())
    for name, m in mods.items():
        assert torch.equal(m.dequantize(torch.float32), _mxfp4_oracle(stored[f"{name}.weight"], stored[f"{name}.weight_scale"])), name
        assert m.weight.dtype == torch.uint8 and not any(p.requires_grad for p in m.parameters())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # stored bf16: stays dense
    diff = (logits(model) - logits(dense_twin(model, "llama"))).abs().max().item()
    print(f"[llama mxfp4 linears] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff == 0.0  # weight-only


def test_moe_mxfp4_components_fuse_exactly(ckpt):
    path = ckpt("qwen3_moe_mxfp4")
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    ex = model.get_submodule(EXPERTS)
    assert isinstance(ex, QuantizedExperts) and ex.quant_format == "mxfp4" and ex.prequantized

    def dec(e, c):
        return _mxfp4_oracle(stored[f"{EXPERTS}.{e}.{c}.weight"], stored[f"{EXPERTS}.{e}.{c}.weight_scale"])

    assert torch.equal(ex.dequantize("gate_up_proj", torch.float32), torch.stack([torch.cat([dec(e, "gate_proj"), dec(e, "up_proj")]) for e in range(4)]))
    assert torch.equal(ex.dequantize("down_proj", torch.float32), torch.stack([dec(e, "down_proj") for e in range(4)]))
    assert (logits(model) - logits(dense_twin(model, P.MOE_ARCH))).abs().max().item() == 0.0


# ---------------------------------------------------------------- bitsandbytes NF4
def _bnb_oracle(stored, name):
    import bitsandbytes.functional as bnbf

    prefix = f"{name}.weight."
    state = bnbf.QuantState.from_dict({k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}, device="cpu")
    return bnbf.dequantize_4bit(stored[f"{name}.weight"], state)


@pytest.mark.parametrize("name,arch,block,nested", [("llama_nf4", "llama", 64, True), ("qwen3_nf4plain", "qwen3", 128, False)])
def test_bnb_nf4_decodes_like_bitsandbytes(ckpt, name, arch, block, nested):
    path = ckpt(name)
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    mods = quantized(model)
    assert len(mods) == 7 * 2 and all(isinstance(m, NF4Linear) and m.prequantized for m in mods.values())
    for mod_name, m in mods.items():
        assert (m.fmt.block_size, m.fmt.double_quant) == (block, nested)
        assert torch.equal(m.dequantize(torch.bfloat16), _bnb_oracle(stored, mod_name)), mod_name
        assert not any(p.requires_grad for p in m.parameters())
    assert type(model.lm_head) is torch.nn.Linear
    diff = (logits(model) - logits(dense_twin(model, arch))).abs().max().item()
    print(f"[{arch} nf4 {block} nested={nested}] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff == 0.0  # weight-only: decode, then the same bf16 GEMM


def test_bnb_moe_experts_stored_dense_stay_dense(ckpt):
    model = load(ckpt("qwen3_moe_nf4"), quantization_config=SurogateConfig())
    assert type(model.get_submodule(EXPERTS)).__name__ == "Qwen3MoeExperts"
    assert isinstance(model.get_submodule("model.layers.1.self_attn.q_proj"), NF4Linear)
    assert type(model.get_submodule("model.layers.1.mlp.gate")).__name__ != "NF4Linear"


def test_without_surogate_config_bitsandbytes_stays_transformers(ckpt):
    stock = load(ckpt("llama_nf4"))  # surogate_hf is imported: "bitsandbytes" must still be transformers' own
    assert not quantized(stock)
    assert type(stock.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert hf_auto.AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"].__module__.startswith("transformers.")
    ours = load(ckpt("llama_nf4"), quantization_config=SurogateConfig())
    import bitsandbytes.functional as bnbf

    q = stock.model.layers[1].mlp.down_proj
    want = bnbf.dequantize_4bit(q.weight.data, q.weight.quant_state)
    assert torch.equal(ours.model.layers[1].mlp.down_proj.dequantize(torch.bfloat16), want)


@pytest.mark.parametrize("fmt,options", [("mxfp4", {}), ("nf4", {}), ("nf4", {"nf4_double_quant": False})])
def test_own_moe_save_reloads_and_saves_back_byte_identical(tmp_path, fmt, options):
    """surogate_hf's own per-expert mxfp4 / nf4 layout: loaded as stored (experts fused from the per-expert tensors)
    and written back unchanged, config included."""
    P.dense_model(P.MOE_ARCH).save_pretrained(tmp_path / "bf16")
    online = load(str(tmp_path / "bf16"), quantization_config=SurogateConfig(format=fmt, **options))
    online.save_pretrained(tmp_path / "q")
    model = load(str(tmp_path / "q"), quantization_config=SurogateConfig())
    ex = model.get_submodule(EXPERTS)
    assert isinstance(ex, QuantizedExperts) and ex.quant_format == fmt and ex.prequantized
    for p in ex.projections:
        assert torch.equal(ex.dequantize(p), online.get_submodule(EXPERTS).dequantize(p)), p
    model.save_pretrained(tmp_path / "again")
    first, again = P.read_tensors(str(tmp_path / "q")), P.read_tensors(str(tmp_path / "again"))
    assert set(first) == set(again)
    for k, v in first.items():
        assert again[k].dtype == v.dtype and torch.equal(stored_bytes(again[k]), stored_bytes(v)), k
    cfg = [json.load(open(tmp_path / d / "config.json"))["quantization_config"] for d in ("q", "again")]
    assert cfg[0] == cfg[1]


def test_model_to_dtype_keeps_carried_fp32_scales(ckpt):
    model = load(ckpt("llama_nvfp4"))
    q = model.model.layers[0].self_attn.q_proj
    before = {n: b.clone() for n, b in named_slots(q).items()}
    assert before["input_scale"].dtype == torch.float32
    model.to(torch.float16)
    for n, b in named_slots(q).items():
        assert b.dtype == before[n].dtype and torch.equal(stored_bytes(b), stored_bytes(before[n])), n
    assert q.bias is None or q.bias.dtype == torch.float16


# ---------------------------------------------------------------- MoE experts stored per expert and component
EXPERTS = "model.layers.1.mlp.experts"


def test_moe_fp8_components_fuse_exactly(ckpt):
    path = ckpt("qwen3_moe_fp8")
    model = load(path, quantization_config=SurogateConfig())
    stored = P.read_tensors(path)
    ex = model.get_submodule(EXPERTS)
    assert isinstance(ex, QuantizedExperts) and ex.quant_format == "fp8" and ex.prequantized
    oracle = Fp8Dequantize(None)

    def dec(e, c):
        return oracle._dequantize_one(stored[f"{EXPERTS}.{e}.{c}.weight"], stored[f"{EXPERTS}.{e}.{c}.weight_scale_inv"], torch.float32)

    assert torch.equal(ex.dequantize("gate_up_proj", torch.float32), torch.stack([torch.cat([dec(e, "gate_proj"), dec(e, "up_proj")]) for e in range(4)]))
    assert torch.equal(ex.dequantize("down_proj", torch.float32), torch.stack([dec(e, "down_proj") for e in range(4)]))
    ref = logits(dense_twin(model, P.MOE_ARCH))
    diff = (logits(model) - ref).abs().max().item()
    print(f"[qwen3-moe fp8] logits max-abs diff vs dense decoded: {diff:.3e} (|logits| max {ref.abs().max():.3f})")
    assert diff < 0.05 * ref.abs().max().item()


def test_moe_nvfp4_unified_global_fuses_exactly(ckpt):
    path = ckpt("qwen3_moe_nvfp4")
    model = load(path)
    stored = P.read_tensors(path)
    ex = model.get_submodule(EXPERTS)

    def dec(e, c):
        k = f"{EXPERTS}.{e}.{c}"
        return F.dequantize_nvfp4(stored[f"{k}.weight"], stored[f"{k}.weight_scale"], stored[f"{k}.weight_scale_2"], torch.float32)

    assert torch.equal(ex.dequantize("gate_up_proj", torch.float32), torch.stack([torch.cat([dec(e, "gate_proj"), dec(e, "up_proj")]) for e in range(4)]))
    diff = (logits(model) - logits(dense_twin(model, P.MOE_ARCH))).abs().max().item()
    print(f"[qwen3-moe nvfp4] logits max-abs diff vs dense decoded: {diff:.3e}")
    assert diff == 0.0


def test_moe_nvfp4_separate_globals_are_requantized_with_a_warning(ckpt):
    path = ckpt("qwen3_moe_nvfp4split")
    from surogate_hf.integrations.prequantized import FuseStoredExperts

    FuseStoredExperts._warned = False
    with pytest.warns(UserWarning, match="different NVFP4 global scales.*re-quantizing"):
        model = load(path)
    stored = P.read_tensors(path)
    ex = model.get_submodule(EXPERTS)
    for e in range(4):
        parts = []
        for c in ("gate_proj", "up_proj"):
            k = f"{EXPERTS}.{e}.{c}"
            parts.append(F.dequantize_nvfp4(stored[f"{k}.weight"], stored[f"{k}.weight_scale"], stored[f"{k}.weight_scale_2"], torch.float32))
        fused = F.quantize_nvfp4(torch.cat(parts), four_over_six=False)
        assert torch.equal(ex.dequantize("gate_up_proj", torch.float32)[e], F.dequantize_nvfp4(*fused, out_dtype=torch.float32))


# ---------------------------------------------------------------- save_pretrained round trip
@pytest.mark.parametrize(
    "name", ["qwen3_fp8", "llama_fp8tensor", "llama_nvfp4", "llama_mixed", "qwen3_mofp8", "gptoss_mxfp4", "qwen3_moe_fp8",
             "qwen3_moe_nvfp4", "llama_mxfp4", "qwen3_moe_mxfp4", "llama_nf4", "qwen3_nf4plain", "qwen3_moe_nf4"]
)
def test_save_writes_the_stored_layout_and_reloads_bit_identical(ckpt, tmp_path, name):
    path = ckpt(name)
    first = load(path, quantization_config=SurogateConfig())
    first.save_pretrained(tmp_path / "out")
    stored, written = P.read_tensors(path), P.read_tensors(str(tmp_path / "out"))
    assert set(written) == set(stored)
    for k, v in stored.items():
        assert written[k].dtype == v.dtype and written[k].shape == v.shape, k
        assert torch.equal(stored_bytes(written[k]), stored_bytes(v)), k
    cfg = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    assert json.load(open(tmp_path / "out" / "config.json"))["quantization_config"] == cfg
    second = load(str(tmp_path / "out"), quantization_config=SurogateConfig())
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(stored_bytes(a[k]), stored_bytes(b[k])), k
    assert torch.equal(logits(first), logits(second))


# ---------------------------------------------------------------- transformers' own behaviour is kept
def test_without_surogate_config_fp8_and_mxfp4_stay_transformers(ckpt):
    fp8 = load(ckpt("llama_fp8"))
    assert not quantized(fp8) and type(fp8.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    ours = load(ckpt("llama_fp8"), quantization_config=SurogateConfig())
    # transformers (CPU: dequantizes to bf16 itself) decodes to what our modules decode to
    for name, m in quantized(ours).items():
        assert torch.equal(fp8.get_submodule(name).weight, m.dequantize(torch.bfloat16)), name
    mx = load(ckpt("gptoss_mxfp4"))
    assert not quantized(mx) and type(mx.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    assert hf_auto.AUTO_QUANTIZER_MAPPING["fp8"].__module__.startswith("transformers.")
    assert hf_auto.AUTO_QUANTIZER_MAPPING["mxfp4"].__module__.startswith("transformers.")


def test_importing_surogate_hf_registers_modelopt_and_creating_a_config_installs_the_merge_seam():
    # In a fresh interpreter: `import surogate_hf` registers ModelOpt through transformers' public registries and
    # patches nothing; creating a SurogateConfig installs the merge seam, so SurogateConfig() on fp8 / mxfp4 /
    # modelopt checkpoints works as the README shows.
    import subprocess
    import sys

    code = (
        "import surogate_hf\n"
        "from transformers.quantizers import auto as a\n"
        "from surogate_hf.integrations import prequantized as pq\n"
        "assert 'modelopt' in a.AUTO_QUANTIZER_MAPPING and 'modelopt' in a.AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "assert a.AutoHfQuantizer.merge_quantization_configs.__func__ is pq._original_merge\n"
        "surogate_hf.SurogateConfig()\n"
        "assert a.AutoHfQuantizer.merge_quantization_configs.__func__ is pq._merge_quantization_configs\n"
        "pq.uninstall_merge_patch()\n"
        "assert a.AutoHfQuantizer.merge_quantization_configs.__func__ is pq._original_merge\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert surogate_hf.SurogateConfig is SurogateConfig


def test_merge_patch_still_needed():
    # If transformers starts accepting a different config class here, the patch in prequantized.py can go.
    with pytest.raises(ValueError, match="but you are passing a SurogateConfig"):
        PQ._original_merge(hf_auto.AutoHfQuantizer, {"quant_method": "fp8", "weight_block_size": [128, 128]}, SurogateConfig())
    # ... and the patch only applies while get_hf_quantizer goes through this classmethod.
    assert "AutoHfQuantizer.merge_quantization_configs(" in inspect.getsource(hf_auto.get_hf_quantizer)


def test_trainable_and_frozen(ckpt):
    model = load(ckpt("llama_nvfp4"))
    assert model.hf_quantizer.is_trainable and model.hf_quantizer.is_serializable()
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    q(x).float().sum().backward()
    assert x.grad is not None and not any(p.requires_grad for p in q.parameters())


# ---------------------------------------------------------------- errors
def test_online_format_on_prequantized_checkpoint_is_an_error(ckpt):
    with pytest.raises(ValueError, match=r"already quantized.*quant_method 'fp8'.*format='nvfp4'"):
        load(ckpt("llama_fp8"), quantization_config=SurogateConfig(format="nvfp4"))
    with pytest.raises(ValueError, match=r"already quantized.*'modelopt'"):
        load(ckpt("llama_nvfp4"), quantization_config=SurogateConfig(format="fp8"))


def test_modules_to_not_convert_on_prequantized_is_an_error(ckpt):
    with pytest.raises(ValueError, match=r"modules_to_not_convert=\.\.\.\) has no effect on a pre-quantized checkpoint"):
        load(ckpt("llama_fp8"), quantization_config=SurogateConfig(modules_to_not_convert=["q_proj"]))


def test_no_quantization_anywhere_is_an_error(tmp_path):
    model = P.dense_model("llama")
    model.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="no quantization_config in config.json and no hf_quant_config.json"):
        load(str(tmp_path / "dense"), quantization_config=SurogateConfig())


def test_unknown_quant_method_is_named_with_the_supported_ones(ckpt, tmp_path):
    path = copy_ckpt(ckpt("llama_fp8"), tmp_path / "fp9")
    P.rewrite_quant_config(path, lambda c: {**c, "quant_method": "fp9"})
    with pytest.raises(PQ.PrequantizedCheckpointError, match=r"config\.json quantization_config: quant_method 'fp9' "
                       r"is not a pre-quantized layout surogate_hf loads; supported: 'fp8' .*'modelopt'.*'mxfp4'.*'bitsandbytes'"):
        load(path, quantization_config=SurogateConfig())


@pytest.mark.parametrize("damage", ["truncated", "garbage_header"])
def test_corrupt_safetensors_is_named_and_nothing_loads(ckpt, tmp_path, damage):
    from surogate_hf.integrations.checkpoint_files import CheckpointFileError

    path = copy_ckpt(ckpt("llama_nvfp4"), tmp_path / damage)
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.path.getsize(file) // 2)
        else:
            f.write(b"\xff" * 64)
    for kw in ({}, {"quantization_config": SurogateConfig()}):  # ModelOpt: our quantizer with or without the config
        with pytest.raises(CheckpointFileError, match=rf"{re.escape(file)}: not a readable safetensors file.*nothing was loaded"):
            load(path, **kw)


Q = "model.layers.0.self_attn.q_proj"
M = "model.layers.0.mlp.up_proj"  # [256, 128]


def _bnb_json(t, **changes):
    state = {**json.loads(bytes(t.tolist())), **changes}
    return torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


def _drop(key):
    return lambda sd: {k: v for k, v in sd.items() if k != key}


def _set(key, value_fn):
    return lambda sd: {**sd, key: value_fn(sd[key])}


def _nan_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _zero_at(t, i):
    """`t` with its i-th element (flat) set to zero, bytes kept for 1-byte dtypes."""
    t = t.clone()
    (t.view(torch.uint8) if t.element_size() == 1 else t).view(-1)[i] = 0
    return t


BAD_TENSORS = [
    ("llama_fp8", _drop(f"{Q}.weight_scale_inv"), rf"missing scale: {Q}\.weight_scale_inv"),
    ("llama_fp8", _set(f"{Q}.weight_scale_inv", lambda t: torch.ones(2, 2)), rf"{Q}\.weight_scale_inv has shape \[2, 2\], expected \[1, 1\]"),
    ("llama_fp8", _set(f"{Q}.weight_scale_inv", lambda t: t.bfloat16()), rf"{Q}\.weight_scale_inv has dtype BF16, expected F32"),
    ("llama_fp8", _set(f"{Q}.weight_scale_inv", _nan_first), rf"{Q}\.weight_scale_inv: 1 NaN/inf"),
    # zero scales over non-zero codes decode to zeros: all zero, one zero block, per-tensor, fused experts
    ("llama_fp8", _set(f"{Q}.weight_scale_inv", torch.zeros_like), rf"{Q}\.weight_scale_inv: 1 zero scale\(s\) over blocks of non-zero codes"),
    ("llama_fp8", _set(f"{M}.weight_scale_inv", lambda t: _zero_at(t, 1)), rf"{M}\.weight_scale_inv: 1 zero scale\(s\) over"),
    ("llama_fp8tensor", _set(f"{Q}.weight_scale_inv", torch.zeros_like), rf"{Q}\.weight_scale_inv: 1 zero scale\(s\) over"),
    ("qwen3_mofp8", _set(f"{Q}.weight_scale", torch.zeros_like), rf"{Q}\.weight_scale: 1 zero scale\(s\) over"),
    ("llama_nvfp4", _set(f"{Q}.weight_scale", lambda t: _zero_at(t, 0)), rf"{Q}\.weight_scale: 1 zero scale\(s\) over"),
    (
        "qwen3_moe_fp8",
        _set("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv", torch.zeros_like),
        r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight_scale_inv: \d+ zero scale\(s\) over",
    ),
    ("llama_nvfp4", _set(f"{Q}.weight_scale_2", lambda t: torch.tensor(float("inf"))), rf"{Q}\.weight_scale_2: 1 NaN/inf"),
    ("llama_nvfp4", _set(f"{Q}.weight_scale", lambda t: torch.full_like(t.float(), float("nan")).to(t.dtype)), rf"{Q}\.weight_scale: \d+ NaN/inf"),
    ("llama_nvfp4", _drop(f"{Q}.weight_scale_2"), rf"missing NVFP4 global scale weight_scale_2: {Q}\.weight_scale_2"),
    ("llama_nvfp4", _set(f"{Q}.weight_scale", lambda t: t.float()), rf"{Q}\.weight_scale has dtype F32, expected F8_E4M3"),
    (
        "gptoss_mxfp4",
        _set("model.layers.1.mlp.experts.down_proj_scales", lambda t: torch.full_like(t, 255)),
        r"model\.layers\.1\.mlp\.experts\.down_proj_scales: \d+ E8M0 scale byte\(s\) are 255",
    ),
    (
        "gptoss_mxfp4",
        _set("model.layers.0.mlp.experts.gate_up_proj_blocks", lambda t: t[:, :, :1]),
        r"gate_up_proj_blocks has shape \[4, 128, 1, 16\], expected \[4, 128, 2, 16\]",
    ),
    (
        "qwen3_moe_fp8",
        _drop("model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"),
        r"missing scale: model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight_scale_inv",
    ),
    # MXFP4 dense linears
    ("llama_mxfp4", _drop(f"{M}.weight_scale"), rf"missing MXFP4 E8M0 block scale .*: {M}\.weight_scale not found"),
    ("llama_mxfp4", _set(f"{M}.weight_scale", lambda t: t.float()), rf"{M}\.weight_scale has dtype F32, expected U8"),
    ("llama_mxfp4", _set(f"{M}.weight", lambda t: t[:, :32]), rf"{M}\.weight has shape \[256, 32\], expected \[256, 64\]"),
    ("llama_mxfp4", _set(f"{M}.weight_scale", lambda t: torch.full_like(t, 255)), rf"{M}\.weight_scale: 1024 E8M0 scale byte\(s\) are 255"),
    # bitsandbytes NF4
    ("llama_nf4", _drop(f"{M}.weight.absmax"), rf"missing NF4 block absmax: {M}\.weight\.absmax not found"),
    ("llama_nf4", _drop(f"{M}.weight.quant_state.bitsandbytes__nf4"), rf"missing NF4 QuantState: {M}\.weight\.quant_state"),
    ("llama_nf4", _drop(f"{M}.weight.nested_absmax"), rf"says nested=True but {M}\.weight\.nested_absmax is absent"),
    ("llama_nf4", _set(f"{M}.weight.quant_map", _nan_first), rf"{M}\.weight\.quant_map: 1 NaN/inf"),
    ("llama_nf4", _set(f"{M}.weight.nested_absmax", lambda t: -t), rf"{M}\.weight\.nested_absmax: negative absmax"),
    ("llama_nf4", _set(f"{M}.weight.quant_map", lambda t: t.bfloat16()), rf"{M}\.weight\.quant_map has dtype BF16, expected F32"),
    ("llama_nf4", _set(f"{M}.weight.quant_state.bitsandbytes__nf4", lambda t: _bnb_json(t, blocksize=128)),
     rf"{M}\.weight\.absmax has shape \[512\], expected \[256\]"),
    ("llama_nf4", _set(f"{M}.weight.quant_state.bitsandbytes__nf4", lambda t: _bnb_json(t, blocksize=32)),
     rf"{M}\.weight\.quant_state\.bitsandbytes__nf4: blocksize 32 unsupported"),
    ("llama_nf4", _set(f"{M}.weight.quant_state.bitsandbytes__nf4", lambda t: _bnb_json(t, shape=[128, 256])),
     r"shape \[128, 256\], expected \[256, 128\]"),
    ("llama_nf4", _set(f"{M}.weight", lambda t: t[:100]), rf"{M}\.weight has shape \[100, 1\], expected \[16384, 1\]"),
    # tensors that disagree with the config
    ("llama_fp8", _set(f"{Q}.weight", lambda t: t.bfloat16()), rf"{Q}\.weight is BF16 \[128, 128\]: stored dense, but the config says"),
    ("llama_nf4", _set(f"{Q}.weight", lambda t: torch.zeros(128, 128, dtype=torch.bfloat16)), rf"{Q}\.weight is BF16 \[128, 128\]: stored dense"),
    ("llama_fp8", lambda sd: {**sd, "lm_head.weight_scale_inv": torch.ones(2, 1)}, r"lm_head\.weight_scale_inv .* does not quantize"),
]


@pytest.mark.parametrize("name,edit,message", BAD_TENSORS)
def test_bad_tensors_raise_naming_the_key(ckpt, tmp_path, name, edit, message):
    path = copy_ckpt(ckpt(name), tmp_path / "bad")
    P.rewrite_tensors(path, edit)
    with pytest.raises(PQ.PrequantizedCheckpointError, match=message) as err:
        load(path, quantization_config=SurogateConfig())
    assert "nothing was loaded" in str(err.value)


def test_zero_scale_over_a_block_of_zero_codes_loads(ckpt, tmp_path):
    # A zero block scale is how a quantizer stores an all-zero block: that is valid and decodes exactly.
    path = copy_ckpt(ckpt("llama_fp8"), tmp_path / "zero_block")

    def zero_second_block(sd):
        w, s = sd[f"{M}.weight"].clone(), sd[f"{M}.weight_scale_inv"].clone()
        w[128:] = 0
        s[1] = 0
        return {**sd, f"{M}.weight": w, f"{M}.weight_scale_inv": s}

    P.rewrite_tensors(path, zero_second_block)
    w = load(path, quantization_config=SurogateConfig()).get_submodule(M).dequantize(torch.float32)
    assert torch.all(w[128:] == 0) and torch.any(w[:128] != 0)


BAD_CONFIGS = [
    ("llama_nvfp4", lambda c: {**c, "quant_algo": "W4A8_AWQ"}, r"unknown ModelOpt quant_algo 'W4A8_AWQ'"),
    ("llama_nvfp4", lambda c: {**c, "group_size": 32}, r"NVFP4 group_size 32 unsupported"),
    ("llama_fp8", lambda c: {**c, "weight_block_size": [64, 64]}, rf"{Q}\.weight_scale_inv has shape \[1, 1\], expected \[2, 2\]"),
    ("llama_fp8", lambda c: {**c, "modules_to_not_convert": ["lm_head", Q]}, rf"{Q}\.weight is F8_E4M3 .* keeps {Q} unquantized"),
    (
        "llama_mixed",
        lambda c: {**c, "quantized_layers": {**c["quantized_layers"], Q: {"quant_algo": "FP8"}}},
        rf"{Q}\.weight has dtype U8, expected F8_E4M3",
    ),
    ("llama_nf4", lambda c: {**c, "llm_int8_skip_modules": ["lm_head", Q]}, rf"{Q}\.weight is U8 .* keeps {Q} unquantized"),
    ("llama_nf4", lambda c: {**c, "llm_int8_skip_modules": ["lm_head", Q]}, rf"{Q}\.weight\.absmax .* does not quantize"),
    ("llama_nf4", lambda c: {**c, "bnb_4bit_quant_type": "fp4"}, r"bnb_4bit_quant_type 'fp4' is not supported"),
    ("llama_nf4", lambda c: {**c, "load_in_8bit": True}, r"load_in_8bit \(LLM\.int8\) is not supported"),
    ("llama_mxfp4", lambda c: {**c, "modules_to_not_convert": ["lm_head", M]}, rf"{M}\.weight is U8 .* keeps {M} unquantized"),
]


@pytest.mark.parametrize("name,edit,message", BAD_CONFIGS)
def test_config_disagreeing_with_tensors_raises(ckpt, tmp_path, name, edit, message):
    path = copy_ckpt(ckpt(name), tmp_path / "bad")
    P.rewrite_quant_config(path, edit)
    with pytest.raises(PQ.PrequantizedCheckpointError, match=message):
        load(path, quantization_config=SurogateConfig())


def test_dimension_not_divisible_by_block(tmp_path):
    path = str(tmp_path / "odd")
    P.write_modelopt(path, "llama", "NVFP4", config_overrides={"intermediate_size": 200})
    with pytest.raises(PQ.PrequantizedCheckpointError, match=r"down_proj: in_features 200 is not divisible by the NVFP4 block \(16\)"):
        load(path)
