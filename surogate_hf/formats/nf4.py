"""NF4 through bitsandbytes itself, so results are bit-identical to what PEFT users already have.

bitsandbytes stores the packed weight as uint8 [N*K/2, 1] and a QuantState (absmax per block,
optionally double-quantized to 8-bit codes in groups of 256 with an fp32 scale and mean offset).
Checkpoint keys follow bitsandbytes: `weight`, `weight.absmax`, `weight.quant_map`,
`weight.nested_absmax`, `weight.nested_quant_map`, `weight.quant_state.bitsandbytes__nf4`.
"""

from __future__ import annotations

import torch

NF4_BLOCK_SIZES = (64, 128)
NF4_NESTED_BLOCK = 256  # bitsandbytes' block size for double-quantized absmaxes
# Block scales tried by the scale search, as shares of the block's absmax (1.0 = bitsandbytes' scale). Measured on
# the convergence benchmark's real weights (docs/fidelity.md): 1.0 alone 20.56 dB, {1, .95, .9, .85} 21.03 dB,
# these 16 21.08 dB.
NF4_SCALE_CANDIDATES = tuple(1.0 - 0.02 * i for i in range(16))


def _bnb():
    try:
        import bitsandbytes.functional as F
    except Exception as exc:  # pragma: no cover - bitsandbytes is a dependency
        raise ImportError(f"format 'nf4' needs bitsandbytes (pip install bitsandbytes): {exc}") from exc
    return F


def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True, quant_storage=torch.uint8,
                 scale_search: bool = False):
    """Returns (packed uint8, QuantState). `w` keeps its dtype as the QuantState's dtype.

    scale_search=False is bitsandbytes' own quantize_4bit, bit for bit: each block's scale is its absmax. With
    True each block takes, of the scales NF4_SCALE_CANDIDATES * absmax, the one with the smallest squared error
    (the largest elements may clip to +-1), and the codes are rounded against the scale the decode will use
    (after double quantization). Either way the result is a plain bitsandbytes NF4 tensor: every NF4 decoder
    reads it."""
    if block_size not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4 block_size must be one of {NF4_BLOCK_SIZES}, got {block_size}")
    if scale_search:
        if w.numel() % block_size:
            raise ValueError(f"quantize_nf4: scale_search needs whole blocks; the weight's {w.numel()} elements are not "
                             f"a multiple of block_size {block_size} (bitsandbytes' own encode, scale_search=False, "
                             "takes a partial last block)")
        return _quantize_nf4_searched(w, block_size, double_quant)
    return _bnb().quantize_4bit(
        w.contiguous(), blocksize=block_size, compress_statistics=double_quant, quant_type="nf4",
        quant_storage=quant_storage,
    )


_CHUNK = 1 << 22  # elements per pass of the encode and the scale search: bounds their temporaries on large weights


def nf4_round(v: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the 16 ascending NF4 levels `code` to each value of `v` (in units of the block
    scale; beyond +-1 the end levels). Ties (measure zero) go to the lower level."""
    mid = (code[1:] + code[:-1]) * 0.5
    return torch.bucketize(v.float().contiguous(), mid.to(v.device).contiguous())


def pack_nf4(idx: torch.Tensor) -> torch.Tensor:
    """4-bit indices (flattened row-major) to bitsandbytes' packing: uint8 [numel/2, 1], the even element in the
    high nibble."""
    idx = idx.reshape(-1, 2).to(torch.uint8)
    return ((idx[:, 0] << 4) | idx[:, 1]).reshape(-1, 1)


def encode_nf4(w: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int) -> torch.Tensor:
    """The packed codes of `w` on the given per-block scales (fp32 absmax, one per `block_size` elements of the
    flattened w): the nearest level of w / absmax. A zero scale encodes its block as level 0."""
    wb, scales = w.reshape(-1, block_size), absmax.float().reshape(-1, 1)
    rows = max(1, _CHUNK // block_size)
    out = []
    for r in range(0, wb.shape[0], rows):
        x, a = wb[r : r + rows].float(), scales[r : r + rows]
        v = torch.where(a > 0, x / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(x))
        out.append(pack_nf4(nf4_round(v, code)))
    return torch.cat(out)


def _searched_scales(wb: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Per block (rows of wb, fp32), the candidate scale with the smallest squared error; 0 for a zero block."""
    amax = wb.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    best_scale, best_err = None, None
    for share in NF4_SCALE_CANDIDATES:
        s = safe * share
        err = (code[nf4_round(wb / s, code)] * s - wb).square().sum(-1, keepdim=True)
        if best_err is None:
            best_scale, best_err = s, err
        else:
            better = err < best_err  # ties keep the larger scale: 1.0 (bitsandbytes') first
            best_scale, best_err = torch.where(better, s, best_scale), torch.where(better, err, best_err)
    return torch.where(amax > 0, best_scale, torch.zeros_like(amax)).reshape(-1)


def _quantize_nf4_searched(w: torch.Tensor, block_size: int, double_quant: bool):
    from bitsandbytes.functional import QuantState

    code = nf4_code(w.device)
    wb = w.reshape(-1, block_size)
    rows = max(1, _CHUNK // block_size)
    absmax = torch.cat([_searched_scales(wb[r : r + rows].float(), code) for r in range(0, wb.shape[0], rows)])
    if double_quant:
        offset = absmax.mean()
        qabsmax, state2 = _bnb().quantize_blockwise(absmax - offset, blocksize=NF4_NESTED_BLOCK)
        state = QuantState(absmax=qabsmax, shape=w.shape, dtype=w.dtype, blocksize=block_size, code=code,
                           quant_type="nf4", offset=offset, state2=state2)
    else:
        state = QuantState(absmax=absmax, shape=w.shape, dtype=w.dtype, blocksize=block_size, code=code,
                           quant_type="nf4")
    # the codes against the scale the decode uses: double quantization moves each absmax a little
    return encode_nf4(w, nf4_absmax(state), code, block_size), state


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


def nested_code(device=None) -> torch.Tensor:
    """The 256 values of double quantization's absmax code (bitsandbytes' signed dynamic map, what quantize_blockwise
    encodes with by default)."""
    return _bnb().create_dynamic_map(signed=True).to(device or "cpu").float()


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' 8-bit dequantize_blockwise in torch ops: code[codes] * absmax[block], one fp32 product per
    element (what its CPU and CUDA kernels compute, bit for bit). Plain ops, so it traces: bitsandbytes' own CPU op
    returned NaN under inductor when its input was a slot read inside the graph."""
    vals = code.float()[codes.reshape(-1).long()]
    scale = absmax.float().repeat_interleave(blocksize)[: vals.numel()]
    return (vals * scale).reshape(codes.shape)


def nf4_denest_absmax(codes: torch.Tensor, nested_absmax: torch.Tensor, nested_code: torch.Tensor,
                      offset: torch.Tensor, blocksize: int = NF4_NESTED_BLOCK) -> torch.Tensor:
    """fp32 absmax per block from double quantization's one-byte codes: nested_code[codes] * nested_absmax[block of
    `blocksize` codes] + offset, each fp32 op rounded on its own (bitsandbytes' dequantize_blockwise, then its offset).
    The extension's decode kernel de-nests the same way (csrc/weight_only/decode_math.cuh: nf4_absmax)."""
    return (dequantize_blockwise(codes, nested_absmax, nested_code, blocksize) + offset.float()).float()


def nf4_absmax(quant_state) -> torch.Tensor:
    """fp32 absmax per block, undoing double quantization when the state is nested."""
    if quant_state.nested:
        st2 = quant_state.state2
        return nf4_denest_absmax(quant_state.absmax, st2.absmax, st2.code, torch.as_tensor(quant_state.offset),
                                 st2.blocksize)
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
