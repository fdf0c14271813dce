"""The nvfp4 recipe's operands and GEMM on CUDA (surogate::nvfp4_amax / nvfp4_qdq; formats.nvfp4.qdq_nvfp4 and mm_qdq
are the spec, tests/kernels compare the bits).

Two implementations:
  - the csrc extension's `surogate::ext_nvfp4_qdq` / `ext_nvfp4_gemm`, when it is built: one C++ call per operand
    (its amax pass, then one quantize pass that reads it once: the transform, the zero padding of the token axis and
    the layout done in the kernel, a thread per 16-block with the 4/6 choice in registers, 16 lanes per 16x16 weight
    tile), and one per GEMM (cuBLAS with fp32 output, the globals and the bias in one epilogue pass);
  - otherwise the Triton kernels composed: transpose-and-pad copy, `rht` (fp32 out), `quantize_nvfp4` (packed codes)
    and `dequantize_nvfp4`; torch.mm and the Triton epilogue. Same bits, several passes more over each operand and a
    Python launcher per kernel; reported once.
The choice is made once per process, at the first call.
"""

from __future__ import annotations

import torch

from ..formats.nvfp4 import FOUR_OVER_SIX_RULES, NVFP4_BLOCK, nvfp4_operand
from . import probe
from ..ops._warn import warn_once

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_impl = []  # [(amax, qdq, gemm)], resolved at the first call
_emulation_said: set = set()


def check(x: torch.Tensor, signs, axis: int, stochastic: bool = False, who: str = "nvfp4_qdq") -> None:
    """The shapes and options an NVFP4 operand takes (a clear error in place of a kernel's assert)."""
    if x.dim() != 2 or axis not in (0, 1, 2):
        raise ValueError(f"{who}: x must be 2-D and axis 0, 1 or 2; got shape {tuple(x.shape)}, axis {axis}")
    if axis != 0 and x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"{who}: blocks along rows need the last dim to be a multiple of {NVFP4_BLOCK}; got shape "
                         f"{tuple(x.shape)}")
    if axis == 2 and (x.shape[0] % NVFP4_BLOCK or signs is not None or stochastic):
        raise ValueError(f"{who}: 16x16 tiles (axis 2) need rows that are a multiple of {NVFP4_BLOCK} and take no "
                         f"transform or stochastic rounding; got shape {tuple(x.shape)}")
    if signs is not None and signs.numel() != NVFP4_BLOCK:
        raise ValueError(f"{who}: rht signs must have {NVFP4_BLOCK} entries, got shape {tuple(signs.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{who}: expected a float32/bfloat16/float16 tensor, got {x.dtype}")


def _get():
    if not _impl:
        _impl.append(_resolve())
    return _impl[0]


def amax(x: torch.Tensor, signs: torch.Tensor | None, axis: int) -> torch.Tensor:
    check(x, signs, axis, who="nvfp4_amax")
    return _get()[0](x, signs, axis)


def qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor=None):
    """(bf16 e2m1 * s_blk, decode global) of x's operand; amax_t None takes the operand's own amax. seed_tensor (one
    int64 on x's device) replaces `seed`: the kernels read it on the device."""
    check(x, signs, axis, stochastic)
    if rule not in FOUR_OVER_SIX_RULES:
        raise ValueError(f"four_over_six rule must be one of {FOUR_OVER_SIX_RULES}, got {rule!r}")
    if seed_tensor is not None:
        from ..ops.quant import check_seed_tensor

        check_seed_tensor(seed_tensor, x)
    return _get()[1](x, amax_t, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor)


def gemm(a, b, ga, gb, bias, out_dtype):
    """formats.nvfp4.mm_qdq on CUDA: a [M, K], b [K, N] bf16 (any strides)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"nvfp4 gemm: a [M, K] and b [K, N] expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"nvfp4 gemm: the operands are nvfp4_qdq values (bfloat16), got {a.dtype} and {b.dtype}")
    if bias is not None and bias.numel() != b.shape[1]:
        raise ValueError(f"nvfp4 gemm: bias must have N = {b.shape[1]} entries, got shape {tuple(bias.shape)}")
    if a.device not in _emulation_said:  # (once per device: this sits on every GEMM's host path)
        _emulation_said.add(a.device)
        major = torch.cuda.get_device_capability(a.device)[0]
        warn_once("nvfp4_gemm", f"surogate_hf: the nvfp4 recipe's GEMMs on SM{major}x run on bf16 tensor cores with "
                  "exactly decoded FP4 operands (no native FP4 GEMM: FP4 tensor cores need SM100+ and a kernel this "
                  "package lacks)")
    return _get()[2](a, b, ga, gb, bias, out_dtype)


def _operand(x, signs, axis):
    tq = probe.triton_kernels("triton_quant", "the nvfp4 recipe's operand quantization")
    return nvfp4_operand(x, axis, signs, transform=tq.rht).contiguous(), tq


def _triton_amax(x, signs, axis):
    t, tq = _operand(x, signs, axis)
    return tq.amax(t)


def _triton_qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor):
    t, tq = _operand(x, signs, axis)
    if amax_t is None:
        amax_t = tq.amax(t)
    seed = seed if seed_tensor is None else seed_tensor
    packed, scale, g_dec = tq.quantize_nvfp4(t, axis == 2, four_over_six, rule, stochastic, seed, amax_t)
    v = tq.dequantize_nvfp4(packed, scale, torch.ones((), dtype=torch.float32, device=x.device), torch.bfloat16)
    return (v.t().contiguous() if axis == 0 else v), g_dec


def _torch_gemm(a, b, ga, gb, bias, out_dtype):
    acc = torch.mm(a, b, out_dtype=torch.float32)
    tr = probe.triton_kernels("triton_recipe", "the nvfp4 recipe's GEMM epilogue")
    return tr.scale_bias_cast(acc, ga, gb, bias, out_dtype)


def _resolve():
    from . import ext

    if ext.load(build=False) is None:
        warn_once("nvfp4_qdq_ext", "surogate_hf: the nvfp4 recipe quantizes its GEMM operands with Triton kernels "
                  "(transpose, transform, quantize and decode as separate passes: several times the bytes of the "
                  f"one-pass CUDA kernel, and a Python launcher each); the CUDA extension is {ext.status()[1]}")
        return _triton_amax, _triton_qdq, _torch_gemm
    ext_amax = torch.ops.surogate.ext_nvfp4_amax.default
    ext_qdq = torch.ops.surogate.ext_nvfp4_qdq.default
    ext_gemm = torch.ops.surogate.ext_nvfp4_gemm.default

    def native_input(x, signs):
        x = x.contiguous()
        if x.data_ptr() % 16:  # the kernels load 16 bytes at a time
            x = x.clone()
        return x, (signs.to(x.device, torch.float32).contiguous() if signs is not None else None)

    def native_amax(x, signs, axis):
        x, signs = native_input(x, signs)
        return ext_amax(x, signs, axis)

    def native_qdq(x, amax_t, signs, axis, four_over_six, rule, stochastic, seed, seed_tensor):
        x, signs = native_input(x, signs)
        a = None if amax_t is None else amax_t.to(x.device, torch.float32).reshape(())
        st = None if seed_tensor is None else seed_tensor.reshape(1)
        return ext_qdq(x, a, signs, axis, four_over_six, FOUR_OVER_SIX_RULES.index(rule), stochastic, int(seed), st)

    def native_gemm(a, b, ga, gb, bias, out_dtype):
        if out_dtype not in _FLOATS or (bias is not None and bias.dtype not in _FLOATS):
            raise TypeError(f"nvfp4 gemm: out_dtype and bias must be float32/bfloat16/float16, got {out_dtype}, "
                            f"{None if bias is None else bias.dtype}")
        dev = a.device
        return ext_gemm(a, b, ga.to(dev, torch.float32), gb.to(dev, torch.float32),
                        None if bias is None else bias.to(dev), out_dtype)

    return native_amax, native_qdq, native_gemm
