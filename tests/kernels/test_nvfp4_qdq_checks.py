"""Bad input to the nvfp4 recipe's operand ops is named before any kernel sees it (kernels.nvfp4_qdq.check, the
reference's own checks); CPU only."""

from __future__ import annotations

import pytest
import torch

import surogate_hf.formats as F
import surogate_hf.ops  # noqa: F401
from surogate_hf.kernels import nvfp4_qdq as Q


@pytest.mark.parametrize("shape, axis, kw, err, match", [
    ((4, 4, 16), 1, {}, ValueError, "2-D"),
    ((4, 16), 3, {}, ValueError, "axis 0, 1 or 2"),
    ((4, 24), 1, {}, ValueError, "multiple of 16"),
    ((24, 32), 2, {}, ValueError, "16x16 tiles"),
    ((32, 32), 2, {"stochastic": True}, ValueError, "stochastic"),
    ((32, 32), 2, {"signs": torch.ones(16)}, ValueError, "transform"),
    ((32, 32), 0, {"signs": torch.ones(8)}, ValueError, "16 entries"),
])
def test_operand_checks_name_the_problem(shape, axis, kw, err, match):
    with pytest.raises(err, match=match):
        Q.check(torch.zeros(shape), kw.get("signs"), axis, kw.get("stochastic", False))


def test_operand_check_names_the_dtype():
    with pytest.raises(TypeError, match="int32"):
        Q.check(torch.zeros(16, 16, dtype=torch.int32), None, 1)


def test_qdq_rejects_an_unknown_rule_before_any_kernel():
    with pytest.raises(ValueError, match="rule"):
        Q.qdq(torch.zeros(16, 16), None, None, 1, True, "l2", False, 0)


def test_reference_operand_names_its_problems():
    with pytest.raises(ValueError, match="axis 2"):
        F.nvfp4_operand(torch.zeros(16, 16), 2, F.random_signs(0))
    with pytest.raises(ValueError, match="axis 0, 1 or 2"):
        torch.ops.surogate.nvfp4_qdq(torch.zeros(16, 16), None, None, 5, True, "mse", False, 0)


def test_axis0_reference_pads_tokens_and_keeps_the_layout():
    x = torch.randn(37, 48)
    v, g = torch.ops.surogate.nvfp4_qdq(x, None, None, 0, True, "mse", False, 0)
    assert v.shape == (48, 48) and v.dtype == torch.bfloat16
    # e2m1 * s_blk times the global is the reference's dequantized operand (x^T padded), laid out like x
    q = F.quantize_nvfp4(torch.nn.functional.pad(x.t(), (0, 11)))
    assert torch.equal((v.float() * g).t(), F.dequantize_nvfp4(*q, torch.float32))


def test_gemm_names_bad_operands_and_bias():
    bf = torch.bfloat16
    one = torch.ones(())
    with pytest.raises(TypeError, match="bfloat16"):
        Q.gemm(torch.zeros(4, 16), torch.zeros(16, 8, dtype=bf), one, one, None, bf)
    with pytest.raises(ValueError, match="bias must have N = 8"):
        Q.gemm(torch.zeros(4, 16, dtype=bf), torch.zeros(16, 8, dtype=bf), one, one, torch.zeros(3), bf)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\]"):
        Q.gemm(torch.zeros(4, 16, dtype=bf), torch.zeros(8, 8, dtype=bf), one, one, None, bf)
