"""NF4 weights (bitsandbytes): one home for the options, the Format and the bitsandbytes checkpoint layout.

Slots of a unit [n, k]: `weight` uint8 [n*k/2, 1] (bitsandbytes packing); `weight_absmax` (uint8 codes with double
quantization, else fp32) [nblocks]; `weight_quant_map` fp32 [16]; with double quantization also
`weight_nested_absmax` fp32 [ceil(nblocks/256)], `weight_nested_quant_map` fp32 [256], `weight_offset` fp32 [].
Layout `nf4` (quant_method "bitsandbytes", load_in_4bit, nf4): bitsandbytes' keys `weight`, `weight.absmax`,
`weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`, `weight.quant_state.bitsandbytes__nf4`
(the QuantState JSON: blocksize, shape, nested_offset). Module attribute names cannot hold dots: the loader
renames `weight.x` onto the slots `weight_x` (`stored_names`); the JSON is carried byte for byte and its
nested_offset fills `weight_offset`.
"""

from __future__ import annotations

import dataclasses
import json
import re

import torch

from ... import formats as F
from ... import ops
from ...kernels import registry as _cuda
from .base import (
    Format, Layout, OptionError, Options, check_bool, expect, is_int, register, register_shared_graph_table, stack_units,
    unit_index,
)

NF4_BLOCK_SIZES = F.nf4.NF4_BLOCK_SIZES
NF4_NESTED_BLOCK = F.nf4.NF4_NESTED_BLOCK  # bitsandbytes' block size for double-quantized absmaxes
_NESTED_BLOCK = NF4_NESTED_BLOCK

# module slot -> checkpoint suffix
NF4_STORED = {
    "weight": "weight",
    "weight_absmax": "weight.absmax",
    "weight_quant_map": "weight.quant_map",
    "weight_nested_absmax": "weight.nested_absmax",
    "weight_nested_quant_map": "weight.nested_quant_map",
    "weight_quant_state": "weight.quant_state.bitsandbytes__nf4",
}
NF4_STATE_SLOT = "weight_quant_state"
BNB_COMPANION = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__\w+)$")
_OFFSET = "_offset"  # unit slot filled from the QuantState JSON's nested_offset (not a stored tensor)


@dataclasses.dataclass(frozen=True)
class NF4Options(Options):
    """block_size: 64 | 128 weights per absmax; double_quant: quantize the absmaxes too (bitsandbytes);
    scale_search: each block's scale is the lowest-error share of its absmax (formats.nf4.quantize_nf4), not the
    absmax itself (False: bitsandbytes' quantize_4bit, bit for bit)."""

    CONFIG_FIELDS = {"nf4_block_size": "block_size", "nf4_double_quant": "double_quant",
                     "nf4_scale_search": "scale_search"}

    block_size: int = 64
    double_quant: bool = True
    scale_search: bool = True

    def validate(self):
        if self.block_size not in NF4_BLOCK_SIZES or not is_int(self.block_size):
            raise OptionError("block_size", f"unsupported {{opt}} {self.block_size!r}; expected one of {NF4_BLOCK_SIZES}")
        check_bool("double_quant", self.double_quant)
        check_bool("scale_search", self.scale_search)


class NF4Format(Format):
    name = "nf4"
    options_class = NF4Options
    per_component = True

    def __init__(self, block_size: int = 64, double_quant: bool = True, scale_search: bool = True):
        self.options = NF4Options(block_size, bool(double_quant), bool(scale_search))
        self.block_size = int(self.options.block_size)
        self.double_quant = self.options.double_quant
        self.scale_search = self.options.scale_search

    def shape_problem(self, n, k):
        # bitsandbytes 0.50's CPU dequantize_4bit mis-decodes blocks that straddle rows (k % block != 0)
        # while its quantize flattens them: such layers stay dense so what we write decodes alike everywhere.
        if k % self.block_size:
            return f"NF4 needs in_features % {self.block_size} == 0, got {k}"
        return None

    def slots(self, n, k, expert=False):
        nb = n * k // self.block_size
        s = {
            "": ((n * k // 2, 1), torch.uint8),
            "_absmax": ((nb,), torch.uint8 if self.double_quant else torch.float32),
            "_quant_map": ((16,), torch.float32),
        }
        if self.double_quant:
            s["_nested_absmax"] = ((-(-nb // _NESTED_BLOCK),), torch.float32)
            s["_nested_quant_map"] = ((256,), torch.float32)
            s["_offset"] = ((), torch.float32)
        return s

    def quantize(self, w, expert=False):
        packed, qs = F.quantize_nf4(w, self.block_size, self.double_quant, scale_search=self.scale_search)
        t = {"": packed.reshape(-1, 1), "_absmax": qs.absmax, "_quant_map": qs.code.float()}
        if qs.nested:
            t["_nested_absmax"] = qs.state2.absmax.float()
            t["_nested_quant_map"] = qs.state2.code.float()
            t["_offset"] = torch.as_tensor(qs.offset, dtype=torch.float32).reshape(())
        return t

    def quant_state(self, t, n, k, dtype):
        """The bitsandbytes QuantState of a unit (dtype = the dtype bitsandbytes decodes to)."""
        from bitsandbytes.functional import QuantState

        state2 = None
        offset = None
        if self.double_quant:
            state2 = QuantState(
                absmax=t["_nested_absmax"], code=t["_nested_quant_map"], blocksize=_NESTED_BLOCK, dtype=torch.float32
            )
            offset = t["_offset"]
        return QuantState(
            absmax=t["_absmax"],
            shape=torch.Size((n, k)),
            code=t["_quant_map"],
            blocksize=self.block_size,
            quant_type="nf4",
            dtype=dtype,
            offset=offset,
            state2=state2,
        )

    def _nested(self, t):
        """Double quantization's (nested absmax, nested code values, offset) slots, which the decode ops take beside
        the one-byte absmax codes; None for a plain fp32 absmax."""
        return (t["_nested_absmax"], t["_nested_quant_map"], t["_offset"]) if self.double_quant else None

    def _absmax(self, t, n, k):
        return F.nf4_absmax(self.quant_state(t, n, k, torch.float32))

    def element_scales(self, t, n, k):
        return self._absmax(t, n, k).repeat_interleave(self.block_size).reshape(n, k)

    def round_to_grid(self, v):
        code = F.nf4_code(v.device)  # the NF4 levels every unit this format writes holds as its quant_map
        return code[F.nf4.nf4_round(v, code)]

    def encode_on_scales(self, t, w, n, k):
        return {**t, "": F.nf4.encode_nf4(w, self._absmax(t, n, k), t["_quant_map"], self.block_size)}

    def dequantize(self, t, n, k, dtype):
        # the same decode the linear ops use (bitsandbytes' dequantize_4bit agrees for k % block == 0)
        return F.dequantize_nf4_raw(t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, (n, k), dtype)

    def dequantize_traced(self, t, n, k, dtype):
        return self.dequantize(t, n, k, dtype)  # already the formats/ decode in torch ops

    def linear(self, x, t, n, k):
        return ops.nf4_linear(x, t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, n, k)

    def dgrad(self, dy, t, n, k):
        return ops.nf4_linear_dgrad(dy, t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, n, k)

    def cuda_plan(self, t, n, k):
        # A double-quantized absmax goes to the plan as stored, with its nested operands: the C++ decode route
        # de-nests it per block; the few-token and Python paths take a de-nested fp32 absmax, which the plan builds
        # on their first call and then holds (4 bytes per block, +0.0625 B/param at block 64; undoing double
        # quantization per call was a bitsandbytes call on every forward and dgrad).
        return _cuda.plan_nf4(t[""], t["_absmax"], t["_quant_map"], self.block_size, n, k, nested=self._nested(t))

    def decode_args(self, t, n, k):
        # a double-quantized absmax goes to the decode ops as stored, with its nested operands (as in the eager plan):
        # the decode kernel de-nests it per block, so a compiled graph runs no de-nesting kernel of its own per call
        # and saves no fp32 absmax for the backward. The levels slot is fp32 [16] already, and handed over as such
        # (QuantizedLinear.graph_decode_operands passes a slot as stored).
        levels = t["_quant_map"]
        if levels.dtype != torch.float32 or not levels.is_contiguous():
            levels = levels.float().contiguous()
        nested = self._nested(t)
        absmax = t["_absmax"] if nested is not None else t["_absmax"].float().contiguous()
        return t[""], absmax, None, levels, self.block_size, nested

    def shared_graph_tables(self, t):
        # the 16 NF4 levels and double quantization's 256-entry code are the same in every unit that bitsandbytes or
        # this package writes: 14 graph inputs a decoder layer of seven linears become two for the whole model
        from torch.distributed.tensor import DTensor

        shared = {}
        for suffix, standard in (("_quant_map", F.nf4.nf4_code), ("_nested_quant_map", F.nf4.nested_code)):
            v = t.get(suffix)
            if v is None or isinstance(v, DTensor) or v.is_meta or v.dtype != torch.float32:
                continue
            key = (self.name, suffix, str(v.device))
            table = register_shared_graph_table(key, lambda: standard(v.device).float().contiguous())
            if v.shape == table.shape and torch.equal(v, table):
                shared[suffix] = key
        return shared

    def path_options(self):
        return {"nf4_block": self.block_size}

    def bytes_per_param(self):
        if not self.double_quant:
            return 0.5 + 4.0 / self.block_size
        return 0.5 + 1.0 / self.block_size + 4.0 / (self.block_size * _NESTED_BLOCK)

    # ---- the bitsandbytes layout on save
    def to_checkpoint(self, t, n, k, prefix, dtype):
        out = {prefix + "weight": t[""].reshape(-1, 1)}
        out.update(F.nf4.nf4_state_to_dict(self.quant_state(t, n, k, dtype), prefix + "weight"))
        return out

    def checkpoint_config(self, dense_names):
        from transformers import BitsAndBytesConfig  # the config.json form, lazily

        d = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=dense_names,
        ).to_dict()
        return json.loads(json.dumps(d, default=str))


# ============================================================================ the bitsandbytes layout
def quant_state_json(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.reshape(-1).tolist()))


def nested_offset(t: torch.Tensor, device) -> torch.Tensor:
    """weight_offset from a stored QuantState JSON tensor."""
    return torch.tensor(float(quant_state_json(t)["nested_offset"]), dtype=torch.float32, device=device)


class NF4Layout(Layout):
    """bitsandbytes 4-bit NF4, checked against the stored QuantState (`refine` reads blocksize and nesting)."""

    kind = "nf4"
    format = "nf4"
    stored_names = NF4_STORED
    carried = ("input_scale", NF4_STATE_SLOT)
    metadata_slot = NF4_STATE_SLOT  # stored uint8 JSON, carried byte for byte
    label = "NF4 (bitsandbytes)"
    packed_experts_only = True

    def module_options(self, lf):
        # bitsandbytes' own encode when re-quantizing (as the checkpoint's producer did)
        return {"block_size": lf.nf4_block, "double_quant": lf.double_quant, "scale_search": False}

    def refine(self, lf, module, key, index):
        """blocksize and double quantization are per tensor, in the stored QuantState."""
        n, k, errors = self.preamble(module, key, index)
        if errors:
            return lf, errors
        state_key = f"{key}.{NF4_STORED[NF4_STATE_SLOT]}"
        if state_key not in index:
            other = [k for k in index.tensors if k.startswith(f"{key}.weight.quant_state.")]
            if other:
                return lf, [f"{other[0]}: bitsandbytes 4-bit type other than nf4 is not supported"]
            return lf, [f"missing NF4 QuantState: {state_key} not found in the checkpoint"]
        if index.get(state_key).dtype != "U8":
            return lf, [f"{state_key} has dtype {index.get(state_key).dtype}, expected U8 (bitsandbytes QuantState JSON)"]
        try:
            state = quant_state_json(index.read(state_key))
        except ValueError as exc:
            return lf, [f"{state_key}: not a bitsandbytes QuantState JSON ({exc})"]
        block = state.get("blocksize")
        nested = "nested_blocksize" in state or "nested_offset" in state
        if state.get("quant_type") != "nf4":
            errors.append(f"{state_key}: quant_type {state.get('quant_type')!r}, expected 'nf4'")
        if list(state.get("shape") or []) != [n, k]:
            errors.append(f"{state_key}: shape {state.get('shape')}, expected [{n}, {k}] (the module's [out, in])")
        if block not in NF4_BLOCK_SIZES:
            errors.append(f"{state_key}: blocksize {block!r} unsupported; expected one of {NF4_BLOCK_SIZES}")
        elif k % block:
            # bitsandbytes' CPU dequantize misdecodes blocks that straddle rows; NF4Linear keeps whole-row blocks
            errors.append(f"{key}: in_features {k} is not divisible by the NF4 blocksize ({block})")
        if nested and (state.get("nested_blocksize") != NF4_NESTED_BLOCK
                       or not isinstance(state.get("nested_offset"), (int, float))):
            errors.append(f"{state_key}: nested_blocksize {state.get('nested_blocksize')!r} / nested_offset "
                          f"{state.get('nested_offset')!r}; expected {NF4_NESTED_BLOCK} and a number")
        has_nested = f"{key}.{NF4_STORED['weight_nested_absmax']}" in index
        if nested != has_nested:
            errors.append(f"{state_key}: the QuantState says nested={nested} but {key}.weight.nested_absmax is "
                          f"{'present' if has_nested else 'absent'}")
        if errors:
            return lf, errors
        return dataclasses.replace(lf, nf4_block=int(block), double_quant=nested), []

    def check(self, module, key, lf, index):
        """bitsandbytes layout, checked against the QuantState read by `refine` (lf.nf4_block, lf.double_quant)."""
        errors, n, k = [], module.out_features, module.in_features
        nb = n * k // lf.nf4_block
        want = {
            "weight": (("U8",), (n * k // 2, 1), "NF4 packed weight (uint8 [N*K/2, 1])"),
            "weight_absmax": (("U8",) if lf.double_quant else ("F32",), (nb,), "NF4 block absmax"),
            "weight_quant_map": (("F32",), (16,), "NF4 quant_map"),
        }
        if lf.double_quant:
            want["weight_nested_absmax"] = (("F32",), (-(-nb // NF4_NESTED_BLOCK),), "NF4 nested absmax")
            want["weight_nested_quant_map"] = (("F32",), (256,), "NF4 nested quant_map")
        slots = {s: expect(index, f"{key}.{NF4_STORED[s]}", d, shp, errors, what) for s, (d, shp, what) in want.items()}
        slots[NF4_STATE_SLOT] = index.get(f"{key}.{NF4_STORED[NF4_STATE_SLOT]}")
        return slots, {s: NF4_STORED[s] for s in slots}, errors

    def derived_slots(self, lf):
        return ("weight" + _OFFSET,) if lf.double_quant else ()

    def derive(self, slot, t, fmt):
        if slot == NF4_STATE_SLOT and fmt.double_quant:
            return {"weight" + _OFFSET: nested_offset(t, t.device)}
        return {}

    def scale_problems(self, key, leaf, t):
        if t.dtype == torch.uint8:  # double-quantized absmax: 8-bit codes, every byte is valid
            return []
        v = t.float()
        nonfinite = int((~torch.isfinite(v)).sum())
        if nonfinite:
            return [f"{key}: {nonfinite} NaN/inf value(s)"]
        if leaf in ("weight_absmax", "weight_nested_absmax") and bool((v < 0).any()):
            return [f"{key}: negative absmax value(s) (min {v.min().item():g})"]
        return []  # quant maps hold signed levels

    def fuse(self, stored, comps, num_experts, slot_shapes, n_units, fmt, warn):
        # per-component units: each stored tensor is stacked as is (the QuantState JSON is carried by the caller)
        out = {}
        for suffix, (shape, _) in slot_shapes.items():
            per_comp = []
            for c in comps:
                if suffix == _OFFSET:
                    per_comp.append(torch.stack([nested_offset(t, t.device) for t in stored(c, NF4_STATE_SLOT)]))
                else:
                    per_comp.append(torch.stack([t.reshape(shape) for t in stored(c, "weight" + suffix)]))
            out[suffix] = stack_units(per_comp, n_units)
        return out

    def split(self, t, e, j, crows, n_units):
        idx = unit_index(e, j, n_units)
        return {"weight" + s: v[idx] for s, v in t.items() if s != _OFFSET}  # the offset lives in the JSON


register(NF4Format, NF4Layout())
