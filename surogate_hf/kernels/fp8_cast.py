"""The per-tensor FP8 cast on CUDA (q = sat(x * scale), its transpose, the running amax): the eager fp8 recipes'
casts and the CUDA kernels of surogate::quantize_fp8_tensorwise[_t] (kernels.registry).

Two kernels with the same bits (formats.quantize_fp8_tensorwise is the spec; tests/kernels compares them):
  - the csrc extension's `surogate::ext_fp8_cast[_transpose]_amax`, when it is built: one dispatcher call,
    about the host time of an aten op;
  - the Triton kernel (kernels.triton_recipe) otherwise: its Python launcher alone took ~57 us of host time per
    call on the H200 host (benchmarks/results/host_calls.md), and an eager fp8 linear makes two such casts
    per step, so an unbuilt extension is reported once.
The choice is made once per process, at the first cast.
"""

from __future__ import annotations

import torch

from . import probe
from ..ops._warn import warn_once

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_impl = []  # [the cast function], resolved at the first call


def cast_fp8_into(x2d: torch.Tensor, scale_row: torch.Tensor, amax_bits: torch.Tensor, dtype: torch.dtype,
                  transpose: bool):
    """(q [R, C], q^T contiguous or None) of the contiguous CUDA x2d [R, C] scaled by the one-element fp32
    scale_row; amax_bits (int32 [1], a non-negative fp32's bits) is raised to max|x2d|."""
    if not _impl:
        _impl.append(_resolve())
    return _impl[0](x2d, scale_row, amax_bits, dtype, transpose)


def _triton(x2d, scale_row, amax_bits, dtype, transpose):
    return probe.triton_kernels("triton_recipe", "the fp8 recipe's CUDA casts").cast_fp8_into(
        x2d, scale_row, amax_bits, dtype, transpose)


def _resolve():
    from . import ext

    if ext.load(build=False) is None:
        warn_once("fp8_cast_ext", "surogate_hf: the per-tensor FP8 casts run as Triton kernels, whose Python launcher "
                  "costs ~60 us of host time per call (a host-bound step runs slower); the CUDA extension is "
                  f"{ext.status()[1]}")
        return _triton
    cast = torch.ops.surogate.ext_fp8_cast_amax.default
    cast_t = torch.ops.surogate.ext_fp8_cast_transpose_amax.default

    def native(x2d, scale_row, amax_bits, dtype, transpose):
        if x2d.dtype not in _FLOATS or x2d.data_ptr() % 16:  # the kernels load 16 bytes at a time
            warn_once("fp8_cast_layout", "surogate_hf: an FP8 cast took the Triton kernel (more host time per call): "
                      f"the CUDA kernel needs a {'/'.join(str(d).replace('torch.', '') for d in _FLOATS)} input "
                      f"at a 16-byte aligned address, got {x2d.dtype} at offset {x2d.data_ptr() % 16}")
            return _triton(x2d, scale_row, amax_bits, dtype, transpose)
        q = torch.empty(x2d.shape, dtype=dtype, device=x2d.device)
        if not transpose:
            cast(x2d, scale_row, q, amax_bits)
            return q, None
        qt = torch.empty((x2d.shape[1], x2d.shape[0]), dtype=dtype, device=x2d.device)
        cast_t(x2d, scale_row, q, qt, amax_bits)
        return q, qt

    return native
