"""MXFP4 weights: one home for the (empty) options, the Format and the two GPT-OSS-style checkpoint layouts.

Slots of a linear unit [n, k]: `weight` uint8 [n, k/2] (two E2M1, even index in the low nibble) and
`weight_scale` uint8 E8M0 [n, k/32]. Experts use GPT-OSS' shapes and names: `{P}` packed as [n, k/32, 16]
(GPT-OSS' `{P}_blocks`) and `{P}_scales` [n, k/32].
Layouts (quant_method "mxfp4"):
    mxfp4          dense linears: `weight` + `weight_scale`, exactly the slots
    mxfp4_experts  GPT-OSS experts: `{P}_blocks` [E, N, K/32, 16] + `{P}_scales` [E, N, K/32]
"""

from __future__ import annotations

import dataclasses

import torch

from ... import formats as F
from ... import ops
from ...formats.mxfp4 import MXFP4_BLOCK
from ...kernels import registry as _cuda
from .base import Format, Layout, Options, _chunked, describe, expect, register


@dataclasses.dataclass(frozen=True)
class MXFP4Options(Options):
    """MXFP4 has no options (OCP MX v1.0: E2M1 elements, one E8M0 scale per 32)."""


class MXFP4Format(Format):
    """Linear: weight [n, k/2] + weight_scale [n, k/32]. Experts use GPT-OSS' shapes and names:
    `{P}` packed as [n, k/32, 16] (GPT-OSS' `{P}_blocks`) and `{P}_scales` [n, k/32]."""

    name = "mxfp4"
    options_class = MXFP4Options

    def __init__(self):
        self.options = MXFP4Options()

    def shape_problem(self, n, k):
        if k % MXFP4_BLOCK:
            return f"MXFP4 needs in_features % {MXFP4_BLOCK} == 0, got {k}"
        return None

    def slots(self, n, k, expert=False):
        if expert:
            return {"": ((n, k // MXFP4_BLOCK, 16), torch.uint8), "_scales": ((n, k // MXFP4_BLOCK), torch.uint8)}
        return {"": ((n, k // 2), torch.uint8), "_scale": ((n, k // MXFP4_BLOCK), torch.uint8)}

    def quantize(self, w, expert=False):
        n, k = w.shape
        t = _chunked(w, 1, lambda c: dict(zip(("p", "s"), ops.quantize_mxfp4(c))))
        packed, scales = t["p"], t["s"]
        if expert:
            return {"": packed.reshape(n, k // MXFP4_BLOCK, 16), "_scales": scales}
        return {"": packed, "_scale": scales}

    @staticmethod
    def _canon(t, n, k):
        scales = t["_scales"] if "_scales" in t else t["_scale"]
        return t[""].reshape(n, k // 2), scales.reshape(n, k // MXFP4_BLOCK)

    def element_scales(self, t, n, k):
        return F.e8m0_to_float(self._canon(t, n, k)[1]).repeat_interleave(MXFP4_BLOCK, -1)

    def round_to_grid(self, v):
        return F.e2m1_round(v)

    def encode_on_scales(self, t, w, n, k):
        packed = F.mxfp4.encode_mxfp4_on_scales(w, self._canon(t, n, k)[1])
        return {**t, "": packed.reshape(t[""].shape)}

    def dequantize(self, t, n, k, dtype):
        return ops.dequantize_mxfp4(*self._canon(t, n, k), dtype)

    def dequantize_traced(self, t, n, k, dtype):
        return F.dequantize_mxfp4(*self._canon(t, n, k), dtype)

    def linear(self, x, t, n, k):
        return ops.mxfp4_linear(x, *self._canon(t, n, k))

    def dgrad(self, dy, t, n, k):
        return ops.mxfp4_linear_dgrad(dy, *self._canon(t, n, k))

    def cuda_plan(self, t, n, k):
        return _cuda.plan_mxfp4(*self._canon(t, n, k))

    def decode_args(self, t, n, k):
        return (*self._canon(t, n, k), None, None, MXFP4_BLOCK, None)

    def bytes_per_param(self):
        return 0.5 + 1.0 / MXFP4_BLOCK

    # ---- the mxfp4 layouts on save
    def to_checkpoint(self, t, n, k, prefix, dtype):
        packed, scales = self._canon(t, n, k)
        return {prefix + "weight": packed, prefix + "weight_scale": scales}

    def expert_rows(self, t, r0, r1):
        return {"": t[""][r0:r1], "_scales": t["_scales"][r0:r1]}

    def expert_checkpoint_name(self, p, suffix):
        return p + "_blocks" if suffix == "" else p + suffix

    def checkpoint_config(self, dense_names):
        return {"quant_method": "mxfp4", "modules_to_not_convert": dense_names}


class MXFP4Layout(Layout):
    """Dense linear: weight uint8 [N, K/2] (two E2M1, even element in the low nibble) + weight_scale E8M0 bytes."""

    kind = "mxfp4"
    format = "mxfp4"
    packed_experts_only = True
    label = "MXFP4"
    block = MXFP4_BLOCK

    def check(self, module, key, lf, index):
        n, k, errors = self.preamble(module, key, index)
        if errors:
            return {}, {}, errors
        w = expect(index, f"{key}.weight", ("U8",), (n, k // 2), errors, "MXFP4 packed E2M1 weight (uint8 [N, K/2])")
        s = expect(index, f"{key}.weight_scale", ("U8",), (n, k // MXFP4_BLOCK), errors,
                   "MXFP4 E8M0 block scale (uint8 [N, K/32])")
        return {"weight": w, "weight_scale": s}, {"weight": "weight", "weight_scale": "weight_scale"}, errors

    def fuse(self, stored, comps, num_experts, slot_shapes, n_units, fmt, warn):
        # no per-tensor scale: the components' rows concatenate exactly
        w = [torch.cat([stored(c, "weight")[e] for c in comps]) for e in range(num_experts)]
        s = [torch.cat([stored(c, "weight_scale")[e] for c in comps]) for e in range(num_experts)]
        return {"": torch.stack(w).reshape((num_experts,) + slot_shapes[""][0]), "_scales": torch.stack(s)}

    def split(self, t, e, j, crows, n_units):
        rows = slice(j * crows, (j + 1) * crows)
        return {"weight": t[""][e, rows], "weight_scale": t["_scales"][e, rows]}


class MXFP4ExpertsLayout(Layout):
    """GPT-OSS experts: QuantizedExperts' MXFP4 slots `{P}` / `{P}_scales` are the stored `{P}_blocks` /
    `{P}_scales` byte for byte; only the blocks' name differs."""

    kind = "mxfp4_experts"
    format = "mxfp4"
    experts = True

    def working_name(self, slot):
        return slot.removesuffix("_blocks")  # `{P}_blocks` -> `{P}`; `{P}_scales` unchanged

    def check(self, module, key, lf, index):
        errors, slots = [], {}
        e = module.num_experts
        h, i = module.hidden_size, module.intermediate_size
        for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            if k % MXFP4_BLOCK:
                errors.append(f"{key}.{proj}: input dimension {k} is not divisible by the MXFP4 block ({MXFP4_BLOCK})")
                continue
            dense = index.get(f"{key}.{proj}")
            if dense is not None:
                errors.append(f"{key}.{proj} is stored dense ({describe(dense)}), but the config says MXFP4 experts")
                continue
            slots[f"{proj}_blocks"] = expect(index, f"{key}.{proj}_blocks", ("U8",), (e, rows, k // MXFP4_BLOCK, 16),
                                             errors, "MXFP4 expert blocks (uint8 [E, rows, K/32, 16])")
            slots[f"{proj}_scales"] = expect(index, f"{key}.{proj}_scales", ("U8",), (e, rows, k // MXFP4_BLOCK),
                                             errors, "MXFP4 expert E8M0 scales (uint8 [E, rows, K/32])")
        return slots, {s: s for s in slots}, errors


register(MXFP4Format, MXFP4Layout(), MXFP4ExpertsLayout())
