"""NF4 through bitsandbytes itself, so results are bit-identical to what PEFT users already have.

bitsandbytes stores the packed weight as uint8 [N*K/2, 1] and a QuantState (absmax per block,
optionally double-quantized to 8-bit codes in groups of 256 with an fp32 scale and mean offset).
Checkpoint keys follow bitsandbytes: `weight`, `weight.absmax`, `weight.quant_map`,
`weight.nested_absmax`, `weight.nested_quant_map`, `weight.quant_state.bitsandbytes__nf4`.
"""

from __future__ import annotations

import torch

NF4_BLOCK_SIZES = (64, 128)


def _bnb():
    try:
        import bitsandbytes.functional as F
    except Exception as exc:  # pragma: no cover - bitsandbytes is a dependency
        raise ImportError(f"format 'nf4' needs bitsandbytes (pip install bitsandbytes): {exc}") from exc
    return F


def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True, quant_storage=torch.uint8):
    """Returns (packed uint8, QuantState). `w` keeps its dtype as the QuantState's dtype."""
    if block_size not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4 block_size must be one of {NF4_BLOCK_SIZES}, got {block_size}")
    return _bnb().quantize_4bit(
        w.contiguous(), blocksize=block_size, compress_statistics=double_quant, quant_type="nf4",
        quant_storage=quant_storage,
    )


def dequantize_nf4(packed: torch.Tensor, quant_state, out_dtype=None) -> torch.Tensor:
    """bitsandbytes' own decode. Its CPU path (0.50.2) misdecodes blocks that straddle rows, so the
    modules require in_features % block_size == 0 and decode through dequantize_nf4_raw."""
    out = _bnb().dequantize_4bit(packed, quant_state)
    return out if out_dtype is None else out.to(out_dtype)


def nf4_state_to_dict(quant_state, prefix: str = "weight") -> dict[str, torch.Tensor]:
    """The QuantState as the bitsandbytes checkpoint tensors, keys prefixed like `weight.absmax`."""
    return {f"{prefix}.{k}": v for k, v in quant_state.as_dict(packed=True).items()}


def nf4_state_from_dict(tensors: dict[str, torch.Tensor], packed: torch.Tensor, prefix: str = "weight"):
    from bitsandbytes.functional import QuantState

    sub = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    return QuantState.from_dict(sub, device=packed.device)


def nf4_code(device=None) -> torch.Tensor:
    """The 16 NF4 levels (bitsandbytes' table)."""
    return _bnb().get_4bit_type("nf4", device=device or "cpu").float()


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' 8-bit dequantize_blockwise in torch ops: code[codes] * absmax[block], one fp32 product per
    element (what its CPU and CUDA kernels compute, bit for bit). Plain ops, so it traces: bitsandbytes' own CPU op
    returned NaN under inductor when its input was a slot read inside the graph."""
    vals = code.float()[codes.reshape(-1).long()]
    scale = absmax.float().repeat_interleave(blocksize)[: vals.numel()]
    return (vals * scale).reshape(codes.shape)


def nf4_absmax(quant_state) -> torch.Tensor:
    """fp32 absmax per block, undoing double quantization when the state is nested."""
    if quant_state.nested:
        st2 = quant_state.state2
        absmax = dequantize_blockwise(quant_state.absmax, st2.absmax, st2.code, st2.blocksize)
        return (absmax + quant_state.offset).float()
    return quant_state.absmax.float()


def dequantize_nf4_raw(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int, shape, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """NF4 decode without a QuantState: bitsandbytes packs the even element in the HIGH nibble."""
    # broadcast shifts, not a stack of the two nibbles: one pointwise expression, which a compiled graph fuses
    # into a single decode kernel (a stack made it two, with the codes written out in between)
    shifts = torch.tensor([4, 0], dtype=torch.uint8, device=packed.device)
    idx = ((packed.reshape(-1, 1) >> shifts) & 0xF).reshape(-1).long()
    vals = code.float()[idx].reshape(-1, block_size) * absmax.float().reshape(-1, 1)
    return vals.reshape(shape).to(out_dtype)
