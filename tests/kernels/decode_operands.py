"""Test helper (not collected): a weight's operands for the extension's decode ops, quantized on the CPU by each
format's reference quantizer, in the layouts ops.ext.decode_reference states. Shared by the host build of the decode
math (test_csrc_host.py) and the GPU tests of the kernels (test_gpu_decoded_linear.py)."""

from __future__ import annotations

import torch

import surogate_hf.formats as F
from surogate_hf.ops.ext import DECODE_FORMATS


def quantized_operands(w: torch.Tensor, fmt: str):
    """(codes, scales, gscale, levels, fmt code, block) of the [n, k] weight w: one-byte scales as uint8 (nvfp4's E4M3
    bytes), nf4 with its 64-element blocks and fp32 absmax, fp8 in 128x128 blocks."""
    code = DECODE_FORMATS.index(fmt)
    if fmt == "nvfp4":
        packed, s, g = F.quantize_nvfp4(w)
        return packed, s.view(torch.uint8), g.float().reshape(()), None, code, 16
    if fmt == "mxfp4":
        packed, s = F.quantize_mxfp4(w)
        return packed, s, None, None, code, 32
    if fmt == "nf4":
        packed, state = F.quantize_nf4(w.to(torch.bfloat16), 64, True)
        return packed, F.nf4_absmax(state).float().contiguous(), None, state.code.float().contiguous(), code, 64
    q, s = F.quantize_fp8_blocks(w, (128, 128))
    return q.view(torch.uint8), s.float().contiguous(), None, None, code, 128
