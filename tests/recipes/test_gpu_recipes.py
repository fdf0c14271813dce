"""The recipes' GPU paths against their references: the FP8 casts into the flat state bit for bit, the Hopper
nvfp4 GEMM to fp32 summation order, the eager and compiled fp8 models against CPU and each other."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import surogate_hf.kernels as K
import surogate_hf.recipes as R
from surogate_hf import formats as F
from surogate_hf.recipes.fp8_hybrid import cast
from surogate_hf.recipes.scaling import Fp8ScalingState
from surogate_hf.testing.recipes import tiny_mlp

_ok, _why = K.triton_ok()
_fp8, _fp8_why = K.fp8_ok()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ok, reason=_why)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _lm_steps(m, opt, device, steps=4):
    """`steps` causal-LM training steps of m on fixed random token batches (2 x 64 of vocab 256, seeded by step);
    the losses."""
    losses = []
    for i in range(steps):
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(i)).to(device)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _u8(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", [(1, 576), (333, 192), (4096, 1536), (7, 2880)])
@pytest.mark.parametrize("fmt", [F.E4M3, F.E5M2])
@pytest.mark.parametrize("current", [False, True])
def test_cast_into_state_is_bit_exact(shape, fmt, current):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    states = []
    for dev in ("cpu", "cuda"):
        st = Fp8ScalingState(2, device=dev)
        st.scale.fill_(37.5)
        st.scale_inv.fill_(1 / 37.5)
        st.amax[3] = 0.5
        out = cast(x.to(dev), st.scale, st.scale_inv, st.amax, 3, fmt, True, True, current)
        states.append((out, st))
    (q0, qt0, s0), st0 = states[0]
    (q1, qt1, s1), st1 = states[1]
    assert torch.equal(_u8(q1), _u8(q0)) and torch.equal(_u8(qt1), _u8(qt0))
    assert s1.item() == s0.item()
    assert torch.equal(st1.amax.cpu(), st0.amax), "the running amax of row 3 (and nothing else)"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(48, 64, 32), (1000, 576, 1536), (4096, 2048, 6144)])
def test_nvfp4_mm_on_bf16_tensor_cores(m, k, n, out_dtype):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qa = F.quantize_nvfp4(a)
    qb = F.quantize_nvfp4(b, block_2d=True)
    args = (qa.packed, qa.block_scale, qa.global_scale, qb.packed, qb.block_scale, qb.global_scale)
    for bias in (torch.randn(n, generator=g).bfloat16(), None):
        ref = torch.ops.surogate.nvfp4_mm(*args, bias, out_dtype).float()
        out = torch.ops.surogate.nvfp4_mm(*[t.cuda() for t in args], None if bias is None else bias.cuda(),
                                          out_dtype).cpu().float()
        # operands are exact in bf16; only the fp32 summation order differs (plus one output rounding in bf16)
        tol = k * 2.0**-23 * (F.dequantize_nvfp4(qa.packed, qa.block_scale, qa.global_scale, torch.float32).abs()
                              @ F.dequantize_nvfp4(qb.packed, qb.block_scale, qb.global_scale, torch.float32).abs().t())
        if out_dtype == torch.bfloat16:
            tol = tol + ref.abs() * 2.0**-8
        assert ((out - ref).abs() <= tol + 1e-6).all(), (out_dtype, bias is None)


def _train(m, device, steps=3, compiled=False, dim=256):
    m = m.to(device)
    run = torch.compile(m, fullgraph=True) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=device == "cuda")
    losses = []
    for i in range(steps):
        x = torch.randn(4, 100, dim, generator=torch.Generator().manual_seed(i)).bfloat16().to(device)
        loss = run(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m


@pytest.mark.skipif(not _fp8, reason=_fp8_why)
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_recipe_on_gpu_matches_cpu(compiled):
    """bf16 model, fp32 masters, fused AdamW on the GPU; eager or compiled (inductor, fullgraph) against the
    CPU reference: the same loss curve within GEMM summation order, and the same recipe state."""
    torch._dynamo.reset()
    kw = dict(model_dtype="bf16", master_dtype="fp32", amax_history_len=4)
    lc, mc = _train(R.apply_recipe(tiny_mlp(dim=256).bfloat16(), "fp8-hybrid", **kw), "cpu")
    lg, mg = _train(R.apply_recipe(tiny_mlp(dim=256).bfloat16(), "fp8-hybrid", **kw), "cuda", compiled=compiled)
    assert lg == pytest.approx(lc, rel=2e-2)
    torch.testing.assert_close(mg.surogate_fp8_state.amax_history.cpu(), mc.surogate_fp8_state.amax_history,
                               rtol=2e-2, atol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_nvfp4_recipe_on_gpu_matches_cpu(compiled):
    """Eager, or compiled with inductor (fullgraph: the step counter advanced in the graph, the seeds hashed on the
    device and read by the kernels), against the CPU reference; the step counters agree."""
    torch._dynamo.reset()
    lc, mc = _train(R.apply_recipe(tiny_mlp(dim=256).bfloat16(), "nvfp4"), "cpu", steps=2)
    lg, mg = _train(R.apply_recipe(tiny_mlp(dim=256).bfloat16(), "nvfp4"), "cuda", steps=2, compiled=compiled)
    assert lg == pytest.approx(lc, rel=2e-2)
    steps = lambda m: [int(b) for n, b in m.named_buffers() if n.endswith("fp4_sr_step")]  # noqa: E731
    assert steps(mg) == steps(mc) == [2] * len(steps(mc))


@pytest.mark.parametrize("master", ["bf16", "fp32"])
@pytest.mark.parametrize("compiled", [False, True])
def test_nvfp4_precision_switch_on_gpu(compiled, master):
    """recipes.switch on CUDA (eager: the cached dgrad-only weight operands; compiled: re-traced after the flip):
    the switched forward is the bf16 GEMM, the FP4 backward the same as unswitched. One exception, compiled with fp32
    masters: inductor fuses the master's cast to bf16 into the weight's amax reduction differently in the two graphs
    and does not round in between (emulate_precision_casts off), so the weight's global scale, and with it the FP4
    dgrad, may differ there; that case is held to FP4 noise."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"proj": torch.nn.Linear(960, 576)})])})
    R.apply_recipe(model.cuda(), "nvfp4", model_dtype="bf16", master_dtype=master)
    layer = model["layers"][0]["proj"]
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 77, 960, generator=g).bfloat16().cuda()
    dy = torch.randn(3, 77, 576, generator=g).bfloat16().cuda()

    def step():
        with torch.no_grad():
            layer.fp4_sr_step.zero_()
        layer.weight.grad = None
        xg = x.clone().requires_grad_()
        y = fn(xg)
        y.backward(dy)
        return y.detach(), xg.grad, layer.weight.grad.clone()

    fp4 = step()
    R.switch_to_high_precision(model)
    y, dx, dw = step()
    w = layer.weight.detach().bfloat16()
    tol = dict(rtol=1.6e-2, atol=1e-2) if compiled else dict(rtol=0, atol=0)  # (inductor may add the bias apart)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, layer.bias.detach().bfloat16()), **tol)
    if compiled and master == "fp32":
        rel = (dx.float() - fp4[1].float()).norm() / fp4[1].float().norm()
        assert rel < 0.15, rel
        assert torch.equal(dw, fp4[2])  # the wgrad does not read the weight
    else:
        assert torch.equal(dx, fp4[1]) and torch.equal(dw, fp4[2])
    R.switch_to_high_precision(model, None)
    assert all(torch.equal(a, b) for a, b in zip(step(), fp4))


@pytest.mark.parametrize("rows, dim", [(1, 576), (333, 960), (4096, 2048), (77, 2880), (8192 * 16, 128), (50, 4096),
                                       (9, 10240), (5, 100)])
@pytest.mark.parametrize("formula", ["llama", "gemma"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out", ["x", "fp32"])
def test_ext_rmsnorm_matches_the_reference(rows, dim, formula, w_dtype, out):
    """The extension's RMSNorm (csrc/norm) forward, input and weight gradients against the stock formula through
    autograd (recipes.norm.rmsnorm_reference): within a bf16 ulp or two (row and column sum order); the same
    numbers on a second run (a fixed-order dw reduction); no dw work when the weight is frozen."""
    from surogate_hf.kernels import ext
    from surogate_hf.recipes.norm import rmsnorm_reference

    if ext.load(build=False) is None:
        pytest.skip(f"the CUDA extension is {ext.status()[1]}")
    out_dtype = torch.bfloat16 if out == "x" else torch.float32
    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=g) * 2).bfloat16().cuda()
    w = (torch.randn(dim, generator=g) * 0.2 + (0.0 if formula == "gemma" else 1.0)).to(w_dtype).cuda()
    dy = torch.randn(rows, dim, generator=g).to(out_dtype).cuda()

    def run(op, train_w=True):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_(train_w)
        y = op(xg, wg)
        y.backward(dy)
        return y.detach(), xg.grad, wg.grad

    ext_op = lambda a, b: torch.ops.surogate.ext_rmsnorm(a, b, 1e-6, formula == "gemma", out_dtype)  # noqa: E731
    y, dx, dw = run(ext_op)
    ry, rdx, rdw = run(lambda a, b: rmsnorm_reference(a, b, 1e-6, formula, out_dtype))
    assert y.dtype == out_dtype and dx.dtype == x.dtype and dw.dtype == w_dtype
    torch.testing.assert_close(y, ry, rtol=1.6e-2, atol=1e-5)
    # (the Triton kernels' tolerances, test_fused_rmsnorm_kernels_match_the_reference)
    torch.testing.assert_close(dx, rdx, rtol=1.6e-2, atol=1e-2 * rdx.abs().max().item())
    torch.testing.assert_close(dw, rdw, rtol=2e-2, atol=1e-2 * rdw.abs().max().item())
    again = run(ext_op)
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dw), again))
    frozen = run(ext_op, train_w=False)
    assert frozen[2] is None and torch.equal(frozen[1], dx)


def test_fused_rmsnorm_takes_the_extension_op():
    """Eager CUDA FusedRMSNorm without the FP8 hand-off runs surogate::ext_rmsnorm (its backward a C++ node), and
    trains like the stock module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from surogate_hf.kernels import ext
    from surogate_hf.recipes.norm import FusedRMSNorm

    if ext.load(build=False) is None:
        pytest.skip(f"the CUDA extension is {ext.status()[1]}")
    stock = LlamaRMSNorm(960, eps=1e-5).cuda().bfloat16()
    with torch.no_grad():
        stock.weight.normal_(1.0, 0.1)
    fused = FusedRMSNorm(copy.deepcopy(stock))
    x = torch.randn(4, 33, 960, device="cuda").bfloat16()
    ys = [m(x.clone().requires_grad_()) for m in (stock, fused)]
    assert "CppNode" in ys[1].grad_fn.name(), ys[1].grad_fn.name()
    torch.testing.assert_close(ys[1], ys[0], rtol=1.6e-2, atol=1e-5)
    for y in ys:
        y.float().square().sum().backward()
    torch.testing.assert_close(fused.weight.grad.float(), stock.weight.grad.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("rows, dim", [(1, 576), (333, 960), (4096, 2048), (77, 2880), (8192 * 16, 128), (50, 4096)])
@pytest.mark.parametrize("formula", ["llama", "gemma"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fused_rmsnorm_kernels_match_the_reference(rows, dim, formula, w_dtype):
    """Triton RMSNorm forward/backward against the stock formula (recipes.norm.rmsnorm_reference): within a bf16
    ulp or two (row-sum order, rsqrt); the FP8 hand-off is the exact cast of the y the kernel wrote, its transpose,
    and amax(|y|) folded into the state row."""
    from surogate_hf.kernels import triton_norm as TN
    from surogate_hf.recipes.norm import rmsnorm_reference

    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=g) * 2).bfloat16().cuda()
    w = (torch.randn(dim, generator=g) * 0.2 + (0.0 if formula == "gemma" else 1.0)).to(w_dtype).cuda()
    scale = torch.tensor([7.0], device="cuda")
    amax = torch.zeros(1, device="cuda")
    y, rstd, q, qt = TN.rmsnorm_fwd(x, w, 1e-6, formula == "gemma", torch.bfloat16,
                                    (scale, amax.view(torch.int32), F.E4M3, True))
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    ref = rmsnorm_reference(xr, wr, 1e-6, formula, torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-5)
    assert torch.equal(_u8(q), _u8(F.cast_to_fp8(y.float() * 7.0, F.E4M3)))
    assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    assert amax.item() == y.float().abs().max().item()
    dy = torch.randn(rows, dim, generator=g).bfloat16().cuda()
    ref.backward(dy)
    dx, dw = TN.rmsnorm_bwd(dy, x, w, rstd, formula == "gemma")
    torch.testing.assert_close(dx, xr.grad, rtol=1.6e-2, atol=1e-2 * xr.grad.abs().max().item())
    torch.testing.assert_close(dw.to(w_dtype), wr.grad, rtol=2e-2, atol=1e-2 * wr.grad.abs().max().item())


@pytest.mark.skipif(not _fp8, reason=_fp8_why)
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_recipe_with_fused_norms_on_gpu(compiled):
    """A Qwen3-shaped model (hidden 576, the real small-model width): FusedRMSNorm with the FP8 hand-off (eager
    Triton kernels) or compiled layers, against the same model on the GPU without the swap (the path
    test_fp8_recipe_on_gpu_matches_cpu checks against the CPU) and against the CPU reference."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch._dynamo.reset()

    def model(fused):
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64)
        return R.apply_recipe(Qwen3ForCausalLM(cfg).bfloat16(), "fp8-hybrid", master_dtype="fp32",
                              amax_history_len=4, fp8_fast_accum=False, fused_norms=fused)

    def train(m, device, compile_layers=False):
        m = m.to(device)
        if compile_layers:
            for layer in m.model.layers:
                layer.compile(fullgraph=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=device == "cuda")
        return _lm_steps(m, opt, device), m

    lc, _ = train(model(True), "cpu")
    lu, mu = train(model(False), "cuda")
    lg, mg = train(model(True), "cuda", compile_layers=compiled)
    assert lg == pytest.approx(lu, rel=1e-2), (lg, lu, lc)
    assert lg == pytest.approx(lc, rel=3e-2), (lg, lu, lc)
    attn = mg.model.layers[0].self_attn
    # eager links q/k/v to one x row; a graph compiled before any eager step keeps one row per linear
    assert (attn.k_proj.fp8_rows[0] == attn.q_proj.fp8_rows[0]) != compiled
    used = sorted({r for x in mg.modules() if isinstance(x, R.RecipeLinear) and x.engine is None for r in x.fp8_rows})
    # amaxes are maxima of activations and gradients that the two paths round differently (one bf16 ulp in the
    # norm, then FP8 flips and three AdamW steps at lr 1e-3): measured 14.5% apart at worst (c57da4a), so 20%
    torch.testing.assert_close(mg.surogate_fp8_state.amax_history[used], mu.surogate_fp8_state.amax_history[used],
                               rtol=0.2, atol=0)


@pytest.mark.skipif(not _fp8, reason=_fp8_why)
@pytest.mark.parametrize("master", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_native_fp8_linear_is_the_python_function_bit_for_bit(monkeypatch, master, checkpointing):
    """surogate::ext_fp8_linear (the eager training linear in C++, csrc/fp8/fp8_linear.cpp) against Fp8LinearFn, the
    Python Function it replaces: the same losses, weights, biases and amax histories bit for bit after four fused-AdamW
    steps of a Qwen2-shaped model (hidden 576, q/k/v biases, fused norms handing their casts over), with fp32 or bf16
    masters, with and without activation checkpointing. The native op must have run (from step 2: the first step
    scales by the current amax, which stays in Python)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from surogate_hf.kernels import ext
    from surogate_hf.recipes import fp8_hybrid

    if ext.load(build=True) is None:
        pytest.skip(ext.status()[1])
    calls = []
    op = torch.ops.surogate.ext_fp8_linear.default
    monkeypatch.setattr(fp8_hybrid, "_NATIVE_LINEAR", [lambda *a: calls.append(1) or op(*a)])

    def run(native):
        monkeypatch.setattr(fp8_hybrid, "NATIVE_LINEAR", native)
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3)
        m = R.apply_recipe(Qwen2ForCausalLM(cfg).bfloat16(), "fp8-hybrid", master_dtype=master,
                           amax_history_len=4).cuda()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        return _lm_steps(m, opt, "cuda"), m

    lp, mp = run(False)
    assert not calls
    ln, mn = run(True)
    assert calls, "the native linear never ran"
    assert ln == lp
    for (name, a), b in zip(mn.named_parameters(), mp.parameters()):
        assert torch.equal(_u8(a), _u8(b)), name
    assert torch.equal(mn.surogate_fp8_state.amax_history, mp.surogate_fp8_state.amax_history)


@pytest.mark.skipif(not _fp8, reason=_fp8_why)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("recipe, kw", [("bf16", {}), ("fp8-hybrid", {}), ("fp8-hybrid", {"fp8_scaling": "blockwise"}),
                                        ("nvfp4", {"no_fp4_stochastic_rounding": True})])
def test_qlora_base_gemms_follow_the_recipe_on_gpu(fmt, recipe, kw):
    """recipes.qlora on the GPU against the CPU reference: the same cell of the format x recipe table, first step
    (current scaling), within GEMM summation order (fp32 accumulation, fp8_fast_accum off)."""
    from torch import nn

    from surogate_hf.nn import linear as L

    outs = []
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        lin = nn.Linear(576, 1536, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.05)
        base = L.LINEAR_CLASSES[fmt].from_linear(lin.bfloat16()).to(dev)
        model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": base})])})
        knobs = kw if recipe == "nvfp4" else {**kw, "fp8_fast_accum": False}
        R.apply_recipe(model, recipe, model_dtype="bf16", **knobs)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(300, 576, generator=g).bfloat16().to(dev).requires_grad_()
        dy = torch.randn(300, 1536, generator=g).bfloat16().to(dev)
        y = base(x)
        y.backward(dy)
        outs.append((y.float().cpu(), x.grad.float().cpu()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2 * a.abs().max().item())
