"""The extension's decode + GEMM route (csrc/weight_only/): surogate::ext_dequantize bit for bit against the formats'
reference decode over the shapes table, surogate::ext_decoded_linear (forward and its C++ backward, with and without
a LoRA adapter) against the same math in torch, its two graph ops (ext_decoded_linear_fwd / _bwd, the route inside
torch.compile) against it bit for bit, and the modules that route through it, eager and compiled.
GPU only; skipped with the reason without CUDA, Triton or a CUDA toolkit to build the extension."""

from __future__ import annotations

import math
import os
import shutil
import warnings

import pytest
import torch

os.environ.setdefault("SUROGATE_HF_AUTOTUNE", "0")

import surogate_hf.kernels as K  # noqa: E402
from surogate_hf.kernels import model_shapes as _S  # noqa: E402
from surogate_hf.ops.ext import DECODE_FORMATS, decode_reference  # noqa: E402

_ok, _why = K.triton_ok()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ok, reason=_why)]
DEV = "cuda"
SHAPES_NK = _S.unique_linears() + [(2880, 5760)]


@pytest.fixture(scope="module", autouse=True)
def _extension():
    from surogate_hf.kernels import ext

    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("no CUDA toolkit (nvcc) to build csrc/")
    assert ext.load(build=True) is not None, ext.status()[1]


def _bits(t):
    t = t.detach().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _sqnr(out, ref) -> float:
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    err = (out - ref).norm()
    return float("inf") if err == 0 else 20 * math.log10(ref.norm() / err)


def _operands(fmt, n, k, seed=3):
    """(w, scales, gscale, levels, fmt code, block) of a random [n, k] weight quantized on the CPU by the format's
    reference quantizer (tails and all), as CPU tensors."""
    from decode_operands import quantized_operands

    return quantized_operands(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02, fmt)


def _cuda(*ts):
    return tuple(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in ts)


@pytest.mark.parametrize("nk", SHAPES_NK, ids=lambda nk: f"{nk[0]}to{nk[1]}")
@pytest.mark.parametrize("fmt", DECODE_FORMATS)
def test_dequantize_bits_over_the_shapes_table(fmt, nk):
    """ext_dequantize of every weight shape of the table (a row band of the big ones, keeping a ragged row count),
    in bf16, fp16 and fp32, bit for bit the formats' reference decode; also from a misaligned copy of the codes (the
    kernel's element-by-element path)."""
    k, n = nk
    rows = n if n * k <= 2**21 else max(128, 2**21 // k // 128 * 128) + n % 128
    w, s, g, lv, code, block = _operands(fmt, rows, k)
    wc, sc, gc, lvc = _cuda(w, s, g, lv)
    buf = torch.empty(w.numel() + 16, dtype=torch.uint8, device=DEV)
    w_misaligned = buf[1: 1 + w.numel()].view(w.shape)
    w_misaligned.copy_(wc.view(torch.uint8))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ref = decode_reference(w, s, g, lv, code, rows, k, block, dtype)
        out = torch.ops.surogate.ext_dequantize(wc, sc, gc, lvc, code, rows, k, block, dtype)
        assert torch.equal(_bits(out), _bits(ref)), f"{fmt} [{rows}, {k}] {dtype}"
        if dtype == torch.bfloat16:
            out = torch.ops.surogate.ext_dequantize(w_misaligned, sc, gc, lvc, code, rows, k, block, dtype)
            assert torch.equal(_bits(out), _bits(ref)), f"{fmt} [{rows}, {k}] misaligned codes"


def test_dequantize_special_values():
    """E2M1 -0, every E4M3 and E8M0 scale byte (E8M0 0: the fp32 subnormal 2^-127; 255: NaN), NVFP4's global, and
    every FP8 code byte under extreme block scales, into fp32 (the 16-byte-chunk kernel) and bf16 / fp16 (the unit
    kernel: E2M1 by byte permutes, E4M3 by the hardware's conversion, subnormal and overflowing products rounded
    once)."""
    n, k = 256, 64
    codes = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k // 2)
    nv_s = torch.arange(n * k // 16).remainder(256).to(torch.uint8)
    nv_s[(nv_s & 0x7F) == 0x7F] = 0x38  # E4M3 NaN bytes are not scales a quantizer writes
    g = torch.tensor(0.37)
    mx_s = torch.arange(n * k // 32).remainder(256).to(torch.uint8)
    for fmt, s, gs in (("nvfp4", nv_s, g), ("mxfp4", mx_s, None)):
        code = DECODE_FORMATS.index(fmt)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = decode_reference(codes, s, gs, None, code, n, k, 16 if fmt == "nvfp4" else 32, dtype)
            out = torch.ops.surogate.ext_dequantize(*_cuda(codes, s, gs), None, code, n, k,
                                                    16 if fmt == "nvfp4" else 32, dtype)
            same = (_bits(out) == _bits(ref)) | (out.cpu().isnan() & ref.isnan())
            assert same.all(), f"{fmt} {dtype}: {int((~same).sum())} elements differ"
    # FP8: every E4M3 byte (NaN codes aside: not what a cast writes), subnormal and huge block scales, rows of 9 units
    # (the unit kernel's row division by a non-power of two, a partial 128-column block), of 1 unit, and of 999
    # columns (not whole units: the 16-byte-chunk kernel)
    code = DECODE_FORMATS.index("fp8")
    for n, k in ((300, 72), (40, 8), (130, 999)):
        q = torch.arange(n * k, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k)
        q[(q & 0x7F) == 0x7F] = 0x38
        kb, nb = -(-k // 128), -(-n // 128)
        s_inv = torch.tensor([2.0 ** -130, 1e-3, 0.37, 3e30, -2.5, 1.0])[torch.arange(nb * kb) % 6].reshape(nb, kb)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = decode_reference(q, s_inv, None, None, code, n, k, 128, dtype)
            out = torch.ops.surogate.ext_dequantize(*_cuda(q, s_inv), None, None, code, n, k, 128, dtype)
            same = (_bits(out) == _bits(ref)) | (out.cpu().isnan() & ref.isnan())
            assert same.all(), f"fp8 [{n}, {k}] {dtype}: {int((~same).sum())} elements differ"


@pytest.mark.parametrize("fmt", DECODE_FORMATS)
@pytest.mark.parametrize("case", ["base", "bias", "lora", "lora_dropout_fp32_masters"])
@pytest.mark.parametrize("nk", [(576, 576), (576, 192), (1536, 576), (2048, 2048)], ids=lambda nk: f"{nk[0]}to{nk[1]}")
def test_decoded_linear_forward_and_backward(fmt, case, nk):
    """ext_decoded_linear against the same math in torch on the extension's decode: the forward bit for bit (the same
    aten calls), the gradients of x, x_lora, A and B within the summation order of cuBLAS (SQNR > 40 dB against fp32)."""
    k, n = nk
    m, r, scaling = 1000, 16, 2.0
    w, s, g, lv, code, block = _cuda(*_operands(fmt, n, k))
    wd = torch.ops.surogate.ext_dequantize(w, s, g, lv, code, n, k, block, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, m // 2, k, generator=gen).bfloat16().to(DEV).requires_grad_(True)
    dy = torch.randn(2, m // 2, n, generator=gen).bfloat16().to(DEV)
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16().to(DEV) if case == "bias" else None
    lora = case.startswith("lora")
    master = torch.float32 if "fp32" in case else torch.bfloat16
    a = (torch.randn(r, k, generator=gen) * 0.05).to(master).to(DEV).requires_grad_(True) if lora else None
    b = (torch.randn(n, r, generator=gen) * 0.05).to(master).to(DEV).requires_grad_(True) if lora else None
    xl = torch.nn.functional.dropout(x, 0.1) if "dropout" in case else None
    y = torch.ops.surogate.ext_decoded_linear(x, xl, w, s, g, lv, bias, a, b, scaling, code, n, k, block)
    assert y.shape == (2, m // 2, n) and y.dtype == torch.bfloat16 and y._base is None
    with torch.no_grad():
        x2 = x.reshape(-1, k)
        yr = x2 @ wd.t() if bias is None else torch.addmm(bias, x2, wd.t())
        if lora:  # the adapter's GEMM first, the base GEMM accumulating onto it
            h = (x2 if xl is None else xl.reshape(-1, k)) @ a.bfloat16().t()
            yr = torch.addmm(torch.zeros((), dtype=h.dtype, device=DEV), h, b.bfloat16().t(), beta=0, alpha=scaling)
            yr = torch.addmm(yr, x2, wd.t())
    assert torch.equal(y.reshape(-1, n), yr), f"{fmt} {case}: forward differs from its aten calls"
    grads = torch.autograd.grad(y, [t for t in (x, a, b) if t is not None], dy)
    # fp32 reference of the gradients (dropout's mask taken from xl = x * mask / 0.9)
    xf, dyf, wf = x.detach().float().reshape(-1, k), dy.float().reshape(-1, n), wd.float()
    dx_ref = dyf @ wf
    if lora:
        af, bf = a.detach().bfloat16().float(), b.detach().bfloat16().float()
        xlf = xf if xl is None else xl.detach().float().reshape(-1, k)
        dh = (dyf @ bf) * scaling
        dxl = dh @ af
        if xl is not None:
            dxl = dxl * (xl.detach().reshape(-1, k) != 0).float() / 0.9
        dx_ref = dx_ref + dxl
        da_ref, db_ref = dh.t() @ xlf, (dyf.t() @ (xlf @ af.t())) * scaling
        assert grads[1].dtype == master and grads[2].dtype == master
        assert _sqnr(grads[1], da_ref) > 40 and _sqnr(grads[2], db_ref) > 40, f"{fmt} {case}: adapter gradients"
    assert _sqnr(grads[0].reshape(-1, k), dx_ref) > 40, f"{fmt} {case}: input gradient SQNR {_sqnr(grads[0], dx_ref):.1f}"


def _two_layer_lora(fmt, down_bias):
    """A PEFT LoRA model (r=8, gaussian adapters, built on the CPU from seed 0) over two quantized projections of a small
    model's width: up 576 -> 1536, down 1536 -> 576."""
    from peft import LoraConfig, get_peft_model

    from surogate_hf.integrations.peft import install_peft_dispatch
    from surogate_hf.nn import linear as L

    install_peft_dispatch()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(576, 1536, bias=False, dtype=torch.bfloat16)
            self.down_proj = torch.nn.Linear(1536, 576, bias=down_bias, dtype=torch.bfloat16)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.up_proj(x)))

    torch.manual_seed(0)
    model = Two()
    for name in ("up_proj", "down_proj"):
        model.set_submodule(name, L.LINEAR_CLASSES[fmt].from_linear(model.get_submodule(name)))
    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["up_proj", "down_proj"],
                                            init_lora_weights="gaussian"))


@pytest.mark.parametrize("fmt", DECODE_FORMATS)
def test_lora_layers_route_through_the_extension(fmt):
    """A PEFT LoRA layer over a quantized base of a small model's width, on the decode route (1024 tokens; fp8 below its
    weight-only size): one surogate::ext_decoded_linear call per forward, no warning, and the loss and gradients of the
    layer's CPU twin (the unfused reference path)."""
    from surogate_hf.integrations.peft import set_lora_dtype

    def build(device):
        model = _two_layer_lora(fmt, down_bias=True)
        set_lora_dtype(model, torch.float32)
        return model.to(device)  # built on the CPU: both twins draw the same adapters

    x = torch.randn(2, 512, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    results = {}
    for device in ("cpu", DEV):
        model = build(device)
        calls = []
        if device == DEV:
            assert model.base_model.model.up_proj.get_base_layer().decoded_route(x.to(DEV).reshape(-1, 576)) is not None
        with warnings.catch_warnings(record=True) as seen, torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            warnings.simplefilter("always")
            loss = model(x.to(device).requires_grad_(True)).float().square().mean()
            loss.backward()
        calls = [e for e in prof.key_averages() if e.key == "surogate::ext_decoded_linear"]
        if device == DEV:
            assert calls and calls[0].count == 2, [e.key for e in prof.key_averages()][:40]
            assert not [str(w.message) for w in seen if "surogate" in str(w.message)]
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        results[device] = (loss.item(), grads)
    (l_cpu, g_cpu), (l_gpu, g_gpu) = results["cpu"], results[DEV]
    assert abs(l_cpu - l_gpu) <= 1e-2 * abs(l_cpu)
    for name in g_cpu:
        assert _sqnr(g_gpu[name], g_cpu[name]) > 30, f"{fmt} {name}: SQNR {_sqnr(g_gpu[name], g_cpu[name]):.1f} dB"


@pytest.mark.parametrize("reentrant", [False, True])
def test_decoded_linear_under_activation_checkpointing(reentrant):
    """The C++ autograd node inside a checkpointed region (its saved x and adapter intermediate go through the
    checkpoint's hooks, or the region is recomputed with grad) gives the gradients of the same call without
    checkpointing, bit for bit (the same kernels)."""
    from torch.utils.checkpoint import checkpoint

    n, k = 1536, 576
    w, s, g, lv, code, block = _cuda(*_operands("nvfp4", n, k))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1024, k, generator=gen).bfloat16().to(DEV)
    a0 = (torch.randn(16, k, generator=gen) * 0.05).to(DEV)
    b0 = (torch.randn(n, 16, generator=gen) * 0.05).to(DEV)

    def run(ckpt):
        xg, a, b = x.clone().requires_grad_(True), a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)

        def f(t):
            return torch.ops.surogate.ext_decoded_linear(t, None, w, s, g, lv, None, a, b, 2.0, code, n, k, block)

        y = checkpoint(f, xg, use_reentrant=reentrant) if ckpt else f(xg)
        y.float().square().mean().backward()
        return xg.grad, a.grad, b.grad

    for got, ref in zip(run(True), run(False)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("fmt", DECODE_FORMATS)
@pytest.mark.parametrize("case", ["base", "lora", "lora_dropout_fp32_masters"])
@pytest.mark.parametrize("route", ["explicit", "registered"])
def test_graph_ops_are_the_eager_ops_bits(fmt, case, route):
    """ext_decoded_linear_fwd / _bwd (the route inside compiled graphs) and their registered twins
    ext_registered_linear_fwd / _bwd (the codes alone, the other operands registered for them in the extension's
    registry) give ext_decoded_linear's output and its C++ node's gradients bit for bit: the same aten calls on the same
    decode. Released, registered codes are refused."""
    from surogate_hf.ops.ext import register_decode_operands, release_decode_operands

    n, k, m, r = 1536, 576, 1000, 16
    w, s, g, lv, code, block = _cuda(*_operands(fmt, n, k))
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
    dy = torch.randn(m, n, generator=gen).bfloat16().to(DEV)
    lora = case != "base"
    master = torch.float32 if "fp32" in case else torch.bfloat16
    a0 = (torch.randn(r, k, generator=gen) * 0.05).to(master).to(DEV) if lora else None
    b0 = (torch.randn(n, r, generator=gen) * 0.05).to(master).to(DEV) if lora else None
    mask = (torch.rand(m, k, generator=gen) > 0.1).to(DEV) if "dropout" in case else None

    def run(how):
        x = x0.clone().requires_grad_(True)
        a = a0.clone().requires_grad_(True) if lora else None
        b = b0.clone().requires_grad_(True) if lora else None
        xl = x * mask if mask is not None else None
        args = (x, xl, w, s, g, lv, None, a, b, 2.0, code, n, k, block)
        if how == "explicit":
            y = torch.ops.surogate.ext_decoded_linear_fwd(*args, None, None, None)[0]
        elif how == "registered":
            y = torch.ops.surogate.ext_registered_linear_fwd(x, xl, w, None, a, b, 2.0, n, k)[0]
        else:
            y = torch.ops.surogate.ext_decoded_linear(*args)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in (x, a, b) if t is not None]

    key = register_decode_operands((w, s, g, lv, code, n, k, block, None)) if route == "registered" else None
    try:
        for got, ref in zip(run(route), run("eager")):
            assert got.dtype == ref.dtype and torch.equal(got, ref), f"{fmt} {case} {route}"
    finally:
        if key is not None:
            release_decode_operands(key)
    if key is not None:
        with pytest.raises(RuntimeError, match="no decode operands are registered"):
            torch.ops.surogate.ext_registered_linear_fwd(x0, None, w, None, None, None, 1.0, n, k)


@pytest.mark.parametrize("n, k", [(1536, 576), (192, 576), (4864, 896)])
def test_decode_ops_de_nest_the_nf4_absmax_bit_for_bit(n, k):
    """The graph ops and the eager op given a double-quantized NF4 absmax as stored (one-byte codes plus the nested
    operands: what a compiled graph and the eager plan hand them) give the eager op's output and gradients on the
    de-nested fp32 absmax bit for bit, adapter and all."""
    import surogate_hf.formats as F

    m, r = 1000, 16
    gen = torch.Generator().manual_seed(8)
    w_dense = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    packed, st = F.quantize_nf4(w_dense, 64, True)
    assert st.nested
    code, levels = DECODE_FORMATS.index("nf4"), st.code.float().to(DEV)
    nested = tuple(t.to(DEV) for t in (st.state2.absmax.float(), st.state2.code.float(),
                                       torch.as_tensor(st.offset, dtype=torch.float32)))
    packed, codes, absmax = packed.to(DEV), st.absmax.to(DEV), F.nf4_absmax(st).float().to(DEV)
    x0 = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
    dy = torch.randn(m, n, generator=gen).bfloat16().to(DEV)
    a0 = (torch.randn(r, k, generator=gen) * 0.05).bfloat16().to(DEV)
    b0 = (torch.randn(n, r, generator=gen) * 0.05).bfloat16().to(DEV)

    def run(how):
        x, a, b = (t.clone().requires_grad_(True) for t in (x0, a0, b0))
        if how == "graph":
            y = torch.ops.surogate.ext_decoded_linear_fwd(x, None, packed, codes, None, levels, None, a, b, 2.0, code,
                                                          n, k, 64, *nested)[0]
        elif how == "eager_nested":  # the eager plan's route since the plan keeps the absmax as stored
            y = torch.ops.surogate.ext_decoded_linear(x, None, packed, codes, None, levels, None, a, b, 2.0, code, n,
                                                      k, 64, *nested)
        else:
            y = torch.ops.surogate.ext_decoded_linear(x, None, packed, absmax, None, levels, None, a, b, 2.0, code, n,
                                                      k, 64)
        y.backward(dy)
        return [y.detach(), x.grad, a.grad, b.grad]

    ref = run("fp32_absmax")
    for how in ("graph", "eager_nested"):
        for got, want in zip(run(how), ref):
            assert torch.equal(got, want), how


@pytest.mark.parametrize("registered", [True, False])
def test_compiled_lora_model_takes_the_graph_ops(registered):
    """A PEFT LoRA model over nf4 bases compiled with inductor (fullgraph) runs the graph ops (no traced decode): the
    registered ops (the codes alone; the model moved to the GPU registered its operands) or, with the registered route
    off, the ops taking every operand; and trains like the eager model on the C++ op: loss and gradients within bf16
    summation noise."""
    from surogate_hf.nn import linear as L

    name = "ext_registered_linear" if registered else "ext_decoded_linear"

    def build():
        model = _two_layer_lora("nf4", down_bias=False).to(DEV)
        L.set_registered_graph_route(model, registered)
        return model

    x = torch.randn(2, 512, 576, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    results = []
    for compiled in (False, True):
        model = build()
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True) if compiled else model
        if compiled:  # compile first (its tracing and autotuning call the ops too), then count one step's calls
            run(x.clone().requires_grad_(True)).float().square().mean().backward()
            model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = run(x.clone().requires_grad_(True)).float().square().mean()
            loss.backward()
        keys = {e.key: e.count for e in prof.key_averages()}
        if compiled:
            assert keys.get(f"surogate::{name}_fwd") == 2 and keys.get(f"surogate::{name}_bwd") == 2, keys
            assert "surogate::ext_decoded_linear" not in keys
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}))
    (l0, g0), (l1, g1) = results
    assert abs(l1 - l0) <= 1e-2 * abs(l0)
    for name in g0:
        assert _sqnr(g1[name], g0[name]) > 30, name
