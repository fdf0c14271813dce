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


@pytest.mark.parametrize("axis", [0, 1])
def test_a_seed_tensor_draws_what_its_int_draws(axis):
    """seed_tensor (a seed computed on the device, as compiled graphs pass it) gives the int seed's draws, in the
    operand op and in the packed quantizer; both outputs are tensors of their own (no view: inductor may reuse an
    op's output buffer for a graph output)."""
    x = torch.randn(37, 48)
    seed = 3_000_000_017
    v, g = torch.ops.surogate.nvfp4_qdq(x, None, None, axis, True, "mse", True, seed)
    vt, gt = torch.ops.surogate.nvfp4_qdq(x, None, None, axis, True, "mse", True, 0, torch.tensor([seed]))
    assert torch.equal(v, vt) and torch.equal(g, gt)
    assert not vt._is_view() and not gt._is_view()
    other = torch.ops.surogate.nvfp4_qdq(x, None, None, axis, True, "mse", True, 0, torch.tensor(seed + 1))[0]
    assert not torch.equal(v, other)
    q = torch.ops.surogate.quantize_nvfp4(x[:32], False, True, "mse", True, seed, None)
    qt = torch.ops.surogate.quantize_nvfp4(x[:32], False, True, "mse", True, 0, None, torch.tensor(seed))
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == F.E4M3 else a, b.view(torch.uint8) if b.dtype == F.E4M3
                           else b) for a, b in zip(q, qt))


@pytest.mark.parametrize("bad, match", [(torch.tensor(1.0), "int64"), (torch.tensor([1, 2]), "one int64")])
def test_a_bad_seed_tensor_is_named(bad, match):
    with pytest.raises(ValueError, match="seed_tensor"):
        torch.ops.surogate.nvfp4_qdq(torch.zeros(16, 16), None, None, 1, True, "mse", True, 0, bad)
    with pytest.raises(ValueError, match="seed_tensor"):
        Q.qdq(torch.zeros(16, 16), None, None, 1, True, "mse", True, 0, bad)


def test_take_step_advances_and_a_recompute_reuses_the_step():
    """surogate::take_step: a forward gets the counter and advances it; one run by the autograd engine inside a
    backward (an activation-checkpoint recompute) gets the step of the forward it recomputes and leaves it."""
    from surogate_hf.ops import recipe  # noqa: F401

    counter = torch.tensor(5)
    assert int(torch.ops.surogate.take_step(counter)) == 5 and int(counter) == 6
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(int(torch.ops.surogate.take_step(counter)))
            return g

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [5] and int(counter) == 6
