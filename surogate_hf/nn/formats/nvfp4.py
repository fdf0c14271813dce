"""NVFP4 weights: one home for the options, the Format and the ModelOpt NVFP4 checkpoint layout.

Slots of a unit [n, k]: `weight` uint8 [n, k/2] (two E2M1, even index in the low nibble); `weight_scale` e4m3
[n, k/16]; `weight_scale_2` fp32 [] (the decode global, ModelOpt's name).
Layout `nvfp4`: ModelOpt (quant_method "modelopt", quant_algo "NVFP4", group_size 16) stores exactly these
tensors, plus an optional static `input_scale` (carried). save_pretrained writes them weight-only (no
input_scale: there is no activation calibration).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import formats as F
from ... import ops
from ...formats.nvfp4 import FOUR_OVER_SIX_RULES, NVFP4_BLOCK
from ...kernels import registry as _cuda
from .base import (
    SCALAR_SHAPES, Format, Layout, OptionError, Options, _chunked, check_bool, expect, input_scale, register,
)


@dataclasses.dataclass(frozen=True)
class NVFP4Options(Options):
    """four_over_six: Four-Over-Six block scale choice; four_over_six_rule: the error it minimises."""

    CONFIG_FIELDS = {"four_over_six": "four_over_six", "four_over_six_rule": "four_over_six_rule"}

    four_over_six: bool = True
    four_over_six_rule: str = "mse"

    def validate(self):
        check_bool("four_over_six", self.four_over_six)
        if self.four_over_six_rule not in FOUR_OVER_SIX_RULES:
            raise OptionError(
                "four_over_six_rule", f"{{opt}} must be one of {FOUR_OVER_SIX_RULES}, got {self.four_over_six_rule!r}"
            )


class NVFP4Format(Format):
    name = "nvfp4"
    options_class = NVFP4Options

    def __init__(self, four_over_six: bool = True, four_over_six_rule: str = "mse"):
        self.options = NVFP4Options(bool(four_over_six), four_over_six_rule)
        self.four_over_six = self.options.four_over_six
        self.rule = self.options.four_over_six_rule

    def shape_problem(self, n, k):
        if k % NVFP4_BLOCK:
            return f"NVFP4 needs in_features % {NVFP4_BLOCK} == 0, got {k}"
        return None

    def slots(self, n, k, expert=False):
        return {
            "": ((n, k // 2), torch.uint8),
            "_scale": ((n, k // NVFP4_BLOCK), F.E4M3),
            "_scale_2": ((), torch.float32),
        }

    def quantize(self, w, expert=False):
        amax = w.detach().abs().amax().float()

        def one(c):
            packed, scale, g = ops.quantize_nvfp4(c, False, self.four_over_six, self.rule, False, 0, amax)
            return {"": packed, "_scale": scale, "_scale_2": g.reshape(())}

        return _chunked(w, 1, one)

    def dequantize(self, t, n, k, dtype):
        return ops.dequantize_nvfp4(t[""], t["_scale"], t["_scale_2"], dtype)

    def dequantize_traced(self, t, n, k, dtype):
        return F.dequantize_nvfp4(t[""], t["_scale"], t["_scale_2"], dtype)

    def linear(self, x, t, n, k):
        return ops.nvfp4_linear(x, t[""], t["_scale"], t["_scale_2"])

    def dgrad(self, dy, t, n, k):
        return ops.nvfp4_linear_dgrad(dy, t[""], t["_scale"], t["_scale_2"])

    def cuda_plan(self, t, n, k):
        return _cuda.plan_nvfp4(t[""], t["_scale"], t["_scale_2"])

    def decode_args(self, t, n, k):
        return t[""], t["_scale"], t["_scale_2"], None, NVFP4_BLOCK, None

    def element_scales(self, t, n, k):
        return (t["_scale"].float() * t["_scale_2"].float()).repeat_interleave(NVFP4_BLOCK, -1)

    def round_to_grid(self, v):
        return F.e2m1_round(v)

    def encode_on_scales(self, t, w, n, k):
        return {**t, "": F.nvfp4.encode_nvfp4_on_scales(w, t["_scale"], t["_scale_2"])}

    def bytes_per_param(self):
        return 0.5 + 1.0 / NVFP4_BLOCK

    # ---- ModelOpt NVFP4 on save
    def expert_rows(self, t, r0, r1):
        return {"": t[""][r0:r1], "_scale": t["_scale"][r0:r1], "_scale_2": t["_scale_2"]}

    def checkpoint_config(self, dense_names):
        from ... import __version__

        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": NVFP4_BLOCK,
            "kv_cache_quant_algo": None,
            "exclude_modules": dense_names,
            "ignore": dense_names,
            "producer": {"name": "surogate_hf", "version": __version__},
        }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


class NVFP4Layout(Layout):
    """ModelOpt NVFP4."""

    kind = "nvfp4"
    format = "nvfp4"
    zero_scale_masks = {"weight_scale": 0x77}  # packed E2M1 bytes: every bit but each nibble's sign
    label = "NVFP4"
    block = NVFP4_BLOCK

    def module_options(self, lf):
        return {"four_over_six": False}  # ModelOpt's encode (global = 6 * 448 / amax) when re-quantizing

    def check(self, module, key, lf, index):
        n, k, errors = self.preamble(module, key, index)
        if errors:
            return {}, {}, errors
        w = expect(index, f"{key}.weight", ("U8",), (n, k // 2), errors, "NVFP4 packed E2M1 weight (uint8 [N, K/2])")
        s = expect(index, f"{key}.weight_scale", ("F8_E4M3",), (n, k // NVFP4_BLOCK), errors,
                   "NVFP4 block scale (E4M3 [N, K/16])")
        g = expect(index, f"{key}.weight_scale_2", ("F32",), list(SCALAR_SHAPES), errors, "NVFP4 global scale weight_scale_2")
        slots = {"weight": w, "weight_scale": s, "weight_scale_2": g}
        input_scale(index, key, slots, errors)
        return slots, {s_: s_ for s_ in slots}, errors

    def scale_block(self, lf, n, kb, scale):
        return 1, NVFP4_BLOCK // 2  # one E4M3 scale per 16 elements = 8 packed bytes of a row

    def fuse(self, stored, comps, num_experts, slot_shapes, n_units, fmt, warn):
        # One global scale per expert for the fused [gate; up]: equal stored globals concatenate exactly;
        # different ones are dequantized, fused and re-quantized (warn reports it once).
        per = {c: (stored(c, "weight"), stored(c, "weight_scale"), stored(c, "weight_scale_2")) for c in comps}
        packed, block, glob = [], [], []
        for e in range(num_experts):
            parts = [(per[c][0][e], per[c][1][e], per[c][2][e].reshape(())) for c in comps]
            if all(_same_bits(g, parts[0][2]) for _, _, g in parts):
                packed.append(torch.cat([w for w, _, _ in parts]))
                block.append(torch.cat([s for _, s, _ in parts]))
                glob.append(parts[0][2].float())
                continue
            warn(
                f"the stored {' and '.join(comps)} of an expert have different NVFP4 global "
                "scales, while the fused projection holds one per expert; dequantizing, fusing and "
                "re-quantizing them (values change within NVFP4 rounding). Export with a unified amax "
                "for fused layers to load them exactly."
            )
            dense = torch.cat([F.dequantize_nvfp4(w, s, g, torch.float32) for w, s, g in parts])
            q = fmt.quantize(dense, expert=True)
            packed.append(q[""])
            block.append(q["_scale"])
            glob.append(q["_scale_2"].reshape(()))
        return {"": torch.stack(packed), "_scale": torch.stack(block), "_scale_2": torch.stack(glob)}

    def split(self, t, e, j, crows, n_units):
        rows = slice(j * crows, (j + 1) * crows)
        return {"weight": t[""][e, rows], "weight_scale": t["_scale"][e, rows], "weight_scale_2": t["_scale_2"][e]}


register(NVFP4Format, NVFP4Layout())
