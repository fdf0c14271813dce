"""The nvfp4 recipe's operand pass on CUDA: amax, then quantize to NVFP4 and write e2m1 * s_blk as bf16
(surogate::nvfp4_amax / nvfp4_qdq; formats.nvfp4.qdq_nvfp4 is the spec, tests/kernels compare the bits).

Two implementations:
  - the csrc extension's `surogate::ext_nvfp4_amax` / `ext_nvfp4_qdq`, when it is built: one read of the operand per
    pass, the transform, the zero padding of the token axis and the layout done in the kernel (a thread per 16-block,
    the 4/6 choice in registers);
  - otherwise the Triton kernels composed: transpose-and-pad copy, `rht` (fp32 out), `quantize_nvfp4` (packed codes)
    and `dequantize_nvfp4`. Same bits, about four passes more over each operand; reported once.
The choice is made once per process, at the first call.
"""

from __future__ import annotations

import torch

from ..formats.nvfp4 import FOUR_OVER_SIX_RULES, NVFP4_BLOCK
from . import probe
from ._warn import warn_once

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_impl = []  # [(amax, qdq)], resolved at the first call


def _check(x: torch.Tensor, signs, axis: int, who: str) -> None:
    if x.dim() != 2 or axis not in (0, 1):
        raise ValueError(f"{who}: x must be 2-D and axis 0 or 1; got shape {tuple(x.shape)}, axis {axis}")
    if axis == 1 and x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"{who}: blocks along rows need the last dim to be a multiple of {NVFP4_BLOCK}; got shape "
                         f"{tuple(x.shape)}")
    if signs is not None and signs.numel() != NVFP4_BLOCK:
        raise ValueError(f"{who}: rht signs must have {NVFP4_BLOCK} entries, got shape {tuple(signs.shape)}")


def amax(x: torch.Tensor, signs: torch.Tensor | None, axis: int) -> torch.Tensor:
    _check(x, signs, axis, "nvfp4_amax")
    if not _impl:
        _impl.append(_resolve())
    return _impl[0][0](x, signs, axis)


def qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed):
    _check(x, signs, axis, "nvfp4_qdq")
    if rule not in FOUR_OVER_SIX_RULES:
        raise ValueError(f"four_over_six rule must be one of {FOUR_OVER_SIX_RULES}, got {rule!r}")
    if not _impl:
        _impl.append(_resolve())
    return _impl[0][1](x, amax_t, signs, axis, four_over_six, rule, stochastic, seed)


def _operand(x, signs, axis):
    tq = probe.triton_kernels("triton_quant", "the nvfp4 recipe's operand quantization")
    t = x
    if axis == 0:
        pad = (-x.shape[0]) % NVFP4_BLOCK
        t = torch.nn.functional.pad(x.t(), (0, pad)) if pad else x.t()
    return (tq.rht(t, signs) if signs is not None else t.contiguous()), tq


def _triton_amax(x, signs, axis):
    t, tq = _operand(x, signs, axis)
    return tq.amax(t)


def _triton_qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed):
    t, tq = _operand(x, signs, axis)
    packed, scale, g_dec = tq.quantize_nvfp4(t, False, four_over_six, rule, stochastic, seed, amax_t)
    v = tq.dequantize_nvfp4(packed, scale, torch.ones((), dtype=torch.float32, device=x.device), torch.bfloat16)
    return (v.t().contiguous() if axis == 0 else v), g_dec


def _resolve():
    from . import ext

    if ext.load(build=False) is None:
        warn_once("nvfp4_qdq_ext", "surogate_hf: the nvfp4 recipe quantizes its GEMM operands with Triton kernels "
                  "(transpose, transform, quantize and decode as separate passes: several times the bytes of the "
                  f"one-pass CUDA kernel); the CUDA extension is {ext.status()[1]}")
        return _triton_amax, _triton_qdq
    ext_amax = torch.ops.surogate.ext_nvfp4_amax.default
    ext_qdq = torch.ops.surogate.ext_nvfp4_qdq.default

    def native_input(x, signs):
        if x.dtype not in _FLOATS:
            raise TypeError(f"nvfp4 operand: expected a float32/bfloat16/float16 tensor, got {x.dtype}")
        x = x.contiguous()
        if x.data_ptr() % 16:  # the kernels load 16 bytes at a time
            x = x.clone()
        return x, (signs.float().contiguous() if signs is not None else None)

    def native_amax(x, signs, axis):
        x, signs = native_input(x, signs)
        return ext_amax(x, signs, axis)

    def native_qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed):
        x, signs = native_input(x, signs)
        return ext_qdq(x, amax_t.float().reshape(()), signs, axis, four_over_six, FOUR_OVER_SIX_RULES.index(rule),
                       stochastic, int(seed))

    return native_amax, native_qdq
