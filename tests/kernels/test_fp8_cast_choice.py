"""kernels.fp8_cast picks the eager recipe's cast kernel once per process: the csrc extension when it is loaded,
else Triton with one warning that says how to build the extension; inputs the csrc kernels cannot load (a
misaligned view, a dtype they do not take) go to Triton, which writes the same bits, with one warning per reason. The CUDA launches themselves
are checked on the GPU (tests/kernels/test_gpu_kernels.py); here the choice, with both kernels stubbed."""

import pytest
import torch

from surogate_hf.kernels import ext, fp8_cast
from surogate_hf.ops import _warn


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fp8_cast, "_impl", [])
    calls = []
    monkeypatch.setattr(fp8_cast, "_triton", lambda x, s, a, d, t: calls.append(("triton", tuple(x.shape), t)) or "tri")
    return calls


def test_without_the_extension_the_triton_kernel_runs_and_one_warning_says_how_to_build(fresh, monkeypatch):
    monkeypatch.setattr(ext, "load", lambda build=False: None)
    monkeypatch.setattr(ext, "status", lambda: (False, "not built (run `python -m surogate_hf.kernels.build`)"))
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="kernels.build"):
        assert fp8_cast.cast_fp8_into(x, torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.float8_e4m3fn,
                                      True) == "tri"
    fp8_cast.cast_fp8_into(x, torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.float8_e4m3fn, False)
    assert fresh == [("triton", (4, 16), True), ("triton", (4, 16), False)]  # resolved once: no second warning


def test_with_the_extension_its_ops_run_and_unloadable_inputs_take_triton(fresh, monkeypatch):
    monkeypatch.setattr(ext, "load", lambda build=False: object())
    seen = []
    monkeypatch.setattr(torch.ops.surogate.ext_fp8_cast_amax, "default",
                        lambda x, s, q, a: seen.append(("cast", q.shape, q.dtype)))
    monkeypatch.setattr(torch.ops.surogate.ext_fp8_cast_transpose_amax, "default",
                        lambda x, s, q, qt, a: seen.append(("cast_t", q.shape, qt.shape)))
    scale, bits = torch.ones(1), torch.zeros(1, dtype=torch.int32)
    x = torch.zeros(6, 32, dtype=torch.bfloat16)
    q, qt = fp8_cast.cast_fp8_into(x, scale, bits, torch.float8_e5m2, True)
    assert q.shape == (6, 32) and qt.shape == (32, 6) and q.dtype == qt.dtype == torch.float8_e5m2
    q, qt = fp8_cast.cast_fp8_into(x, scale, bits, torch.float8_e4m3fn, False)
    assert qt is None
    assert seen == [("cast_t", (6, 32), (32, 6)), ("cast", (6, 32), torch.float8_e4m3fn)]
    misaligned = torch.zeros(6 * 32 + 1, dtype=torch.bfloat16)[1:].view(6, 32)  # 2 bytes past a 16-byte boundary
    monkeypatch.setattr(_warn, "_seen", set())
    with pytest.warns(RuntimeWarning, match="16-byte aligned address, got torch.bfloat16 at offset 2"):
        assert fp8_cast.cast_fp8_into(misaligned, scale, bits, torch.float8_e4m3fn, True) == "tri"
    with pytest.warns(RuntimeWarning, match="got torch.float64"):
        assert fp8_cast.cast_fp8_into(x.double(), scale, bits, torch.float8_e4m3fn, True) == "tri"
    assert [c[0] for c in fresh] == ["triton", "triton"]
