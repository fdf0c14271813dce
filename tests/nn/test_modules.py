"""Quantized modules on CPU: slots and layouts, forward/backward through the ops, dequantize, memory."""

import pytest
import torch
from torch import nn

from surogate_hf.testing.models import sqnr_db
from surogate_hf import formats as F
from surogate_hf.nn import LINEAR_CLASSES, QuantizedExperts, make_format
from surogate_hf.nn.formats import base as FB
from surogate_hf.nn import slots as S

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")
WEIGHT_ONLY = ("nvfp4", "mxfp4", "nf4")
# formats.md, weights only; the nf4 figure is bitsandbytes' measured ~0.516 at block 64 + double quant
BYTES_PER_PARAM = {"fp8": 1 + 4 / 16384, "nvfp4": 0.5625, "mxfp4": 0.53125, "nf4": 0.516}
# forward SQNR (dB) of one 256x512 layer on Gaussian weights and inputs vs the bf16 layer
LAYER_SQNR_FLOOR = {"fp8": 25.0, "nvfp4": 17.0, "mxfp4": 14.0, "nf4": 17.0}


def _dense(n=256, k=512, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        if bias:
            lin.bias.normal_(0, 0.02)
    return lin.to(torch.bfloat16)


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn,) else t


EXPECTED_SLOTS = {
    "fp8": {"weight": ((256, 512), torch.float8_e4m3fn), "weight_scale_inv": ((2, 4), torch.float32)},
    "nvfp4": {
        "weight": ((256, 256), torch.uint8),
        "weight_scale": ((256, 32), torch.float8_e4m3fn),
        "weight_scale_2": ((), torch.float32),
    },
    "mxfp4": {"weight": ((256, 256), torch.uint8), "weight_scale": ((256, 16), torch.uint8)},
    "nf4": {
        "weight": ((65536, 1), torch.uint8),
        "weight_absmax": ((2048,), torch.uint8),
        "weight_quant_map": ((16,), torch.float32),
        "weight_nested_absmax": ((8,), torch.float32),
        "weight_nested_quant_map": ((256,), torch.float32),
        "weight_offset": ((), torch.float32),
    },
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_meta_construction_registers_every_slot(fmt):
    m = LINEAR_CLASSES[fmt](512, 256, bias=True, dtype=torch.bfloat16)
    got = {n: (tuple(b.shape), b.dtype) for n, b in S.named_slots(m).items()}
    assert got == EXPECTED_SLOTS[fmt]
    assert not list(m.buffers())  # every slot is a Parameter: FSDP2 shards it, DDP does not broadcast it
    assert all(p.is_meta and not p.requires_grad for p in m.parameters()) and m.bias is not None
    assert isinstance(m, nn.Linear) and m.quant_format == fmt and m.prequantized is False


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_linear_layout_and_dequantize_match_the_reference(fmt):
    lin = _dense()
    m = LINEAR_CLASSES[fmt].from_linear(lin)
    w = lin.weight.detach()
    got = {n: (tuple(b.shape), b.dtype) for n, b in S.named_slots(m).items()}
    assert got == EXPECTED_SLOTS[fmt]
    # storage form: frozen, integer (FSDP2's MixedPrecisionPolicy casts only floating parameters), never 0-dim
    for n in EXPECTED_SLOTS[fmt]:
        p = m._parameters[n]
        assert isinstance(p, S.PackedParameter) and not p.requires_grad and not p.is_floating_point() and p.dim() >= 1, n
    # no dense weight anywhere: the only floating tensors of weight size would be a dense copy
    assert not any(t.numel() >= w.numel() and t.dtype in (torch.bfloat16, torch.float32) for t in m.state_dict().values())
    # the module's slots are the reference formats' output, bit for bit
    if fmt == "fp8":
        q, s = F.quantize_fp8_blocks(w, (128, 128))
        ref = {"weight": q, "weight_scale_inv": s}
        deq = F.dequantize_fp8_blocks(q, s, (128, 128), torch.bfloat16)
    elif fmt == "nvfp4":
        qt = F.quantize_nvfp4(w)
        ref = {"weight": qt.packed, "weight_scale": qt.block_scale, "weight_scale_2": qt.global_scale}
        deq = F.dequantize_nvfp4(*qt, out_dtype=torch.bfloat16)
    elif fmt == "mxfp4":
        p, s = F.quantize_mxfp4(w)
        ref = {"weight": p, "weight_scale": s}
        deq = F.dequantize_mxfp4(p, s, torch.bfloat16)
    else:
        p, qs = F.quantize_nf4(w, scale_search=True)  # the module default
        ref = {"weight": p, "weight_absmax": qs.absmax, "weight_nested_absmax": qs.state2.absmax}
        deq = F.dequantize_nf4(p, qs, torch.bfloat16)
    for name, t in ref.items():
        assert torch.equal(_bits(S.get_slot(m, name)), _bits(t)), name
    assert m.dequantize().dtype == torch.bfloat16 and m.dequantize().shape == (256, 512)
    assert torch.equal(m.dequantize(), deq)


def test_nvfp4_options_reach_the_quantizer():
    lin = _dense(n=64, k=128)
    for rule in ("mse", "mae", "abs_max"):
        for fos in (True, False):
            m = LINEAR_CLASSES["nvfp4"].from_linear(lin, four_over_six=fos, four_over_six_rule=rule)
            ref = F.quantize_nvfp4(lin.weight.detach(), four_over_six=fos, rule=rule)
            assert torch.equal(m.weight, ref.packed) and torch.equal(_bits(S.get_slot(m, "weight_scale")), _bits(ref.block_scale))


def test_fp8_variants_per_tensor_ue8m0_and_partial_blocks():
    lin = _dense(n=200, k=300)  # partial edge blocks in both dims
    m = LINEAR_CLASSES["fp8"].from_linear(lin, block_size=(128, 128), ue8m0=True)
    assert m.weight_scale_inv.shape == (2, 3)
    s = S.get_slot(m, "weight_scale_inv")
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    pt = LINEAR_CLASSES["fp8"].from_linear(lin, block_size=None)
    assert S.get_slot(pt, "weight_scale_inv").shape == () and pt.weight_scale_inv.shape == (1,) and pt.block_size is None
    for mod in (m, pt):
        assert sqnr_db(lin.weight, mod.dequantize()) > 28


@pytest.mark.parametrize("fmt", [*FORMATS, "fp8-w8a8"])
def test_forward_backward_through_the_ops(fmt, monkeypatch):
    if fmt == "fp8-w8a8":  # this small layer is weight-only by fp8's spec; at threshold 0 every fp8 layer is W8A8
        monkeypatch.setattr(F.fp8, "FP8_WEIGHT_ONLY_MAX_PARAMS", 0)
    w8a8 = fmt == "fp8-w8a8"
    fmt = fmt.removesuffix("-w8a8")
    lin = _dense()
    m = LINEAR_CLASSES[fmt].from_linear(lin)
    x = torch.randn(3, 5, 512, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 256)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    assert not any(p.requires_grad for p in m.parameters())
    assert sqnr_db(lin(x.detach()), y.detach()) > LAYER_SQNR_FLOOR[fmt]
    wd = m.dequantize()
    if not w8a8:
        # weight-only formats (and fp8 below formats.FP8_WEIGHT_ONLY_MAX_PARAMS elements): exactly a dense layer
        # holding the dequantized weight
        x2 = x.detach().clone().requires_grad_(True)
        y2 = nn.functional.linear(x2, wd) + m.bias  # the ops take no bias: added after, as forward does
        (y2 * dy).sum().backward()
        assert torch.equal(y.detach(), y2.detach())
        assert sqnr_db(x2.grad, x.grad) > 40
    else:
        # W8A8: the output gradient is quantized in 1x128 tiles (the dgrad op), then times the dequantized weight
        assert sqnr_db(dy @ wd, x.grad) > 25
        from surogate_hf import ops

        ref = ops.fp8_block_linear_dgrad(dy.contiguous(), *m._tensors().values(), 128, 128)
        assert torch.equal(ref, x.grad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_bytes_per_param_match_formats_md(fmt):
    m = LINEAR_CLASSES[fmt].from_linear(_dense(n=512, k=1024, bias=False))
    bpp = m.quantized_nbytes() / (512 * 1024)
    assert abs(bpp / BYTES_PER_PARAM[fmt] - 1) < 0.02, (fmt, bpp)


@pytest.mark.parametrize("fmt", ("fp8", "nvfp4", "nf4"))
def test_module_casts_keep_packed_dtypes(fmt):
    m = LINEAR_CLASSES[fmt].from_linear(_dense())
    before = {n: (b.dtype, b.clone()) for n, b in S.named_slots(m).items()}
    m.type(torch.float16)  # casts integer tensors too: the slots must still keep their storage
    m.half()
    m.to(torch.float32)
    for n, b in S.named_slots(m).items():
        assert b.dtype == before[n][0] and torch.equal(_bits(b), _bits(before[n][1])), n
    assert all(not m._parameters[n].is_floating_point() for n in before)
    assert m.bias.dtype == torch.float32


def test_shape_the_format_cannot_tile_is_an_error_naming_it():
    with pytest.raises(ValueError, match="in_features % 16"):
        LINEAR_CLASSES["nvfp4"](40, 64)
    with pytest.raises(ValueError, match="in_features % 32"):
        LINEAR_CLASSES["mxfp4"](48, 64)
    with pytest.raises(ValueError, match="in_features % 64"):
        LINEAR_CLASSES["nf4"](96, 64)  # bitsandbytes' CPU decode cannot read blocks straddling rows
    with pytest.raises(ValueError, match="unknown format"):
        make_format("int3")


def test_chunked_quantization_is_bit_identical(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(700, 384, dtype=torch.bfloat16)
    w[5, 7] = 3.0  # the tensor amax sits in one chunk only
    for name, opts in (("fp8", {}), ("fp8", {"block_size": None}), ("nvfp4", {}), ("mxfp4", {})):
        f = make_format(name, **opts)
        monkeypatch.setattr(FB, "QUANTIZE_CHUNK_ELEMENTS", 1 << 30)
        whole = f.quantize(w)
        monkeypatch.setattr(FB, "QUANTIZE_CHUNK_ELEMENTS", 1 << 14)
        assert len(FB._row_chunks(700, 384, 128 if name == "fp8" and opts == {} else 1)) > 1
        parts = f.quantize(w)
        for key in whole:
            assert torch.equal(_bits(whole[key]), _bits(parts[key])), (name, opts, key)


# ---------------------------------------------------------------------------- experts
def _qwen3_moe_experts(dtype=torch.bfloat16):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=192, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    ex = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.05)
        ex.down_proj.normal_(0, 0.05)
    return ex.to(dtype)


def _gpt_oss_experts(dtype=torch.bfloat16):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=128, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    ex = GptOssExperts(cfg)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    return ex.to(dtype)


def _meta_copy(module_factory):
    with torch.device("meta"):
        return module_factory()


def _routing(n_tok=24, n_exp=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(n_tok)])
    w = torch.rand(n_tok, k, generator=g).softmax(-1)
    return idx, w


def _quantize_experts(dense, fmt, factory):
    q = QuantizedExperts(_meta_copy(factory), make_format(fmt))
    for p in q.projections:
        q.load_dense_weight(p, getattr(dense, p).detach())
    for name, b in dense.named_parameters():
        if name.endswith("_bias"):
            q._parameters[name] = nn.Parameter(b.detach().clone(), requires_grad=False)
    return q


@pytest.mark.parametrize("kind", ("qwen3_moe", "gpt_oss"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_quantize_per_expert_and_forward_packed(kind, fmt):
    factory = _qwen3_moe_experts if kind == "qwen3_moe" else _gpt_oss_experts
    dense = factory()
    q = _quantize_experts(dense, fmt, factory)
    assert all(not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or t.numel() < dense.down_proj.numel() // 8
               for n, t in S.named_slots(q).items())
    # dequantize gives the dense parameter in the original layout; each expert is its own quantization unit
    fmtobj = make_format(fmt)
    for p in q.projections:
        dq = q.dequantize(p)
        assert dq.shape == getattr(dense, p).shape
        w1 = getattr(dense, p).detach()[1]
        w1 = w1.t() if q.is_transposed else w1
        if fmtobj.per_component and p == "gate_up_proj" and kind == "qwen3_moe":
            half = w1.shape[0] // 2
            ref = torch.cat([fmtobj.dequantize(fmtobj.quantize(w1[i * half:(i + 1) * half].contiguous()), half, w1.shape[1], torch.bfloat16) for i in (0, 1)])
        else:
            ref = fmtobj.dequantize(fmtobj.quantize(w1.contiguous()), *w1.shape, torch.bfloat16)
        assert torch.equal(dq[1], ref.t() if q.is_transposed else ref), p
    idx, rw = _routing()
    x = torch.randn(24, 128, dtype=torch.bfloat16, requires_grad=True)  # hidden 128
    y = q(x, idx, rw.to(torch.bfloat16))
    y.float().pow(2).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in q.parameters())
    ref_dense = q.to_dense()  # the original class holding the dequantized weights
    assert type(ref_dense) is type(dense)
    with torch.no_grad():
        y_ref = ref_dense(x.detach(), idx, rw.to(torch.bfloat16))
        y_bf16 = dense(x.detach(), idx, rw.to(torch.bfloat16))
    floor = {"fp8": 22.0, "nvfp4": 14.0, "mxfp4": 11.0, "nf4": 14.0}[fmt]
    assert sqnr_db(y_bf16, y.detach()) > floor
    if fmt in WEIGHT_ONLY:
        assert sqnr_db(y_ref, y.detach()) > 35  # same math as the dense module, up to matmul order


def test_gpt_oss_mxfp4_experts_are_the_checkpoint_layout():
    """Buffers equal GPT-OSS' `{P}_blocks` / `{P}_scales`: transformers' own decode reads them back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = _gpt_oss_experts()
    q = _quantize_experts(dense, "mxfp4", _gpt_oss_experts)
    assert q.gate_up_proj.shape == (4, 128, 128 // 32, 16) and q.gate_up_proj_scales.shape == (4, 128, 4)
    assert q.down_proj.shape == (4, 128, 64 // 32, 16)
    for p in ("gate_up_proj", "down_proj"):
        oracle = convert_moe_packed_tensors(getattr(q, p), getattr(q, p + "_scales"), dtype=torch.bfloat16)
        assert torch.equal(oracle, q.dequantize(p)), p


def test_experts_nvfp4_share_one_global_per_expert_and_split_fp8_per_component():
    dense = _qwen3_moe_experts()
    q = _quantize_experts(dense, "nvfp4", _qwen3_moe_experts)
    assert q.gate_up_proj_scale_2.shape == (4,)
    q8 = _quantize_experts(dense, "fp8", _qwen3_moe_experts)
    # 2 x 192 gate/up rows with 128-row blocks: blocks never straddle the gate/up boundary
    assert q8.gate_up_proj.shape == (4, 2, 192, 128) and q8.gate_up_proj_scale_inv.shape == (4, 2, 2, 1)
