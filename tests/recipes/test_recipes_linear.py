"""Each recipe's linear against a reference built from surogate_hf.formats (forward, dgrad, wgrad).

Tolerances: the recipe GEMMs scale the fp32 accumulator once where the references below dequantize
each operand first, so they agree to fp32 rounding: rtol 2e-6 (atol 1e-6 x output scale). Against
the unquantized fp32 GEMM the recipes are judged by SQNR floors: fp8 forward (E4M3 x E4M3) >= 25 dB,
fp8 gradients (E5M2 dy) >= 20 dB, nvfp4 forward >= 13 dB, nvfp4 gradients >= 12 dB. Measured on these
shapes (fwd / dgrad / wgrad): fp8 29.1 / 24.6 / 24.4 dB; nvfp4 17.7 / 15.5 / 16.3 dB with stochastic
rounding + RHT, 17.7 / 17.6 / 18.1 dB without (SR trades per-step error for unbiasedness).
"""

import warnings

import pytest
import torch
from torch import nn

from surogate_hf import formats as F
from surogate_hf.ops import recipe as recipe_ops
from surogate_hf.recipes import RecipeConfig, RecipeLinear, recipe_step
from surogate_hf.recipes.nvfp4 import sr_seed

M, K, N = 48, 64, 32


def sqnr(ref, x):
    return (10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean())).item()


def close(a, b, scale):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=1e-6 * scale)


def make(recipe, dtype=torch.float32, bias=True, **knobs):
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias, dtype=dtype)
    cfg = RecipeConfig.from_recipe_name(recipe, model_dtype="fp32" if dtype == torch.float32 else "bf16", **knobs)
    return RecipeLinear.from_linear(lin, cfg)


def run(mod, x, dy):
    x = x.clone().requires_grad_(True)
    y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad, mod.weight.grad, None if mod.bias is None else mod.bias.grad


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, M // 2, K, generator=g).to(dtype)
    dy = (torch.randn(2, M // 2, N, generator=g) * 1e-3).to(dtype)
    return x, dy


def test_fp8_hybrid_matches_reference():
    mod = make("fp8-hybrid", amax_history_len=4)
    x, dy = data()
    run(mod, x, dy)  # warm-up, then the step's update: the histories now hold this step's amaxes
    recipe_step(mod)
    mod.weight.grad = mod.bias.grad = None
    s = mod.fp8_scale()
    y, dx, dw, db = run(mod, x, dy)

    def deq(t, role, fmt):
        q, inv = F.quantize_fp8_tensorwise(t, fmt, scale=s[role])
        return q.float() * inv

    xd, wd, dyd = deq(x.reshape(M, K), 0, F.E4M3), deq(mod.weight.detach(), 1, F.E4M3), deq(dy.reshape(M, N), 2, F.E5M2)
    close(y.reshape(M, N), xd @ wd.t() + mod.bias.detach(), 10.0)
    close(dx.reshape(M, K), dyd @ wd, 1e-3)
    close(dw, dyd.t() @ xd, 1e-2)
    close(db, dy.reshape(M, N).sum(0), 1e-3)
    xf, wf, dyf = x.reshape(M, K), mod.weight.detach(), dy.reshape(M, N)
    assert sqnr(xf @ wf.t(), y.reshape(M, N) - mod.bias.detach()) > 25, "fp8 forward SQNR"
    assert sqnr(dyf @ wf, dx.reshape(M, K)) > 20, "fp8 dgrad SQNR"
    assert sqnr(dyf.t() @ xf, dw) > 20, "fp8 wgrad SQNR"
    # e4m3/e5m2 history rows were pushed by the second step too
    recipe_step(mod)
    assert (mod.fp8_history()[:, :2] > 0).all()


def test_fp8_matmul_with_float_backward():
    """bf16 recipe, matmul_dtype e4m3, gradient_dtype fp32: FP8 forward, float backward."""
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    mod = RecipeLinear.from_linear(lin, RecipeConfig(model_dtype="fp32", matmul_dtype="e4m3", gradient_dtype="fp32"))
    x, dy = data()
    y, dx, dw, _ = run(mod, x, dy)
    close(dx.reshape(M, K), dy.reshape(M, N) @ mod.weight.detach(), 1e-3)
    close(dw, dy.reshape(M, N).t() @ x.reshape(M, K), 1e-2)
    recipe_step(mod)
    assert mod.fp8_history()[2].abs().sum() == 0 and mod.fp8_history()[0, 0] > 0  # no gradient cast happened


@pytest.mark.parametrize("rht, sr, blocks", [(True, True, "1d"), (False, False, "1d"), (True, True, "2d")])
def test_nvfp4_matches_reference(rht, sr, blocks):
    mod = make("nvfp4", fp4_rht=rht, no_fp4_stochastic_rounding=not sr, seed=3, fp4_weight_blocks=blocks)
    x, dy = data()
    y, dx, dw, db = run(mod, x, dy)
    step = 0  # the first training forward
    fq = lambda t, **kw: F.fake_quantize_nvfp4(t.float(), out_dtype=torch.float32, **kw)  # noqa: E731
    w = mod.weight.detach()
    # the weight operand of each GEMM: 16x16 tiles for both, or 1x16 blocks along its reduction dim (K, then N)
    wd = fq(w, block_2d=True) if blocks == "2d" else fq(w)
    wd_dgrad = wd if blocks == "2d" else fq(w.t()).t()
    xd = fq(x.reshape(M, K))
    close(y.reshape(M, N), xd @ wd.t() + mod.bias.detach(), 10.0)
    dyd = fq(dy.reshape(M, N), stochastic=sr, seed=sr_seed(3, 0, step, 0) if sr else 0)
    close(dx.reshape(M, K), dyd @ wd_dgrad, 1e-3)
    a, b = dy.reshape(M, N).t(), x.reshape(M, K).t()
    if rht:
        signs = F.random_signs(3)
        a, b = F.rht(a, signs), F.rht(b, signs)
    dwd = fq(a, stochastic=sr, seed=sr_seed(3, 0, step, 1) if sr else 0) @ fq(b).t()
    close(dw, dwd, 1e-2)
    xf = x.reshape(M, K)
    assert sqnr(xf @ w.t(), y.reshape(M, N) - mod.bias.detach()) > 13
    assert sqnr(dy.reshape(M, N) @ w, dx.reshape(M, K)) > 12
    assert sqnr(dy.reshape(M, N).t() @ xf, dw) > 12
    assert mod.fp4_sr_step.item() == 1


@pytest.mark.parametrize("blocks, per_step", [("1d", 2), ("2d", 1)])
def test_nvfp4_weight_is_quantized_once_per_optimizer_step(blocks, per_step, monkeypatch):
    """Micro-batches reuse the quantized weight operands (1d: the forward's along K and the dgrad's along N; 2d: one
    tile copy); an optimizer step that changes the weight makes them anew."""
    from surogate_hf.recipes.nvfp4 import NVFP4Engine

    mod = make("nvfp4", bias=False, fp4_weight_blocks=blocks)
    calls = []
    orig = NVFP4Engine._quantize_weight
    monkeypatch.setattr(NVFP4Engine, "_quantize_weight",
                        lambda self, w, dgrad, native=False: calls.append(dgrad) or orig(self, w, dgrad, native))
    x, dy = data()
    for _ in range(2):  # two micro-batches of one step
        run(mod, x, dy)
    assert len(calls) == per_step
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    opt.step()
    recipe_step(mod)
    run(mod, x, dy)
    assert len(calls) == 2 * per_step
    assert sorted(calls) == sorted([False, True] * 2 if blocks == "1d" else [False] * 2)


@pytest.mark.parametrize("blocks", ["1d", "2d"])
def test_nvfp4_packed_operands_for_fp4_tensor_cores_match_the_bf16_path(blocks, monkeypatch):
    """On an SM100 GPU the engine keeps its operands packed for surogate::nvfp4_mm (FP4 tensor cores, a path no GPU of
    ours can run). Forced here on CPU, where nvfp4_mm is the reference: the same quantized values, so the same
    results as the bf16 qdq path up to fp32 summation order."""
    import surogate_hf.recipes.nvfp4 as NV

    runs = []
    for native in (False, True):
        monkeypatch.setattr(NV, "native_fp4", lambda device, native=native: native)
        mod = make("nvfp4", fp4_weight_blocks=blocks, seed=5)
        x, dy = data()
        runs.append(run(mod, x, dy))
        assert mod._nvfp4_w[0][1] is native  # (the cached weight operand says which path built it)
        if native:
            assert mod._nvfp4_w[1][0].dtype == torch.uint8  # packed E2M1 codes
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


def test_nvfp4_token_padding_and_sr_replay():
    mod = make("nvfp4", bias=False)
    x = torch.randn(5, K)  # 5 tokens: the wgrad reduction is padded to 16 with zeros
    dy = torch.randn(5, N) * 1e-2
    _, _, dw1, _ = run(mod, x, dy)
    mod.weight.grad = None
    _, _, dw2, _ = run(mod, x, dy)
    assert not torch.equal(dw1, dw2)  # step 1 draws other stochastic-rounding numbers
    mod2 = make("nvfp4", bias=False)
    mod2.load_state_dict({"weight": mod.weight.detach().clone(), "fp4_sr_step": torch.tensor(1)})
    _, _, dw3, _ = run(mod2, x, dy)
    assert torch.equal(dw2, dw3)  # the step counter (a buffer) replays the draw after a load
    mod3 = make("nvfp4", bias=False, no_fp4_stochastic_rounding=True)
    g1 = run(mod3, x, dy)[2].clone()
    mod3.weight.grad = None
    assert torch.equal(g1, run(mod3, x, dy)[2])  # round-to-nearest: no step dependence


def test_nvfp4_rejects_unaligned_features():
    with pytest.raises(ValueError, match="in_features"):
        RecipeLinear(24, 32, config=RecipeConfig(recipe="nvfp4", model_dtype="fp32"))


@pytest.mark.parametrize("matmul, grad", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")])
def test_bf16_recipe_gemm_dtypes(matmul, grad):
    torch.manual_seed(0)
    lin = nn.Linear(K, N, dtype=torch.bfloat16)
    mod = RecipeLinear.from_linear(lin, RecipeConfig(model_dtype="bf16", matmul_dtype=matmul, gradient_dtype=grad))
    x, dy = data(torch.bfloat16)
    y, dx, dw, db = run(mod, x, dy)
    w = mod.weight.detach()
    x2, dy2 = x.reshape(M, K), dy.reshape(M, N)
    if matmul == "bf16":
        torch.testing.assert_close(y, nn.functional.linear(x, w, mod.bias.detach()), rtol=0, atol=0)
    else:
        close(y.reshape(M, N), (x2.float() @ w.float().t() + mod.bias.float()).bfloat16(), 10.0)
    gd = {"bf16": torch.bfloat16, "fp32": torch.float32}[grad]
    ref_dx = (dy2.to(gd).float() @ w.to(gd).float())
    torch.testing.assert_close(dx.reshape(M, K).float(), ref_dx, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(dw.float(), (dy2.float().t() @ x2.float()), rtol=1e-2, atol=1e-4)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16


def test_master_fp32_work_weights_refresh_after_step():
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    mod = RecipeLinear.from_linear(lin, RecipeConfig(model_dtype="bf16", master_dtype="fp32"))
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    y = mod(x)
    assert y.dtype == torch.bfloat16 and mod.weight.dtype == torch.float32
    torch.testing.assert_close(y, nn.functional.linear(x, mod.weight.detach().bfloat16()), rtol=0, atol=0)
    work = mod._work
    y.float().sum().backward()
    assert mod.weight.grad.dtype == torch.float32
    mod(x)
    assert mod._work is work  # same step: cached
    opt.step()
    y2 = mod(x)
    assert mod._work is not work  # refreshed after the optimizer step
    torch.testing.assert_close(y2, nn.functional.linear(x, mod.weight.detach().bfloat16()), rtol=0, atol=0)


def test_ops_opcheck():
    a = torch.randn(16, 32).to(F.E4M3)
    b = torch.randn(8, 32).to(F.E5M2)
    s = torch.tensor(0.5)
    # test_schema compares the (float8) inputs with allclose, which CPU float8 lacks: run the others
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(recipe_ops.fp8_scaled_mm, (a, b, s, s, torch.randn(8), torch.bfloat16), test_utils=utils)
    torch.library.opcheck(recipe_ops.fp8_scaled_mm, (a, b, s, s, None, torch.float32), test_utils=utils)
    qa = F.quantize_nvfp4(torch.randn(16, 32))
    qb = F.quantize_nvfp4(torch.randn(16, 32), block_2d=True)
    torch.library.opcheck(recipe_ops.nvfp4_mm, (*qa, *qb, None, torch.float32), test_utils=utils)
    with pytest.raises(TypeError, match="operand a"):
        recipe_ops.fp8_scaled_mm(torch.randn(2, 4), b[:, :4], s, s, None, torch.float32)


def test_emulation_warns_once(recwarn):
    import surogate_hf.recipes.fp8_hybrid as fh

    fh._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        mod = make("nvfp4")
        mod(torch.randn(4, K))
        mod(torch.randn(4, K))
    msgs = [str(w.message) for w in rec if "emulation" in str(w.message)]
    assert len(msgs) == 1 and "NVFP4" in msgs[0] and "CPU" in msgs[0]


@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (True, False), (False, True)])
def test_fp8_saves_only_the_transposes_the_backward_uses(x_grad, w_grad):
    """The forward saves x^T [K, M] for wgrad and W^T [K, N] for dgrad (1 byte each, cast once) and
    nothing for a gradient that is not needed; the gradients equal those of the full backward."""
    x, dy = data()
    full, part = make("fp8-hybrid", amax_history_len=4), make("fp8-hybrid", amax_history_len=4)
    part.weight.requires_grad_(w_grad)
    for _ in range(2):  # the second step casts with real delayed scales
        ref = run(full, x, dy)
        full.weight.grad = full.bias.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            xg = x.clone().requires_grad_(x_grad)
            y = part(xg)
        y.backward(dy)
        fp8 = sorted(tuple(t.shape) for t in saved if t.dtype in (F.E4M3, F.E5M2))
        want = sorted([(K, M)] * w_grad + [(K, N)] * x_grad)
        assert fp8 == want
        assert not any(t.is_floating_point() and t.element_size() > 1 and t.numel() > 1 for t in saved)
        assert torch.equal(y.detach(), ref[0])
        if x_grad:
            assert torch.equal(xg.grad, ref[1])
        if w_grad:
            assert torch.equal(part.weight.grad, ref[2])
            part.weight.grad = None
        part.bias.grad = None
        recipe_step(full)
        recipe_step(part)
    assert torch.equal(part.fp8_history(), full.fp8_history())


def test_native_fp8_linear_takes_only_what_its_kernels_take():
    """recipes.fp8_hybrid.native_linear_ok: the C++ training linear (surogate::ext_fp8_linear) is chosen only for
    operands its casts and cuBLASLt's FP8 GEMMs take; everything else stays with Fp8LinearFn."""
    from surogate_hf.recipes.fp8_hybrid import native_linear_ok

    wq = torch.zeros(1536, 576, dtype=torch.float8_e4m3fn)
    wqt = wq.t().contiguous()
    s = [torch.ones(4)[0], torch.ones(4)[0], torch.ones(4)[0]]  # 16-byte aligned 0-dim views
    x = torch.randn(4, 32, 576, dtype=torch.bfloat16, requires_grad=True)
    assert native_linear_ok(x, wq, wqt, s)
    assert native_linear_ok(x.float(), wq, wqt, s)
    assert not native_linear_ok(x, wq, None, s), "a dgrad needs W^T's cast"
    assert native_linear_ok(x.detach(), wq, None, s), "no dgrad wanted"
    assert not native_linear_ok(x[:, :31], wq, wqt, s), "124 tokens: the wgrad's reduction is not a multiple of 16"
    assert not native_linear_ok(x.double(), wq, wqt, s)
    assert not native_linear_ok(x[..., :0], wq[:, :0], wqt[:0], s)
    assert not native_linear_ok(torch.randn(16, 584, dtype=torch.bfloat16), torch.zeros(1536, 584,
                                dtype=torch.float8_e4m3fn), None, s), "K not a multiple of 16"
    assert not native_linear_ok(x, wq, wqt, [torch.ones(4)[1], *s[1:]]), "a scale cuBLASLt cannot read"
