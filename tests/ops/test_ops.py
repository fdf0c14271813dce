"""Every surogate:: op passes torch.library.opcheck on CPU (schema, fake tensor, AOT dispatch)."""

import contextlib

import pytest
import torch

import surogate_hf.formats as F
import surogate_hf.ops as O
import surogate_hf.ops.ext as E
from surogate_hf.kernels.fp8_layout import RECIPE_128X128, RECIPE_1X128, mm_scales
from surogate_hf.ops.ext import register_decode_operands

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# test_schema compares inputs before/after with allclose, which torch does not implement for fp8 tensors;
# ops that take fp8 inputs run the other checks.
NO_SCHEMA = ALL[1:]
NO_NESTED = (None, None, None)  # the graph ops' NF4 nested operands, which they take without defaults


REGISTERED_CASE_OPERANDS = []  # the operands the ext_registered_* cases' codes stand for


@contextlib.contextmanager
def _registered_by_content():
    """The ext_registered_* cases' operands registered under their codes' contents instead of their address: opcheck
    calls an op on copies of its arguments, whose codes no layer registered (what the key is, the registered-route tests
    check: tests/integrations/test_registered_route.py)."""
    def by_content(w):
        return ("content", w.dtype, tuple(w.shape), w.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    original, E.decode_registry_key = E.decode_registry_key, by_content
    keys = [register_decode_operands(ops) for ops in REGISTERED_CASE_OPERANDS]
    try:
        yield
    finally:
        E.decode_registry_key = original
        for key in keys:
            E.REGISTERED_DECODE_OPERANDS.pop(key, None)


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g, dtype=torch.bfloat16)
    w = torch.randn(160, 256, generator=g, dtype=torch.bfloat16)
    wq, ws = F.quantize_fp8_blocks(w)
    nv = F.quantize_nvfp4(w)
    mp, ms = F.quantize_mxfp4(w)
    p4, st = F.quantize_nf4(w)
    absmax, code = F.nf4_absmax(st), F.nf4_code()
    assert st.nested  # (quantize_nf4 double-quantizes by default)
    nested = (st.state2.absmax.float(), st.state2.code.float(), torch.as_tensor(st.offset, dtype=torch.float32))
    dy = torch.randn(6, 160, generator=g, dtype=torch.bfloat16)
    # the decode + GEMM route's operands (ops.ext.DECODE_FORMATS order), one-byte codes and scales as uint8
    dec = {"nvfp4": (nv[0], nv[1].view(torch.uint8), nv[2], None, 0, 16), "mxfp4": (mp, ms, None, None, 1, 32),
           "nf4": (p4, absmax.float(), None, code.float(), 2, 64), "fp8": (wq.view(torch.uint8), ws, None, None, 3, 128)}

    def grad(t):
        return t.clone().requires_grad_(True)

    def registered(w, s, gs, lv, fmt, block, nested_ops=None):
        """codes whose other operands the registered-operands ops find (registered by _registered_by_content)."""
        REGISTERED_CASE_OPERANDS.append((w, s, gs, lv, fmt, 160, 256, block, nested_ops))
        return w

    reg = {f: registered(*dec[f]) for f in ("nvfp4", "mxfp4", "fp8")}
    reg["nf4"] = registered(p4, st.absmax, None, code.float(), 2, 64, nested)

    lora_a, lora_b = torch.randn(8, 256, generator=g) * 0.1, torch.randn(160, 8, generator=g) * 0.1
    return [
        ("quantize_fp8_tensorwise", O.quantize_fp8_tensorwise, (x, torch.tensor(3.0), F.E4M3), ALL),
        ("quantize_fp8_tensorwise_e5m2", O.quantize_fp8_tensorwise, (x, torch.tensor(3.0), F.E5M2), ALL),
        ("quantize_fp8_blocks", O.quantize_fp8_blocks, (w, 128, 128, False), ALL),
        ("quantize_fp8_tiles", O.quantize_fp8_tiles, (x, 128), ALL),
        ("dequantize_fp8_blocks", O.dequantize_fp8_blocks, (wq, ws, 128, 128, torch.bfloat16), NO_SCHEMA),
        ("quantize_nvfp4", O.quantize_nvfp4, (w, False, True, "mse", False, 0, None), ALL),
        ("quantize_nvfp4_2d_sr", O.quantize_nvfp4, (w, True, True, "mae", True, 5, None), ALL),
        ("dequantize_nvfp4", O.dequantize_nvfp4, (*nv, torch.float32), NO_SCHEMA),
        ("quantize_mxfp4", O.quantize_mxfp4, (w,), ALL),
        ("dequantize_mxfp4", O.dequantize_mxfp4, (mp, ms, torch.bfloat16), ALL),
        ("rht", O.rht, (x, F.random_signs(0)), ALL),
        ("nvfp4_amax", O.nvfp4_amax, (x, F.random_signs(0), 0), ALL),
        ("nvfp4_qdq", O.nvfp4_qdq, (x, torch.tensor(4.0), None, 1, True, "mse", True, 3), ALL),
        ("nvfp4_qdq_wgrad", O.nvfp4_qdq, (dy, torch.tensor(2.0), F.random_signs(1), 0, True, "mae", False, 0), ALL),
        ("nvfp4_qdq_tiles", O.nvfp4_qdq, (w, None, None, 2, True, "mse", False, 0), ALL),
        ("nvfp4_qdq_seed_tensor", O.nvfp4_qdq, (x, None, None, 1, True, "mse", True, 0, torch.tensor([7])), ALL),
        ("take_step", O.take_step, (torch.tensor(3),), ALL),
        ("fp8_block_linear", O.fp8_block_linear, (x, wq, ws, 128, 128), NO_SCHEMA),
        ("fp8_block_linear_dgrad", O.fp8_block_linear_dgrad, (dy, wq, ws, 128, 128), NO_SCHEMA),
        ("nvfp4_linear", O.nvfp4_linear, (x, *nv), NO_SCHEMA),
        ("nvfp4_linear_dgrad", O.nvfp4_linear_dgrad, (dy, *nv), NO_SCHEMA),
        ("mxfp4_linear", O.mxfp4_linear, (x, mp, ms), ALL),
        ("mxfp4_linear_dgrad", O.mxfp4_linear_dgrad, (dy, mp, ms), ALL),
        ("nf4_linear", O.nf4_linear, (x, p4, absmax, code, 64, 160, 256), ALL),
        ("nf4_linear_dgrad", O.nf4_linear_dgrad, (dy, p4, absmax, code, 64, 160, 256), ALL),
        ("delayed_scaling_update", O.delayed_scaling_update,
         (torch.rand(3, 16, generator=g), torch.ones(3), torch.tensor([2.0, float("nan"), 0.5]), F.E4M3, 1, True), ALL),
        ("quantize_fp8_tensorwise_t", O.quantize_fp8_tensorwise_t, (x, torch.tensor(3.0), F.E4M3), ALL),
        ("fp8_scaled_mm", O.fp8_scaled_mm, (F.cast_to_fp8(x), wq, torch.tensor(0.5), torch.tensor(2.0), None,
                                            torch.bfloat16), NO_SCHEMA),
        ("nvfp4_qdq_mm", O.nvfp4_qdq_mm, (x, w.t(), torch.tensor(0.5), torch.tensor(3.0), torch.randn(160),
                                          torch.bfloat16), NO_SCHEMA),
        ("fp8_tiles_wgrad", O.fp8_tiles_wgrad, (dy, x, 128, torch.float32), ALL),
        ("nvfp4_mm", O.nvfp4_mm, (*F.quantize_nvfp4(x.float()), *nv, None, torch.float32), NO_SCHEMA),
        # the native extension's ops (their CUDA kernels come from csrc/; here their references)
        ("ext_fp8_cast_amax", O.ext_fp8_cast_amax,
         (x, torch.tensor([3.0]), torch.empty(6, 256, dtype=F.E4M3), torch.zeros(1, dtype=torch.int32)), NO_SCHEMA),
        ("ext_fp8_cast_transpose_amax", O.ext_fp8_cast_transpose_amax,
         (x, torch.tensor([3.0]), torch.empty(6, 256, dtype=F.E5M2), torch.empty(256, 6, dtype=F.E5M2),
          torch.zeros(1, dtype=torch.int32)), NO_SCHEMA),
        ("ext_fp8_quantize_tiles", O.ext_fp8_quantize_tiles, (x, 16), NO_SCHEMA),
        ("ext_transpose_bytes", O.ext_transpose_bytes, (wq,), NO_SCHEMA),
        ("ext_nvfp4_amax", O.ext_nvfp4_amax, (x, None, 1), NO_SCHEMA),
        ("ext_nvfp4_qdq", O.ext_nvfp4_qdq, (dy, torch.tensor(2.0), F.random_signs(1), 0, True, 2, True, 9), NO_SCHEMA),
        ("ext_nvfp4_qdq_own_amax", O.ext_nvfp4_qdq, (w, None, None, 2, True, 0, False, 0), NO_SCHEMA),
        ("ext_nvfp4_qdq_seed_tensor", O.ext_nvfp4_qdq, (x, None, None, 1, True, 0, True, 0, torch.tensor([7])), NO_SCHEMA),
        ("ext_nvfp4_gemm", O.ext_nvfp4_gemm, (x, w.t(), torch.tensor(0.5), torch.tensor(3.0), torch.randn(160),
                                              torch.bfloat16), NO_SCHEMA),
        ("ext_few_token_gemm_nvfp4", O.ext_few_token_gemm, (x, nv[0], nv[1], nv[2], None, 0, 160, 256, 64), NO_SCHEMA),
        ("ext_few_token_gemm_mxfp4", O.ext_few_token_gemm, (x, mp, ms, None, None, 1, 160, 256, 64), ALL),
        ("ext_few_token_gemm_nf4", O.ext_few_token_gemm, (x, p4, absmax, None, code, 2, 160, 256, 64), ALL),
        ("ext_mixed_input_gemm_nvfp4", O.ext_mixed_input_gemm, (x, nv[0], nv[1], nv[2], None, 0, 160, 256, 16),
         NO_SCHEMA),
        ("ext_mixed_input_gemm_mxfp4", O.ext_mixed_input_gemm, (x, mp, ms, None, None, 1, 160, 256, 32), ALL),
        ("ext_mixed_input_gemm_nf4", O.ext_mixed_input_gemm, (x, p4, absmax, None, code, 2, 160, 256, 64), ALL),
        ("ext_mixed_input_gemm_nf4_nested", O.ext_mixed_input_gemm,
         (x, p4, st.absmax, None, code.float(), 2, 160, 256, 64, *nested), ALL),
        *[(f"ext_dequantize_{f}", O.ext_dequantize, (*d[:4], d[4], 160, 256, d[5], torch.bfloat16), ALL)
          for f, d in dec.items()],
        ("ext_decoded_linear_base", O.ext_decoded_linear,
         (grad(x), None, *dec["nf4"][:4], None, None, None, 1.0, 2, 160, 256, 64), ALL),
        ("ext_decoded_linear_lora", O.ext_decoded_linear,
         (grad(x.reshape(2, 3, 256)), None, *dec["nvfp4"][:4], torch.randn(160, dtype=torch.bfloat16), grad(lora_a),
          grad(lora_b), 2.0, 0, 160, 256, 16), ALL),
        ("ext_decoded_linear_lora_dropout", O.ext_decoded_linear,
         (grad(x), grad(x * 0.5), *dec["fp8"][:4], None, grad(lora_a.bfloat16()), grad(lora_b.bfloat16()), 0.5, 3,
          160, 256, 128), ALL),
        ("ext_decoded_linear_fwd_base", O.ext_decoded_linear_fwd,
         (grad(x), None, *dec["mxfp4"][:4], None, None, None, 1.0, 1, 160, 256, 32, *NO_NESTED), ALL),
        ("ext_decoded_linear_fwd_lora", O.ext_decoded_linear_fwd,
         (grad(x.reshape(2, 3, 256)), None, *dec["nf4"][:4], torch.randn(160, dtype=torch.bfloat16), grad(lora_a),
          grad(lora_b), 2.0, 2, 160, 256, 64, *NO_NESTED), ALL),
        ("ext_decoded_linear_fwd_lora_dropout", O.ext_decoded_linear_fwd,
         (grad(x), grad(x * 0.5), *dec["nvfp4"][:4], None, grad(lora_a.bfloat16()), grad(lora_b.bfloat16()), 0.5, 0,
          160, 256, 16, *NO_NESTED), ALL),
        ("ext_decoded_linear_bwd", O.ext_decoded_linear_bwd,
         (dy, x, x[:, :8].contiguous(), *dec["fp8"][:4], lora_a, lora_b, 2.0, 3, 160, 256, 128,
          False, True, False, True, True, *NO_NESTED), NO_SCHEMA),
        ("ext_decoded_linear_bwd_separate", O.ext_decoded_linear_bwd,
         (dy, x * 0.5, x[:, :8].contiguous(), *dec["nf4"][:4], lora_a, lora_b, 2.0, 2, 160, 256,
          64, True, True, True, False, True, *NO_NESTED), NO_SCHEMA),
        ("ext_decoded_linear_bwd_base", O.ext_decoded_linear_bwd,
         (dy, None, None, *dec["nvfp4"][:4], None, None, 1.0, 0, 160, 256, 16,
          False, True, False, False, False, *NO_NESTED), NO_SCHEMA),
        # a double-quantized NF4 absmax as stored (one-byte codes) with its nested operands
        ("ext_decoded_linear_nf4_nested", O.ext_decoded_linear,
         (grad(x), None, p4, st.absmax, None, code.float(), None, grad(lora_a), grad(lora_b), 2.0, 2, 160, 256, 64,
          *nested), ALL),
        ("ext_decoded_linear_fwd_nf4_nested", O.ext_decoded_linear_fwd,
         (grad(x), None, p4, st.absmax, None, code.float(), None, grad(lora_a), grad(lora_b), 2.0, 2, 160, 256, 64,
          *nested), ALL),
        ("ext_decoded_linear_bwd_nf4_nested", O.ext_decoded_linear_bwd,
         (dy, x, x[:, :8].contiguous(), p4, st.absmax, None, code.float(), lora_a, lora_b, 2.0, 2, 160, 256, 64,
          False, True, False, True, True, *nested), NO_SCHEMA),
        ("ext_registered_linear_fwd_base", O.ext_registered_linear_fwd,
         (grad(x), None, reg["mxfp4"], None, None, None, 1.0, 160, 256), ALL),
        ("ext_registered_linear_fwd_lora_nf4_nested", O.ext_registered_linear_fwd,
         (grad(x.reshape(2, 3, 256)), None, reg["nf4"], torch.randn(160, dtype=torch.bfloat16), grad(lora_a),
          grad(lora_b), 2.0, 160, 256), ALL),
        ("ext_registered_linear_fwd_lora_dropout", O.ext_registered_linear_fwd,
         (grad(x), grad(x * 0.5), reg["nvfp4"], None, grad(lora_a.bfloat16()), grad(lora_b.bfloat16()), 0.5, 160, 256),
         ALL),
        ("ext_registered_linear_bwd", O.ext_registered_linear_bwd,
         (dy, x, x[:, :8].contiguous(), reg["fp8"], lora_a, lora_b, 2.0, 160, 256, False, True, False, True, True),
         NO_SCHEMA),
        ("ext_registered_linear_bwd_separate", O.ext_registered_linear_bwd,
         (dy, x * 0.5, x[:, :8].contiguous(), reg["nf4"], lora_a, lora_b, 2.0, 160, 256, True, True, True, False, True),
         NO_SCHEMA),
        ("ext_rmsnorm_llama", O.ext_rmsnorm,
         (grad(x.reshape(2, 3, 256)), grad(torch.randn(256, generator=g).bfloat16()), 1e-6, False, torch.bfloat16), ALL),
        ("ext_rmsnorm_gemma_fp32_weight", O.ext_rmsnorm,
         (grad(x), grad(torch.randn(256, generator=g) * 0.1), 1e-6, True, torch.bfloat16), ALL),
        ("ext_rmsnorm_fp32_out_frozen_weight", O.ext_rmsnorm,
         (grad(x), torch.randn(256, generator=g), 1e-5, False, torch.float32), ALL),
        ("ext_fp8_scaled_mm", O.ext_fp8_scaled_mm, (F.cast_to_fp8(x), wq, torch.tensor(0.5), torch.tensor(2.0), None,
                                                  torch.bfloat16, True), NO_SCHEMA),
        ("ext_fp8_scaled_mm_bias", O.ext_fp8_scaled_mm,
         (F.cast_to_fp8(x), wq, torch.tensor(0.5), torch.tensor(2.0), torch.randn(wq.shape[0], generator=g).bfloat16(),
          torch.bfloat16, False), NO_SCHEMA),
        ("ext_fp8_linear", O.ext_fp8_linear,
         (x.reshape(2, 3, 256), torch.randn(160, 256, generator=g), None, wq, None, torch.tensor(0.5), None, None,
          torch.tensor(0.25), torch.tensor([4.0]), torch.zeros(1, dtype=torch.int32), torch.tensor([1.0]),
          torch.zeros(1, dtype=torch.int32), torch.tensor(1.0), True, True), NO_SCHEMA),
        ("ext_fp8_linear_handoff_bias", O.ext_fp8_linear,
         (x, torch.randn(160, 256, generator=g), torch.randn(160, generator=g).bfloat16(), wq, wq.t().contiguous(),
          torch.tensor(0.5), F.cast_to_fp8(x), F.cast_to_fp8(x).t().contiguous(), torch.tensor(0.25),
          torch.tensor([4.0]), torch.zeros(1, dtype=torch.int32), torch.tensor([1.0]), torch.zeros(1, dtype=torch.int32),
          torch.tensor(1.0), True, False), NO_SCHEMA),
        ("ext_fp8_block_gemm", O.ext_fp8_block_gemm, (x, wq[:128], mm_scales(ws[:1]), False, RECIPE_1X128, RECIPE_128X128),
         NO_SCHEMA),
        ("ext_fp8_block_gemm_dgrad", O.ext_fp8_block_gemm,
         (dy[:, :128], wq[:128], mm_scales(ws[:1].t().contiguous()), True, RECIPE_1X128, RECIPE_128X128), NO_SCHEMA),
    ]


def test_every_surogate_op_has_an_opcheck_case():
    """A new op without a case here fails: every schema in surogate_hf.ops is checked."""
    declared = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("surogate::")}
    covered = {(c[1]._qualname if hasattr(c[1], "_qualname") else c[1].name()).split("::", 1)[1] for c in _cases()}
    assert declared, "no surogate:: op is registered"
    assert declared <= covered, f"ops without an opcheck case: {sorted(declared - covered)}"


@pytest.mark.parametrize("name,op,args,checks", _cases(), ids=[c[0] for c in _cases()])
def test_opcheck(name, op, args, checks):
    with _registered_by_content() if name.startswith("ext_registered") else contextlib.nullcontext():
        torch.library.opcheck(op, args, test_utils=checks)


@pytest.mark.parametrize("name,op,args,checks", _cases(), ids=[c[0] for c in _cases()])
def test_op_outputs_are_tensors_of_their_own(name, op, args, checks):
    """No op returns a view: compiled graphs take a fallback op's outputs as buffers of their own, and inductor reused
    one (an nvfp4 decode global that was a view) for a compiled loss, on which the Trainer's in-place `loss *=`
    failed (ops._outputs.fresh_outputs)."""
    with _registered_by_content() if name.startswith("ext_registered") else contextlib.nullcontext():
        out = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    for i, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
        assert not (isinstance(o, torch.Tensor) and o._is_view()), f"{name}: output {i} is a view"


def test_linear_ops_match_dense_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g)
    w = torch.randn(64, 256, generator=g)
    nv = F.quantize_nvfp4(w)
    dense = F.dequantize_nvfp4(*nv, out_dtype=torch.float32)
    torch.testing.assert_close(O.nvfp4_linear(x, *nv), x @ dense.t())
    dy = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(O.nvfp4_linear_dgrad(dy, *nv), dy @ dense)
    # fp8 base quantizes the activation to 1x128 tiles: close to the weight-only product, not equal
    wq, ws = F.quantize_fp8_blocks(w)
    wd = F.dequantize_fp8_blocks(wq, ws, out_dtype=torch.float32)
    y = O.fp8_block_linear(x, wq, ws, 128, 128)
    ref = x @ wd.t()
    assert not torch.equal(y, ref)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (y - ref).pow(2).mean())
    assert sqnr > 28, sqnr  # E4M3 activation tiles: ~31 dB measured


def test_dynamo_constant_marker_is_what_the_official_decorator_sets():
    """kernels.registry marks its native-path check for dynamo by hand (the decorator would import dynamo and
    triton with surogate_hf); this fails when torch.compiler.assume_constant_result starts doing anything else."""
    from surogate_hf.kernels import registry

    def probe():
        return True

    before = dict(probe.__dict__)
    assert torch.compiler.assume_constant_result(probe) is probe
    assert {k: v for k, v in probe.__dict__.items() if k not in before} == {"_dynamo_marked_constant": True}
    assert registry._fp8_native_ok._dynamo_marked_constant is True


def test_an_ext_reference_on_cuda_tensors_says_the_extension_is_not_loaded(monkeypatch):
    """On CUDA tensors an ext op reaches its torch-ops reference only when the extension is not loaded (its CUDA kernel
    would take the call): that slow path is named once per op, never silent. CPU tensors run the reference quietly."""
    import warnings

    from surogate_hf.ops import _warn
    from surogate_hf.ops.ext import warns_on_cuda

    monkeypatch.setattr(_warn, "_seen", set())

    class OnCuda(torch.Tensor):  # a CPU tensor that reports CUDA: no GPU is needed to reach the check
        @property
        def is_cuda(self):
            return True

    @warns_on_cuda
    def _ext_probe(x):
        return x + 1

    x = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_ext_probe(x), x + 1)
    with pytest.warns(RuntimeWarning, match=r"surogate::ext_probe ran its reference kernel .* not loaded"):
        _ext_probe(x.as_subclass(OnCuda))
    with warnings.catch_warnings():  # once per op
        warnings.simplefilter("error")
        _ext_probe(x.as_subclass(OnCuda))
