"""Golden tests of the reference formats: every code point, ties, saturation, NaN, zero blocks, packing."""

import math

import pytest
import torch

import surogate_hf.formats as F


# ------------------------------------------------------------------ FP8 code points
def _fp8_value(byte: int, ebits: int, mbits: int, bias: int) -> float:
    sign = -1.0 if byte >> 7 else 1.0
    e = (byte >> mbits) & ((1 << ebits) - 1)
    m = byte & ((1 << mbits) - 1)
    if e == 0:
        return sign * (m / (1 << mbits)) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


@pytest.mark.parametrize("dtype,ebits,mbits,bias", [(F.E4M3, 4, 3, 7), (F.E5M2, 5, 2, 15)])
def test_fp8_every_code_point_decodes_and_reencodes(dtype, ebits, mbits, bias):
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(dtype).float()
    for b in range(256):
        v = vals[b].item()
        if dtype == F.E4M3 and (b & 0x7F) == 0x7F:
            assert math.isnan(v), b  # e4m3fn: only S.1111.111 is NaN, no infinities
            continue
        if dtype == F.E5M2 and ((b >> 2) & 0x1F) == 0x1F:
            assert math.isinf(v) if (b & 3) == 0 else math.isnan(v)
            continue
        assert v == _fp8_value(b, ebits, mbits, bias), b
        # a representable value casts back to its own code (-0 keeps its sign bit)
        assert F.cast_to_fp8(torch.tensor([v]), dtype).view(torch.uint8).item() == b, b


def test_fp8_max_values():
    assert F.FP8_MAX[F.E4M3] == 448.0 == torch.finfo(F.E4M3).max
    assert F.FP8_MAX[F.E5M2] == 57344.0 == torch.finfo(F.E5M2).max


@pytest.mark.parametrize("dtype", [F.E4M3, F.E5M2])
def test_fp8_saturates_and_keeps_nan(dtype):
    m = F.FP8_MAX[dtype]
    x = torch.tensor([m * 1.01, -m * 3, float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = F.cast_to_fp8(x, dtype).float()
    assert out[:4].tolist() == [m, -m, m, -m]
    assert math.isnan(out[4].item())
    assert out[5].item() == 0.0 and not math.copysign(1, out[5].item()) < 0
    assert math.copysign(1, out[6].item()) < 0


def test_fp8_round_half_to_even():
    # e4m3 around 1.0: spacing 1/8. 1+1/16 is a tie between 1.0 (even mantissa) and 1.125 (odd).
    x = torch.tensor([1.0625, 1.1875, 1.3125, 1.4375])
    assert F.cast_to_fp8(x, F.E4M3).float().tolist() == [1.0, 1.25, 1.25, 1.5]
    # e5m2 around 1.0: spacing 1/4
    x = torch.tensor([1.125, 1.375, 1.625, 1.875])
    assert F.cast_to_fp8(x, F.E5M2).float().tolist() == [1.0, 1.5, 1.5, 2.0]


def test_fp8_scale_from_amax_keeps_previous_on_bad_amax():
    prev = torch.tensor(3.0)
    for bad in (0.0, float("nan"), float("inf")):
        assert F.fp8_scale_from_amax(torch.tensor(bad), F.E4M3, previous=prev).item() == 3.0
    assert F.fp8_scale_from_amax(torch.tensor(0.0), F.E4M3).item() == 1.0
    assert F.fp8_scale_from_amax(torch.tensor(2.0), F.E4M3, margin=1).item() == 448.0 / 2 / 2


# ------------------------------------------------------------------ E2M1
def test_e2m1_every_code_point():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.e2m1_decode(codes)
    expect = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert vals.tolist() == expect
    assert torch.equal(F.e2m1_encode(vals), codes)  # -0.0 keeps the sign bit: code 8


def test_e2m1_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.25, -5.0, -7.0, 0.2501, 4.99])
    got = F.e2m1_decode(F.e2m1_encode(x)).tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0, -6.0, 0.5, 4.0]


def test_e2m1_nearest_matches_brute_force():
    x = torch.linspace(-7, 7, 20001)
    levels = F.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    got = F.e2m1_decode(F.e2m1_encode(x))
    dist = (got - x).abs()
    best = (levels[None, :] - x.clamp(-6, 6)[:, None]).abs().min(dim=1).values
    assert torch.all(dist <= best + (x.abs() - 6).clamp(min=0) + 1e-7)


def test_e2m1_packing_low_nibble_is_even_index():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(F.unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_e2m1_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    x = torch.full((200_000,), 2.4)
    u = F.uniform_like(x, seed=11)
    vals = F.e2m1_decode(F.e2m1_encode_stochastic(x, u))
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    assert abs(vals.mean().item() - 2.4) < 0.01  # p(up) = 0.4
    # exact levels are never moved; beyond 6 saturates
    y = torch.tensor([0.0, 0.5, 6.0, 9.0, -1.5])
    assert F.e2m1_decode(F.e2m1_encode_stochastic(y, F.uniform_like(y, 3))).tolist() == [0.0, 0.5, 6.0, 6.0, -1.5]


def test_counter_rng_is_deterministic_and_seed_dependent():
    x = torch.empty(4096)
    a, b, c = F.uniform_like(x, 1), F.uniform_like(x, 1), F.uniform_like(x, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.0 <= a.min().item() and a.max().item() < 1.0
    assert abs(a.mean().item() - 0.5) < 0.02


# ------------------------------------------------------------------ E8M0 / MXFP4
def test_e8m0_every_code_point():
    b = torch.arange(256, dtype=torch.uint8)
    v = F.e8m0_to_float(b)
    for i in range(255):
        assert v[i].item() == 2.0 ** (i - 127), i
    assert math.isnan(v[255].item())


def test_mxfp4_scale_selection_per_ocp_spec():
    # amax 6 -> floor(log2 6) - 2 = 0 -> byte 127; amax 1 -> -2 -> 125; amax 7 -> 0, 7 saturates to 6
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0] = 6.0, 1.0, 7.0
    x[3] = 0.0
    packed, scales = F.quantize_mxfp4(x)
    assert scales.tolist() == [[127], [125], [127], [0]]
    deq = F.dequantize_mxfp4(packed, scales, torch.float32)
    assert deq[0, 0].item() == 6.0 and deq[1, 0].item() == 1.0 and deq[2, 0].item() == 6.0
    assert torch.all(deq[3] == 0)


def test_mxfp4_nan_block_is_nan_only_in_its_block():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    packed, scales = F.quantize_mxfp4(x)
    assert scales[0, 0].item() == 255 and scales[0, 1].item() != 255
    deq = F.dequantize_mxfp4(packed, scales, torch.float32)
    assert torch.isnan(deq[0, :32]).all() and torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[1]).all()


def test_mxfp4_requantize_is_idempotent():
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16)[:, None]
    d1 = F.fake_quantize_mxfp4(x, torch.float32)
    assert torch.equal(F.fake_quantize_mxfp4(d1, torch.float32), d1)


def test_mxfp4_shape_error_names_the_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        F.quantize_mxfp4(torch.randn(4, 48))


# ------------------------------------------------------------------ NVFP4
def test_nvfp4_layout_and_global_scale():
    x = torch.randn(32, 64)
    qt = F.quantize_nvfp4(x, four_over_six=False)
    assert qt.packed.shape == (32, 32) and qt.packed.dtype == torch.uint8
    assert qt.block_scale.shape == (32, 4) and qt.block_scale.dtype == F.E4M3
    assert qt.global_scale.item() == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-6)
    qt46 = F.quantize_nvfp4(x, four_over_six=True)  # the same global scale: 4/6 never narrows the E4M3 range
    assert qt46.global_scale.item() == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-6)


def test_nvfp4_four_over_six_never_worse_per_block():
    """4/6 keeps, per block, the lower-error candidate under one global scale, so no block's error exceeds the
    plain encode's, including the blocks near the tensor amax whose m = 4 scale clamps at 448; outlier rows (a
    wide amax range) are where a lowered global scale used to cost range."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-4, 0, 64)[:, None]
    x[0, 0] = 400.0
    err = {}
    for fos in (False, True):
        deq = F.dequantize_nvfp4(*F.quantize_nvfp4(x, four_over_six=fos), out_dtype=torch.float32)
        err[fos] = ((deq - x) ** 2).reshape(64, 16, 16).sum(-1)
    assert torch.all(err[True] <= err[False])
    assert err[True].sum() < err[False].sum()


def test_nvfp4_exact_values_round_trip():
    # every E2M1 level in one block: all codes land exactly; the decode is then exact up to the one
    # rounding of the fp32 global decode scale (amax / 2688 is not a power of two)
    vals = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6.0])
    x = vals.repeat(2, 1)
    qt = F.quantize_nvfp4(x, four_over_six=False)
    assert torch.equal(F.e2m1_decode(F.unpack_e2m1(qt.packed)), x)
    torch.testing.assert_close(F.dequantize_nvfp4(*qt, out_dtype=torch.float32), x, rtol=2**-23, atol=0)


def test_nvfp4_zero_blocks_and_zero_tensor():
    x = torch.randn(4, 32)
    x[1, :16] = 0
    qt = F.quantize_nvfp4(x)
    assert qt.block_scale[1, 0].float().item() == 0.0
    deq = F.dequantize_nvfp4(*qt, out_dtype=torch.float32)
    assert torch.all(deq[1, :16] == 0) and torch.isfinite(deq).all()
    z = F.quantize_nvfp4(torch.zeros(2, 16))
    assert z.global_scale.item() == 1.0 and torch.all(F.dequantize_nvfp4(*z, out_dtype=torch.float32) == 0)


def test_nvfp4_nan_poisons_the_tensor():
    x = torch.randn(2, 32)
    x[0, 0] = float("nan")
    deq = F.fake_quantize_nvfp4(x, torch.float32)
    assert torch.isnan(deq).all()


def test_nvfp4_2d_blocks_share_one_scale_per_tile_and_transpose_alike():
    x = torch.randn(32, 48)
    qt = F.quantize_nvfp4(x, block_2d=True)
    s = qt.block_scale.float().reshape(2, 16, 3)
    assert torch.equal(s, s[:, :1, :].expand_as(s))
    # W and W^T quantize identically with 2D blocks (given the same 4/6 decisions and global)
    a = F.fake_quantize_nvfp4(x, torch.float32, block_2d=True)
    b = F.fake_quantize_nvfp4(x.t().contiguous(), torch.float32, block_2d=True)
    assert torch.equal(a, b.t())


def test_nvfp4_shape_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        F.quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="16x16"):
        F.quantize_nvfp4(torch.randn(24, 32), block_2d=True)
    with pytest.raises(ValueError, match="rule"):
        F.quantize_nvfp4(torch.randn(4, 32), rule="l3")


def test_nvfp4_stochastic_rounding_seeded_and_unbiased():
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    a = F.quantize_nvfp4(x, stochastic=True, seed=7)
    b = F.quantize_nvfp4(x, stochastic=True, seed=7)
    c = F.quantize_nvfp4(x, stochastic=True, seed=8)
    assert torch.equal(a.packed, b.packed) and not torch.equal(a.packed, c.packed)
    mean = torch.stack(
        [F.dequantize_nvfp4(*F.quantize_nvfp4(x, stochastic=True, seed=s), out_dtype=torch.float32) for s in range(64)]
    ).mean(0)
    rne = F.fake_quantize_nvfp4(x, torch.float32)
    # averaging SR draws approaches x: the mean error falls well below round-to-nearest's
    assert (mean - x).pow(2).mean() < 0.25 * (rne - x).pow(2).mean()


# ------------------------------------------------------------------ FP8 blocks / tiles
def test_fp8_block_scale_layout_and_edge_blocks():
    w = torch.randn(300, 200)
    q, s = F.quantize_fp8_blocks(w)
    assert q.dtype == F.E4M3 and s.shape == (3, 2) and s.dtype == torch.float32
    assert s[2, 1].item() == pytest.approx(w[256:, 128:].abs().max().item() / 448, rel=1e-6)
    with pytest.raises(ValueError, match="block scale has shape"):
        F.dequantize_fp8_blocks(q, s[:2])


def test_fp8_block_zero_block_and_ue8m0():
    w = torch.randn(256, 256)
    w[:128, :128] = 0
    q, s = F.quantize_fp8_blocks(w)
    assert s[0, 0].item() == 1 / 448 * 448 / 448 or s[0, 0].item() == 1.0
    assert torch.all(F.dequantize_fp8_blocks(q, s, out_dtype=torch.float32)[:128, :128] == 0)
    q8, s8 = F.quantize_fp8_blocks(w, ue8m0=True)
    assert torch.all(torch.log2(s8) == torch.round(torch.log2(s8)))
    assert torch.all(s8 >= s)  # rounded up: the block still fits


def test_fp8_tiles_layout():
    x = torch.randn(3, 5, 300)
    q, s = F.quantize_fp8_tiles(x)
    assert s.shape == (3, 5, 3)
    assert s[1, 2, 2].item() == pytest.approx(x[1, 2, 256:].abs().max().item() / 448, rel=1e-6)


# ------------------------------------------------------------------ SQNR floors and 4/6
def _sqnr(x, y):
    return 10 * math.log10(x.pow(2).mean().item() / (x - y).pow(2).mean().item())


def _data(kind):
    g = torch.Generator().manual_seed(1234)
    if kind == "gaussian":
        return torch.randn(256, 1024, generator=g)
    # heavy-tailed: Student-t with 3 degrees of freedom
    z = torch.randn(256, 1024, generator=g)
    chi = torch.randn(3, 256, 1024, generator=g).pow(2).sum(0)
    return z / torch.sqrt(chi / 3)


# SQNR of quantize->dequantize on 256x1024 Gaussian and Student-t(3) data (recorded in docs/formats.md).
SQNR_FLOORS = {  # measured (dB) in comments; floors ~0.5 dB under
    ("fp8_block", "gaussian"): 31.0, ("fp8_block", "heavy"): 31.2,  # 31.54 / 31.73
    ("fp8_tile", "gaussian"): 31.3, ("fp8_tile", "heavy"): 32.5,  # 31.81 / 32.98
    ("nvfp4", "gaussian"): 19.9, ("nvfp4", "heavy"): 20.4,  # 20.44 / 20.88
    ("nvfp4_46", "gaussian"): 20.7, ("nvfp4_46", "heavy"): 20.8,  # 21.22 / 21.25
    ("nvfp4_2d", "gaussian"): 18.6, ("nvfp4_2d", "heavy"): 14.5,  # 19.08 / 14.95
    ("mxfp4", "gaussian"): 18.3, ("mxfp4", "heavy"): 16.5,  # 18.80 / 17.02
    ("nf4", "gaussian"): 20.2, ("nf4", "heavy"): 17.7,  # 20.73 / 18.19
}


def _roundtrip(fmt, x):
    if fmt == "fp8_block":
        return F.dequantize_fp8_blocks(*F.quantize_fp8_blocks(x), out_dtype=torch.float32)
    if fmt == "fp8_tile":
        return F.dequantize_fp8_tiles(*F.quantize_fp8_tiles(x), out_dtype=torch.float32)
    if fmt == "nvfp4":
        return F.fake_quantize_nvfp4(x, torch.float32, four_over_six=False)
    if fmt == "nvfp4_46":
        return F.fake_quantize_nvfp4(x, torch.float32, four_over_six=True)
    if fmt == "nvfp4_2d":
        return F.fake_quantize_nvfp4(x, torch.float32, block_2d=True)
    if fmt == "mxfp4":
        return F.fake_quantize_mxfp4(x, torch.float32)
    p, st = F.quantize_nf4(x)
    return F.dequantize_nf4(p, st, torch.float32)


@pytest.mark.parametrize("fmt,kind", sorted(SQNR_FLOORS))
def test_sqnr_floor(fmt, kind):
    x = _data(kind)
    assert _sqnr(x, _roundtrip(fmt, x)) >= SQNR_FLOORS[(fmt, kind)]


@pytest.mark.parametrize("kind", ["gaussian", "heavy"])
@pytest.mark.parametrize("rule", ["mse", "mae", "abs_max"])
def test_four_over_six_lowers_mse(kind, rule):
    x = _data(kind)
    plain = F.fake_quantize_nvfp4(x, torch.float32, four_over_six=False)
    fos = F.fake_quantize_nvfp4(x, torch.float32, four_over_six=True, rule=rule)
    assert (fos - x).pow(2).mean() < (plain - x).pow(2).mean()


# ------------------------------------------------------------------ Hadamard
def test_rht_matches_matrix_form_and_inverts():
    x = torch.randn(8, 64)
    d = F.random_signs(5)
    h = F.hadamard_matrix(16)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))
    ref = (x.reshape(8, 4, 16) * d) @ h / 4
    torch.testing.assert_close(F.rht(x, d), ref.reshape(8, 64), rtol=0, atol=1e-6)
    torch.testing.assert_close(F.inverse_rht(F.rht(x, d), d), x, rtol=0, atol=1e-6)


def test_rht_on_both_gemm_operands_cancels():
    a, b = torch.randn(32, 128, dtype=torch.float64).float(), torch.randn(48, 128).float()
    d = F.random_signs(9)
    torch.testing.assert_close(F.rht(a, d) @ F.rht(b, d).t(), a @ b.t(), rtol=1e-5, atol=1e-4)


def test_rht_spreads_outliers():
    x = torch.zeros(1, 16)
    x[0, 3] = 16.0
    y = F.rht(x, F.random_signs(1))
    assert y.abs().max().item() == 4.0  # one spike becomes 16 entries of +-4
    with pytest.raises(ValueError, match="chunks of 16"):
        F.rht(torch.randn(2, 24), F.random_signs(1))


def test_nf4_is_bitsandbytes_bit_for_bit():
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    p, st = F.quantize_nf4(w, 64, True)
    raw = F.dequantize_nf4_raw(p, F.nf4_absmax(st), F.nf4_code(), 64, w.shape, torch.bfloat16)
    assert torch.equal(raw, F.dequantize_nf4(p, st))
    with pytest.raises(ValueError, match="block_size"):
        F.quantize_nf4(w, 32)


def test_packed_decode_table_matches_nibble_decode():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(F.decode_packed_e2m1(every_byte), F.e2m1_decode(F.unpack_e2m1(every_byte)))


# ---- MXFP4 scale-rounding options (reference only; the kernels implement the spec's floor)
def test_mxfp4_scale_rounding_options():
    from surogate_hf.formats.mxfp4 import SCALE_ROUNDINGS

    # block maxima 5 (floor: 5/2^0 = 5 fits), 7 (floor clips 7 -> 6), 4.5, 0 (zero block)
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0] = 5.0, 7.0, 4.5
    x[:3, 1:] = torch.linspace(-1, 1, 31)
    bytes_of = {r: F.quantize_mxfp4(x, r)[1][:, 0].tolist() for r in SCALE_ROUNDINGS}
    assert bytes_of["floor"] == [127, 127, 127, 0]
    assert bytes_of["ceil"] == [127, 128, 127, 0]  # 7 > 6: one binade up so nothing clips
    assert bytes_of["rtn"] == [127, 127, 127, 0]  # round(log2(7/6) = 0.22) = 0: 7 still clips to 6
    for r in SCALE_ROUNDINGS:
        packed, scales = F.quantize_mxfp4(x, r)
        assert torch.isfinite(F.dequantize_mxfp4(packed, scales, torch.float32)).all()
    assert torch.equal(F.fake_quantize_mxfp4(x, torch.float32), F.fake_quantize_mxfp4(x, torch.float32, "floor"))
    with pytest.raises(ValueError, match="scale_rounding must be one of"):
        F.quantize_mxfp4(x, "nearest")


def test_mxfp4_ceil_never_clips_and_best_is_the_better_neighbour():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 3
    blocks = lambda t: t.reshape(64, -1, 32)  # noqa: E731
    amax = blocks(x).abs().amax(-1)
    # ceil clips nothing: every |x| <= 6 * scale (floor clips the blocks whose max lands in (6, 8))
    _, s = F.quantize_mxfp4(x, "ceil")
    assert (amax <= 6 * F.e8m0_to_float(s)).all()
    _, s = F.quantize_mxfp4(x, "floor")
    assert (amax > 6 * F.e8m0_to_float(s)).any()
    err = {r: blocks(F.fake_quantize_mxfp4(x, torch.float32, r) - x).square().sum(-1) for r in ("floor", "ceil", "best")}
    _, sf = F.quantize_mxfp4(x, "floor")
    _, sb = F.quantize_mxfp4(x, "best")
    assert ((sb == sf) | (sb == sf + 1)).all()
    assert (err["best"] <= torch.minimum(err["floor"], err["ceil"]) + 1e-9).all()
    assert err["best"].sum() < err["floor"].sum()
