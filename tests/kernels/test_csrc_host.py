"""The NVFP4 block math of the csrc kernels (csrc/fp4/nvfp4_math.cuh), built for the host with nvcc and checked bit
for bit against the reference (surogate::nvfp4_amax / nvfp4_qdq, formats.nvfp4.qdq_nvfp4) with no GPU; likewise the
dense decode's element math (csrc/weight_only/decode_math.cuh, harness tests/kernels/host/decode_host.cu) against the
formats' reference decode (ops.ext.decode_reference); and the mixed-input kernel's launch rules
(csrc/weight_only/mixed_input_gemm.h, harness tests/kernels/host/mixed_input_rules_host.cu) against their Python
mirror (kernels.paths).

The harness (tests/kernels/host/nvfp4_qdq_host.cu) walks the blocks the way the kernels do and calls the same
__host__ __device__ functions; the GPU tests check the kernels themselves (tests/kernels/test_gpu_kernels.py).
Skipped where no CUDA toolkit (nvcc) is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import surogate_hf.formats as F
import surogate_hf.ops  # noqa: F401  (declares surogate::nvfp4_qdq)

HARNESS = Path(__file__).parent / "host" / "nvfp4_qdq_host.cu"
RULES = {"mse": 0, "mae": 1, "abs_max": 2}


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(home) / "bin" / "nvcc"
    return str(cand) if cand.exists() else None


def _build_host(tmp_path_factory, source: Path, what: str) -> Path:
    """The harness `source` built for the host with nvcc (skipped without a CUDA toolkit)."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip(f"no CUDA toolkit (nvcc): the host build of the csrc {what} needs one")
    exe = tmp_path_factory.mktemp("csrc_host") / source.stem
    res = subprocess.run([nvcc, "-std=c++17", "-O2", "-o", str(exe), str(source)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return exe


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return _build_host(tmp_path_factory, HARNESS, "block math")


def _run(exe, x, axis, fos, rule, sr, seed, signs):
    r, c = x.shape
    hdr = np.array([r, c, axis, fos, RULES[rule], sr, seed, signs is not None], dtype=np.int64)
    sg = (signs if signs is not None else torch.ones(16)).float().numpy()
    data = hdr.tobytes() + sg.tobytes() + x.float().contiguous().numpy().tobytes()
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    vals = np.frombuffer(out, dtype=np.float32)
    rp = r if axis == 1 else -(-r // 16) * 16
    assert vals.size == 2 + rp * c
    return torch.from_numpy(vals[:1].copy())[0], torch.from_numpy(vals[1:2].copy())[0], \
        torch.from_numpy(vals[2:].copy()).reshape(rp, c)


def _data(r, c, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp(torch.randn(r, 1, generator=g) * 2)
    x[0, :16] = 0.0  # an all-zero block (scale 0)
    x[1 % r, 3] = 900.0  # an outlier: most blocks then take small and subnormal E4M3 scales
    x[-1, -5:] = 1e-30  # below every scale: codes round to zero
    return x.bfloat16().float()  # the kernels read bf16 operands exactly


CASES = [
    # (rows, cols, axis, four_over_six, rule, stochastic, rht)
    (5, 48, 1, True, "mse", False, False),
    (33, 64, 1, True, "mae", True, False),
    (8, 32, 1, True, "abs_max", False, True),
    (16, 96, 1, False, "mse", True, False),
    (37, 48, 0, True, "mse", True, True),
    (16, 32, 0, True, "mse", False, False),
    (50, 18, 0, True, "abs_max", False, True),
    (3, 64, 0, False, "mse", True, True),
    (21, 7, 0, True, "mae", True, True),
]


@pytest.mark.parametrize("r, c, axis, fos, rule, sr, rht", CASES)
def test_nvfp4_block_math_matches_reference(harness, r, c, axis, fos, rule, sr, rht):
    x = _data(r, c, seed=r * 131 + c)
    signs = F.random_signs(7) if rht else None
    seed = 1234567 if sr else 0
    amax_h, gdec_h, vals_h = _run(harness, x, axis, fos, rule, sr, seed, signs)
    amax = torch.ops.surogate.nvfp4_amax(x, signs, axis)
    vals, gdec = torch.ops.surogate.nvfp4_qdq(x, amax, signs, axis, fos, rule, sr, seed)
    assert amax_h.view(torch.int32) == amax.view(torch.int32)
    assert gdec_h.view(torch.int32) == gdec.view(torch.int32)
    ref = vals.float()
    mismatch = (ref.view(torch.int32) != vals_h.view(torch.int32)).sum().item()
    assert mismatch == 0, f"{mismatch} of {ref.numel()} values differ"


def test_nvfp4_block_math_propagates_nan(harness):
    x = _data(16, 32, seed=3)
    x[4, 7] = float("nan")
    amax_h, gdec_h, vals_h = _run(harness, x, 1, True, "mse", False, 0, None)
    assert torch.isnan(amax_h) and torch.isnan(gdec_h)
    vals, _ = torch.ops.surogate.nvfp4_qdq(x, torch.ops.surogate.nvfp4_amax(x, None, 1), None, 1, True, "mse", False, 0)
    assert torch.equal(torch.isnan(vals.float()), torch.isnan(vals_h))


def test_e2m1_rounding_matches_the_reference_at_every_threshold(harness):
    """Element rounding (nearest-even and stochastic) on the thresholds, their fp32 neighbours, the saturation and
    special values, against formats.e2m1's encoders decoded."""
    base = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30])
    up = torch.nextafter(base, torch.full_like(base, float("inf")))
    down = torch.nextafter(base, torch.zeros_like(base))
    mags = torch.cat((base, up, down, torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 7))
    y = torch.cat((mags, -mags, torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])))
    u = torch.rand(y.numel(), generator=torch.Generator().manual_seed(1))
    u[:40] = torch.tensor([0.0, 0.5, 0.99999994, 0.25] * 10)
    hdr = np.array([-1, y.numel(), 0, 0, 0, 0, 0, 0], dtype=np.int64)
    out = subprocess.run([str(harness)], input=hdr.tobytes() + np.zeros(16, np.float32).tobytes() + y.numpy().tobytes()
                         + u.numpy().tobytes(), capture_output=True, check=True).stdout
    got = torch.from_numpy(np.frombuffer(out, dtype=np.float32).copy()).reshape(2, -1)
    rne = F.e2m1_decode(F.e2m1_encode(y))
    sr = F.e2m1_decode(F.e2m1_encode_stochastic(y, u))
    assert torch.equal(got[0].view(torch.int32), rne.view(torch.int32))
    assert torch.equal(got[1].view(torch.int32), sr.view(torch.int32))


DECODE_HARNESS = Path(__file__).parent / "host" / "decode_host.cu"


@pytest.fixture(scope="module")
def decode_harness(tmp_path_factory):
    return _build_host(tmp_path_factory, DECODE_HARNESS, "decode math")


def _decode_operands(fmt, n, k):
    """(w, scales, gscale, levels, code, block) of a random [n, k] weight by the format's reference quantizer, with
    every scale byte value mixed in for the one-byte-scale formats (E8M0 0: the subnormal 2^-127; 255: NaN)."""
    from decode_operands import quantized_operands

    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 2)
    packed, s, gs, levels, code, block = quantized_operands(w, fmt)
    if fmt in ("nvfp4", "mxfp4"):
        s = s.clone()
        s.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: s.numel()]
        if fmt == "nvfp4":
            s[(s & 0x7F) == 0x7F] = 0x38  # (E4M3 NaN is no scale a quantizer writes)
    return packed, s, gs, levels, code, block


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "fp8"])
@pytest.mark.parametrize("n, k", [(192, 576), (130, 320), (257, 192)])
def test_decode_element_math_matches_reference(decode_harness, fmt, n, k):
    """Every element of the dense decode (partial FP8 blocks, ragged shapes, every E4M3 / E8M0 scale byte) equals
    ops.ext.decode_reference in fp32, bit for bit (NaN where the reference has NaN)."""
    from surogate_hf.ops.ext import decode_reference

    w, s, gs, lv, code, block = _decode_operands(fmt, n, k)
    wb, sb = w.contiguous().view(torch.uint8).numpy().tobytes(), s.contiguous().view(torch.uint8).numpy().tobytes()
    hdr = np.array([code, n, k, block, len(wb), len(sb)], dtype=np.int64)
    extra = np.float32(gs if gs is not None else 1.0).tobytes() + (
        lv.numpy() if lv is not None else np.zeros(16, np.float32)).astype(np.float32).tobytes() + np.int64(0).tobytes()
    out = subprocess.run([str(decode_harness)], input=hdr.tobytes() + wb + sb + extra, capture_output=True,
                         check=True).stdout
    got = torch.from_numpy(np.frombuffer(out, dtype=np.float32).copy()).reshape(n, k)
    ref = decode_reference(w, s, gs, lv, code, n, k, block, torch.float32)
    same = (got.view(torch.int32) == ref.view(torch.int32)) | (got.isnan() & ref.isnan())
    assert same.all(), f"{fmt} [{n}, {k}]: {int((~same).sum())} elements differ"


@pytest.mark.parametrize("n, k", [(192, 576), (257, 192)])
def test_decode_element_math_de_nests_the_nf4_absmax(decode_harness, n, k):
    """A double-quantized NF4 absmax handed over as stored (one-byte codes, the nested absmax of each 256 blocks, the
    nested code values, the offset), as a compiled graph's decode ops take it: every element equals the reference
    decode of the same operands (formats.nf4.nf4_denest_absmax), and the decode with the de-nested fp32 absmax."""
    from surogate_hf.ops.ext import DECODE_FORMATS, decode_reference

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).bfloat16()
    packed, st = F.quantize_nf4(w, 64, True)
    assert st.nested and n * k // 64 > 256  # more than one nested block
    nested = (st.state2.absmax.float(), st.state2.code.float(), torch.as_tensor(st.offset, dtype=torch.float32))
    levels, code = st.code.float(), DECODE_FORMATS.index("nf4")
    wb, sb = packed.contiguous().numpy().tobytes(), st.absmax.contiguous().numpy().tobytes()
    hdr = np.array([code, n, k, 64, len(wb), len(sb)], dtype=np.int64)
    extra = (np.float32(1.0).tobytes() + levels.numpy().astype(np.float32).tobytes()
             + np.int64(nested[0].numel()).tobytes() + nested[0].numpy().tobytes() + nested[1].numpy().tobytes()
             + np.float32(nested[2].item()).tobytes())
    out = subprocess.run([str(decode_harness)], input=hdr.tobytes() + wb + sb + extra, capture_output=True,
                         check=True).stdout
    got = torch.from_numpy(np.frombuffer(out, dtype=np.float32).copy()).reshape(n, k)
    ref = decode_reference(packed, st.absmax, None, levels, code, n, k, 64, torch.float32, nested)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    flat = decode_reference(packed, F.nf4_absmax(st).float(), None, levels, code, n, k, 64, torch.float32)
    assert torch.equal(ref.view(torch.int32), flat.view(torch.int32))


def test_the_python_mirror_of_the_mixed_input_rules_matches_the_header(tmp_path_factory):
    """kernels.paths.mixed_input_tiles / mixed_input_fill / mixed_input_fast_enough / few_token_wgmma state the rules
    of csrc/weight_only/mixed_input_gemm.h (the launch's tiles, its fill, the default's speed test, the few-token op's
    kernel); the header built
    for the host (tests/kernels/host/mixed_input_rules_host.cu) answers every shapes.md linear at 1-8192 tokens on
    GPUs of 78, 114 and 132 SMs, and the two agree exactly."""
    from surogate_hf.kernels import model_shapes as S
    from surogate_hf.kernels import paths as P

    exe = _build_host(tmp_path_factory, Path(__file__).parent / "host" / "mixed_input_rules_host.cu", "launch rules")
    cases = [(m, n, k, sms, fmt) for _, _, k, n in S.all_linears() for m in (1, 16, 17, 32, 33, 40, 64, 65, 512, 777, 1024, 2048, 8192)
             for sms in (78, 114, 132) for fmt in (0, 1, 2)]
    out = subprocess.run([str(exe)], input="".join(f"{m} {n} {k} {sms} {fmt}\n" for m, n, k, sms, fmt in cases),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    fmts = ("nvfp4", "mxfp4", "nf4")
    for (m, n, k, sms, fmt), line in zip(cases, out, strict=False):
        bm, split, fill, fast, few = line.split()
        assert (int(bm), int(split)) == P.mixed_input_tiles(m, n, k, sms), (m, n, k, sms)
        assert float(fill) == P.mixed_input_fill(m, n, k, sms), (m, n, k, sms)
        assert bool(int(fast)) == P.mixed_input_fast_enough(m, n, k, sms), (m, n, k, sms)
        assert bool(int(few)) == P.few_token_wgmma(fmts[fmt], m, n, k, (9, 0), True), (m, n, k, fmt)
    assert len(out) >= len(cases)

