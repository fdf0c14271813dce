"""The GEMM path decision (kernels.paths.plan_gemm), on CPU: every linear of the real models' shapes takes a
fast path on an SM90 GPU for every format and token count; the reference path only where no kernel exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from surogate_hf import formats as F
from surogate_hf.kernels import model_shapes as S
from surogate_hf.kernels import paths as P
from surogate_hf.kernels.fp8_layout import pad_columns, pad_weight

SM90 = (9, 0)
TOKENS = (1, 7, 64, 1000, 8192)


@pytest.mark.parametrize("fmt", P.FORMATS)
def test_every_shapes_table_linear_is_planned_fast_on_sm90(fmt):
    for model, proj, k, n in S.all_linears():
        for m in TOKENS:
            plan = P.plan_gemm(fmt, m, k, n, torch.bfloat16, SM90, blockwise_scaled_mm=True)
            assert plan.fast, f"{model} {proj} [{n}, {k}] {fmt} M={m}: {plan.path} ({plan.reason})"
            if fmt == "fp8" and F.fp8_linear_weight_only(n, k):
                assert plan.path == P.DENSE  # a small weight: decoded to bf16, cuBLAS
            elif fmt == "fp8":
                assert plan.path == P.FP8_BLOCK
                assert (k + plan.pad_k) % 128 == 0 and (n + plan.pad_n) % 128 == 0
                assert plan.pad_k < 128 and plan.pad_n < 128
            else:
                assert plan.path == (P.DENSE if m >= P.DENSE_MIN_TOKENS else P.FUSED)


def test_fp8_small_weights_take_the_dense_route_at_every_token_count():
    """The fp8 rule looks at the weight's size only (so a compiled graph's choice never depends on M): SmolLM2's and
    Qwen2.5-0.5B's and Qwen3-1.7B's projections decode to bf16, Llama-3.1-8B's 4096 x 4096 and up keep the W8A8 block
    GEMM (formats.FP8_WEIGHT_ONLY_MAX_PARAMS)."""
    plan = lambda m, k, n: P.plan_gemm("fp8", m, k, n, torch.bfloat16, SM90, blockwise_scaled_mm=True).path  # noqa: E731
    for m in TOKENS:
        for k, n in ((576, 576), (576, 192), (1536, 576), (896, 896), (896, 128), (2880, 512), (2048, 2048),
                     (896, 4864), (4096, 1024), (2048, 6144)):
            assert plan(m, k, n) == P.DENSE, (m, k, n)
        for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (5120, 5120)):
            assert plan(m, k, n) == P.FP8_BLOCK, (m, k, n)
    # the weight-only route takes more than the W8A8 one (fp16 / fp32 activations, SM89) and needs the Triton decode
    assert plan(8, 576, 576) == P.DENSE
    assert P.plan_gemm("fp8", 8, 576, 576, torch.float16, SM90).path == P.DENSE
    assert P.plan_gemm("fp8", 8, 576, 576, torch.bfloat16, (8, 9), blockwise_scaled_mm=False).path == P.DENSE
    assert "8.9" in P.plan_gemm("fp8", 8, 576, 576, torch.bfloat16, (8, 0)).reason
    assert "triton" in P.plan_gemm("fp8", 8, 576, 576, torch.bfloat16, SM90, triton=False).reason
    # the W8A8 ops ask for their own path: the block GEMM at any size
    assert P.plan_gemm("fp8", 8, 576, 576, torch.bfloat16, SM90, blockwise_scaled_mm=True,
                       fp8_weight_only=False).path == P.FP8_BLOCK


@pytest.mark.parametrize("fmt", P.FORMATS)
def test_gpt_oss_expert_units_are_planned_fast(fmt):
    hidden, _, _, inter = S.MODELS["GPT-OSS-20B"]
    # fused gate_up (one unit for nvfp4 / mxfp4, per component for fp8 / nf4) and down
    for k, n in ((hidden, 2 * inter), (hidden, inter), (inter, hidden)):
        for m in TOKENS:
            assert P.plan_gemm(fmt, m, k, n, torch.bfloat16, SM90, blockwise_scaled_mm=True).fast


def test_modules_ask_the_same_function():
    from surogate_hf.nn.linear import LINEAR_CLASSES

    for fmt, cls in LINEAR_CLASSES.items():
        layer = cls(576, 192, bias=False, dtype=torch.bfloat16)  # on meta: nothing allocated
        plan = layer.gemm_path(7, capability=SM90)
        assert plan == P.plan_gemm(fmt, 7, 576, 192, torch.bfloat16, SM90, **layer.fmt.path_options())
        assert plan.fast or fmt == "fp8" and not hasattr(torch.nn.functional, "scaled_mm")
        assert layer.gemm_path(7, capability=None).path == P.REFERENCE


def test_reference_only_where_no_kernel_exists():
    bf16 = torch.bfloat16
    # fp8: a weight from formats.FP8_WEIGHT_ONLY_MAX_PARAMS elements on (W8A8; a smaller one is weight-only)
    assert P.plan_gemm("nvfp4", 7, 576, 192, bf16, None).reason.startswith("no CUDA device")
    why = P.plan_gemm("fp8", 7, 4096, 4096, bf16, (8, 0), blockwise_scaled_mm=True).reason
    assert "9.0" in why and "8.0" in why
    assert "dtype" in P.plan_gemm("fp8", 7, 4096, 4096, torch.float16, SM90, blockwise_scaled_mm=True).reason
    assert "scaled_mm" in P.plan_gemm("fp8", 7, 4096, 4096, bf16, SM90, blockwise_scaled_mm=False).reason
    assert "64x64" in P.plan_gemm("fp8", 7, 4096, 4096, bf16, SM90, block_size=(64, 64), blockwise_scaled_mm=True).reason
    assert "per-tensor" in P.plan_gemm("fp8", 7, 4096, 4096, bf16, SM90, block_size=None).reason
    assert "triton" in P.plan_gemm("mxfp4", 7, 576, 192, bf16, SM90, triton=False).reason
    assert "float64" in P.plan_gemm("nf4", 7, 576, 192, torch.float64, SM90).reason
    assert "7.5" in P.plan_gemm("mxfp4", 7, 576, 192, bf16, (7, 5)).reason
    assert P.plan_gemm("mxfp4", 7, 576, 192, torch.float16, (7, 5)).fast


@pytest.mark.parametrize("fmt,k", [("nvfp4", 40), ("mxfp4", 48), ("nf4", 96)])
def test_a_weight_the_format_cannot_hold_is_an_error(fmt, k):
    with pytest.raises(ValueError, match=str(k)):
        P.plan_gemm(fmt, 7, k, 64, torch.bfloat16, SM90)


def test_fp8_padding_is_exact():
    """The fp8 fast path pads K and N to 128 with zero codes: the block-scaled product of the padded operands
    (1x128 activation tiles, 128x128 weight blocks of HF's ceil-div layout) equals the unpadded reference."""
    m, n, k = 5, 192, 576
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g))).to(torch.bfloat16)
    q, s = F.quantize_fp8_blocks(w, (128, 128))
    assert tuple(s.shape) == (2, 5)  # ceil-div: partial blocks

    def operands(xx, qq):
        xq, xs = F.quantize_fp8_tiles(xx, 128)
        xd = F.dequantize_fp8_tiles(xq, xs, 128, torch.float32)
        return xd, F.dequantize_fp8_blocks(qq, s, (128, 128), torch.float32)

    plan = P.plan_gemm("fp8", m, k, n, torch.bfloat16, SM90, blockwise_scaled_mm=True)
    xp, wp = operands(pad_columns(x, plan.pad_k), pad_weight(q, plan.pad_n, plan.pad_k))
    xr, wr = operands(x, q)
    assert xp.shape == (m, k + plan.pad_k) and wp.shape == (n + plan.pad_n, k + plan.pad_k)
    # the real entries decode bit for bit as without padding (same tile and block scales), the pads to 0
    assert torch.equal(xp[:, :k], xr) and torch.equal(wp[:n, :k], wr)
    assert not xp[:, k:].any() and not wp[n:].any() and not wp[:, k:].any()
    y = xp @ wp.t()  # differs from the unpadded product only by the order of the fp32 sums
    torch.testing.assert_close(y[:, :n], xr @ wr.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", P.FORMATS)
def test_gpt_oss_experts_module_plans_the_fast_path(fmt):
    from surogate_hf.testing.models import tiny_gpt_oss_config
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from surogate_hf.nn.experts import QuantizedExperts
    from surogate_hf.nn.linear import make_format

    hidden, _, _, inter = S.MODELS["GPT-OSS-20B"]
    with torch.device("meta"):
        template = GptOssExperts(tiny_gpt_oss_config(hidden_size=hidden, intermediate_size=inter))
    q = QuantizedExperts(template, make_format(fmt), dtype=torch.bfloat16)
    for m in TOKENS:
        planned = q.gemm_paths(m, capability=SM90)
        assert set(planned) == {"gate_up_proj", "down_proj"}
        for proj, plan in planned.items():
            _, rows, k = q.units(proj)
            assert plan == P.plan_gemm(fmt, m, k, rows, torch.bfloat16, SM90, **q.fmt.path_options())
            assert plan.fast or fmt == "fp8" and not hasattr(torch.nn.functional, "scaled_mm"), (proj, m, plan)


@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_few_token_split_covers_the_reduction_once(m):
    """Every shapes.md linear, forward (reduce over K) and dgrad (over N): the chunks tile the reduction
    exactly once, are whole K tiles, and the fp32 partials stay within a quarter of the weight's codes."""
    for k, n in S.unique_linears():
        for red, cols in ((k, n), (n, k)):
            split, chunk = P.splitk_plan(m, red, cols, 132)
            assert (split - 1) * chunk < red <= split * chunk, (m, red, cols, split, chunk)
            if split > 1:
                assert chunk % P.SPLITK_CHUNK_UNIT == 0
                assert split * m * cols * 4 <= red * cols / 2 / 4


def test_few_token_split_fills_the_gpu_where_the_weight_is_large():
    # Llama-3.1-8B q (4096 -> 4096) at 16 tokens: 64 column tiles alone would leave half of 132 SMs idle
    split, _ = P.splitk_plan(16, 4096, 4096, 132)
    assert split * 64 >= 3 * 132
    assert P.splitk_plan(65, 4096, 4096, 132) == (1, 4096)  # more tokens: the one-pass kernels
    assert P.splitk_plan(16, 256, 4096, 132) == (1, 256)  # one chunk of reduction: nothing to split


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_many_token_forwards_of_every_shapes_table_linear_can_take_the_mixed_input_kernel(fmt, monkeypatch):
    """Opted in (SUROGATE_HF_MIXED_INPUT=1), on a cc 9.0 GPU with the extension's sm_90a code, the decode route's bf16
    forward (>= 512 tokens) runs the mixed-input WGMMA kernel on every linear of the table (each K is a multiple of
    32, and of NF4's 64-element blocks); not where it cannot run, and not with SUROGATE_HF_MIXED_INPUT=0."""
    monkeypatch.setenv("SUROGATE_HF_MIXED_INPUT", "1")
    for _, _, k, n in S.all_linears():
        for m in (512, 777, 2048, 8192):
            assert P.mixed_input_kernel(fmt, m, n, k, torch.bfloat16, SM90, True), f"{fmt} [{n}, {k}] M={m}"
        assert not P.mixed_input_kernel(fmt, 511, n, k, torch.bfloat16, SM90, True)  # below the decode route's rows
        assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.float16, SM90, True)
        assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.bfloat16, (10, 0), True)  # WGMMA is SM90a's
        assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.bfloat16, SM90, False)  # built without sm_90a
        assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.bfloat16, None, True)
    assert not P.mixed_input_kernel(fmt, 2048, 4096, 48, torch.bfloat16, SM90, True)  # a lane's 32 codes
    if fmt == "nf4":  # a 32-column half of a stage lies in one absmax block: blocks of 2^j >= 32 dividing K
        assert P.mixed_input_kernel(fmt, 2048, 4096, 4096, torch.bfloat16, SM90, True, nf4_block=32)
        assert P.mixed_input_kernel(fmt, 2048, 4096, 4096, torch.bfloat16, SM90, True, nf4_block=4096)
        assert not P.mixed_input_kernel(fmt, 2048, 4096, 4096, torch.bfloat16, SM90, True, nf4_block=16)
        assert not P.mixed_input_kernel(fmt, 2048, 4096, 4096, torch.bfloat16, SM90, True, nf4_block=96)
        assert not P.mixed_input_kernel(fmt, 2048, 4096, 2880, torch.bfloat16, SM90, True, nf4_block=128)
    monkeypatch.setenv("SUROGATE_HF_MIXED_INPUT", "0")
    for _, _, k, n in S.all_linears():
        assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.bfloat16, SM90, True)
    monkeypatch.setenv("SUROGATE_HF_MIXED_INPUT", "yes")  # not silently the default: an error naming the variable
    with pytest.raises(ValueError, match="SUROGATE_HF_MIXED_INPUT='yes'"):
        P.mixed_input_kernel(fmt, 2048, 4096, 4096, torch.bfloat16, SM90, True)


def test_the_mixed_input_tiles_follow_the_measured_split_rule():
    """The many-token launch (mixed_input_tiles, mirrored from csrc/weight_only/mixed_input_gemm.h on a 132-SM GPU):
    256-token tiles where they fill more than half the SMs; else a K split of 4-8 ways, or 2 ways with >= 32 stages
    a CTA (2-way splits of 8-16 stages measured slower than 128-token tiles); else 128-token tiles."""
    header = (Path(__file__).resolve().parents[2] / "csrc" / "weight_only" / "mixed_input_gemm.h").read_text()
    assert (f"kMixedInputRows = {P.MIXED_INPUT_ROWS}, kMixedInputMaxSplit = {P.MIXED_INPUT_MAX_SPLIT};" in header)
    assert (f"kMixedInputMinSplitSteps = {P.MIXED_INPUT_MIN_SPLIT_STEPS}, "
            f"kMixedInputMinPairSteps = {P.MIXED_INPUT_MIN_PAIR_STEPS};" in header)
    shape = {(model, proj): (k, n) for model, proj, k, n in S.all_linears()}

    def tiles(model, proj, m):
        k, n = shape[(model, proj)]
        return P.mixed_input_tiles(m, n, k, 132)

    assert tiles("Llama-3.1-8B", "q", 2048) == (256, 1)  # 256 tiles
    assert tiles("Llama-3.1-8B", "q", 512) == (256, 2)  # 64 tiles, 32 stages a CTA
    assert tiles("Llama-3.1-8B", "kv", 512) == (256, 8)  # 16 tiles
    assert tiles("Llama-3.1-8B", "kv", 2048) == (256, 2)
    assert tiles("Qwen3-1.7B", "q", 512) == (256, 4)
    assert tiles("Qwen3-1.7B", "down", 1024) == (256, 2)  # 96 stages: 48 a CTA
    assert tiles("Qwen3-1.7B", "kv", 2048) == (128, 1)  # a 2-way split would leave 16 stages a CTA
    assert tiles("Qwen3-0.6B", "q", 512) == (128, 1)
    assert P.mixed_input_fill(2048, 4096, 4096, 132) == pytest.approx(256 / 264)
    assert P.mixed_input_fill(1024, 6144, 2048, 132) == pytest.approx(192 / 264)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_the_mixed_input_kernel_is_the_default_where_it_measured_faster(fmt, monkeypatch):
    """Unset, SUROGATE_HF_MIXED_INPUT leaves the kernel to NVFP4 / MXFP4 weights of >= 12 Mi elements at 512-2048
    tokens whose 256-token tiles fill the GPU enough (0.97 x fill x (1 + 220 / M) >= 1): every row where it measured
    faster than decode + cuBLAS (Llama-3.1-8B q / o / gate_up / down, Qwen3-1.7B gate_up / down at 512 and 2048
    tokens, the 8B q / down and 1.7B down at 1024), not the 1.7B gate_up at 1024 (0.93x, a fill of 0.73); also at a
    fill of >= 0.8 where each CTA runs >= 48 stages (Qwen2.5-7B q / down at 1024-2048 tokens, measured faster; not
    the 24-stage runs of Qwen2.5-1.5B's gate_up, measured slower); and weights of >= 4 Mi elements whose launch
    splits no K (session 33, each measured 1.05-1.20x decode + cuBLAS's speed: the 2048x2048 q / o projections of
    Qwen3-1.7B and Llama-3.2-1B and Gemma-2-2B's q at 2048 tokens, GPT-OSS-20B's q at 1024-2048, Gemma-3-1B's gate /
    up at 512, Qwen2.5-0.5B's at 768). The k/v projections (their tiles split K), smaller models, more tokens and NF4
    keep decode + cuBLAS. The C++ states the same constants (csrc/weight_only/decoded_linear.cpp:
    mixed_input_applies; mixed_input_gemm.h: mixed_input_fast_enough)."""
    source = (Path(__file__).resolve().parents[2] / "csrc" / "weight_only" / "decoded_linear.cpp").read_text()
    assert f"kMixedInputMinTokens = {P.MIXED_INPUT_MIN_TOKENS};" in source
    assert f"kMixedInputDefaultMaxTokens = {P.MIXED_INPUT_DEFAULT_MAX_TOKENS};" in source
    assert f"kMixedInputDefaultMinElements = {P.MIXED_INPUT_DEFAULT_MIN_ELEMENTS >> 20} << 20;" in source
    assert f"kMixedInputWholeKMinElements = {P.MIXED_INPUT_WHOLE_K_MIN_ELEMENTS >> 20} << 20;" in source
    header = (Path(__file__).resolve().parents[2] / "csrc" / "weight_only" / "mixed_input_gemm.h").read_text()
    assert f"kMixedInputSpeed = {P.MIXED_INPUT_SPEED};" in header
    assert f"kRouteDecodeTokens = {P.ROUTE_DECODE_TOKENS};" in header
    assert f"kMixedInputLongFill = {P.MIXED_INPUT_LONG_FILL};" in header
    assert f"kMixedInputLongSteps = {P.MIXED_INPUT_LONG_STEPS};" in header
    monkeypatch.delenv("SUROGATE_HF_MIXED_INPUT", raising=False)
    fp4 = fmt != "nf4"

    def default(model, proj, m):
        k, n = S.linears(model)[proj]
        return P.mixed_input_kernel(fmt, m, n, k, torch.bfloat16, SM90, True)

    for model, proj, tokens in [("Llama-3.1-8B", p, (512, 2048)) for p in ("q", "o", "gate_up", "down")] + [
            ("Llama-3.1-8B", "q", (1024,)), ("Llama-3.1-8B", "down", (1024,)), ("Qwen3-1.7B", "gate_up", (512, 2048)),
            ("Qwen3-1.7B", "down", (512, 1024, 2048))]:
        for m in tokens:
            assert default(model, proj, m) == fp4, f"{model} {proj} M={m}"
        assert not default(model, proj, 2049) and not default(model, proj, 511), f"{model} {proj}"
    assert not default("Qwen3-1.7B", "gate_up", 1024)  # 192 CTAs on 132 SMs
    # a fill of 0.85 with long runs (56 / 296 stages a CTA) measured faster; with short ones (24 stages) slower
    for proj in ("q", "down"):
        for m in (1024, 2048):
            assert default("Qwen2.5-7B", proj, m) == fp4, f"Qwen2.5-7B {proj} M={m}"
    assert not default("Qwen2.5-1.5B", "gate_up", 2048)
    for model, proj in (("Llama-3.1-8B", "kv"), ("Qwen3-1.7B", "kv"), ("SmolLM2-135M", "gate_up"),
                        ("Qwen3-0.6B", "down")):
        assert not default(model, proj, 2048), f"{model} {proj}"
    # 4-12 Mi elements where no K is split: measured faster (session 33)
    for model, proj, m in [("Qwen3-1.7B", "q", 2048), ("Qwen3-1.7B", "o", 2048), ("Llama-3.2-1B", "q", 2048),
                           ("Gemma-2-2B", "q", 2048), ("GPT-OSS-20B", "q", 1024), ("GPT-OSS-20B", "q", 2048),
                           ("Gemma-3-1B", "gate_up", 512), ("Qwen2.5-0.5B", "gate_up", 768)]:
        assert default(model, proj, m) == fp4, f"{model} {proj} M={m}"
    # the same 4 Mi q projection at fewer tokens, where it measured slower: K split over 4 CTAs at 512 tokens,
    # 128-token tiles at 1024
    assert P.mixed_input_tiles(512, 2048, 2048, 132) == (256, 4) and not default("Qwen3-1.7B", "q", 512)
    assert P.mixed_input_tiles(1024, 2048, 2048, 132) == (128, 1) and not default("Qwen3-1.7B", "q", 1024)
    assert P.mixed_input_tiles(2048, 1024, 4096, 132)[1] == 2 and not default("Llama-3.1-8B", "kv", 2048)
    k, n = S.linears("Llama-3.1-8B")["q"]
    assert not P.mixed_input_kernel(fmt, 2048, n, k, torch.bfloat16, (10, 0), True)  # WGMMA is SM90a's


def test_few_token_wgmma_takes_the_large_4bit_weights_from_33_tokens_and_the_wide_ones_from_17():
    """Inside the few-token op, the register-operand WGMMA kernel runs weights of >= 8M elements and >= 3072 rows at
    33-64 tokens, and those of >= 48M elements from 17, on an sm_90a build (where it was measured faster: Llama-3.1-8B
    q / gate_up / down, Qwen3-1.7B gate_up, Qwen2.5-7B q / down and its MLP; from 17 tokens the 8B's and Qwen2.5-7B's
    MLP); the mma kernel everything else. The C++ states the same constants (csrc/weight_only/mixed_input_gemm.h)."""
    header = (Path(__file__).resolve().parents[2] / "csrc" / "weight_only" / "mixed_input_gemm.h").read_text()
    assert f"kFewTokenWgmmaMinTokens = {P.FEW_TOKEN_WGMMA_MIN_TOKENS};" in header
    assert f"kFewTokenWgmmaMinElements = {P.FEW_TOKEN_WGMMA_MIN_ELEMENTS >> 20}ll << 20;" in header
    assert f"kFewTokenWgmmaMinRows = {P.FEW_TOKEN_WGMMA_MIN_ROWS};" in header
    assert f"kFewTokenWgmmaWideMinTokens = {P.FEW_TOKEN_WGMMA_WIDE_MIN_TOKENS};" in header
    assert f"kFewTokenWgmmaWideMinElements = {P.FEW_TOKEN_WGMMA_WIDE_MIN_ELEMENTS >> 20}ll << 20;" in header
    taken = {(model, proj) for model, proj, k, n in S.all_linears() if P.few_token_wgmma("nvfp4", 33, n, k, SM90, True)}
    for proj in ("q", "gate_up", "down"):
        assert ("Llama-3.1-8B", proj) in taken
    assert ("Llama-3.1-8B", "kv") not in taken and not any(model == "SmolLM2-135M" for model, _ in taken)
    wide = {(model, proj) for model, proj, k, n in S.all_linears() if P.few_token_wgmma("nvfp4", 17, n, k, SM90, True)}
    assert wide == {(model, proj) for model in ("Llama-3.1-8B", "Qwen2.5-7B") for proj in ("gate_up", "down")}
    for fmt in ("nvfp4", "mxfp4"):
        assert P.few_token_wgmma(fmt, 33, 4096, 4096, SM90, True)
        assert not P.few_token_wgmma(fmt, 32, 4096, 4096, SM90, True)  # 16M elements: not wide
        assert P.few_token_wgmma(fmt, 17, 14336, 4096, SM90, True)  # wide: 56M elements
        assert not P.few_token_wgmma(fmt, 16, 14336, 4096, SM90, True)
        assert P.few_token_wgmma(fmt, 64, 14336, 4096, SM90, True)
        assert not P.few_token_wgmma(fmt, 65, 4096, 4096, SM90, True)  # past the few-token op
        assert not P.few_token_wgmma(fmt, 64, 2048, 2048, SM90, True)  # 4M elements: the mma kernel was faster
        assert not P.few_token_wgmma(fmt, 64, 4096, 4096, (10, 0), True)  # WGMMA is SM90a's
        assert not P.few_token_wgmma(fmt, 64, 4096, 4096, SM90, False)
        assert not P.few_token_wgmma(fmt, 64, 4096, 4096, None, True)
    # every format: weights of >= 3072 rows (on Qwen3-1.7B's 2048-row down projection the mma kernel was faster at
    # 39-48 tokens; on Qwen2.5-7B's 3584-row q and down the WGMMA kernel, session 33)
    for proj in ("q", "o", "gate_up", "down"):
        assert ("Qwen2.5-7B", proj) in taken
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        assert P.few_token_wgmma(fmt, 33, 4096, 4096, SM90, True)
        assert P.few_token_wgmma(fmt, 64, 6144, 2048, SM90, True)
        assert P.few_token_wgmma(fmt, 17, 3584, 18944, SM90, True)
        assert not P.few_token_wgmma(fmt, 40, 3071, 18944, SM90, True)
        assert not P.few_token_wgmma(fmt, 33, 2048, 6144, SM90, True)
        assert not P.few_token_wgmma(fmt, 64, 2048, 6144, SM90, True)
    assert not P.few_token_wgmma("nf4", 32, 4096, 4096, SM90, True)
    assert not P.few_token_wgmma("fp8", 64, 4096, 4096, SM90, True)


@pytest.mark.parametrize("fmt", P.WEIGHT_ONLY)
def test_few_token_forwards_of_every_shapes_table_linear_take_the_cuda_kernel(fmt):
    """With the extension built, a bf16 forward of <= 64 tokens on SM90 runs csrc's few-token kernel on every linear
    of the table (each K is a multiple of 32); it is not planned where it cannot run."""
    hidden, _, _, inter = S.MODELS["GPT-OSS-20B"]
    units = [(k, n) for _, _, k, n in S.all_linears()] + [(hidden, 2 * inter), (inter, hidden)]
    for k, n in units:
        for m in (1, 7, 16, 17, 33, 64):
            assert P.few_token_kernel(fmt, m, k, torch.bfloat16, SM90, True), f"{fmt} [{n}, {k}] M={m}"
        assert not P.few_token_kernel(fmt, 65, k, torch.bfloat16, SM90, True)  # the Triton split kernel's regime
        assert not P.few_token_kernel(fmt, 16, k, torch.float16, SM90, True)
        assert not P.few_token_kernel(fmt, 16, k, torch.bfloat16, (8, 0), True)  # no thread-block clusters
        assert not P.few_token_kernel(fmt, 16, k, torch.bfloat16, SM90, False)
        assert not P.few_token_kernel(fmt, 16, k, torch.bfloat16, None, True)
    assert not P.few_token_kernel(fmt, 16, 48, torch.bfloat16, SM90, True)  # 16-byte loads of 32 codes per lane
    assert not P.few_token_kernel("fp8", 16, 4096, torch.bfloat16, SM90, True)
    assert P.few_token_kernel("nf4", 16, 4096, torch.bfloat16, SM90, True, nf4_block=128)
    assert not P.few_token_kernel("nf4", 16, 4096, torch.bfloat16, SM90, True, nf4_block=16)
    assert not P.few_token_kernel("nf4", 16, 4032, torch.bfloat16, SM90, True, nf4_block=96)
