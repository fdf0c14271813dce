"""FP8 (E4M3) weights: one home for the options, the Format and the two checkpoint layouts.

Slots of a unit [n, k]: `weight` e4m3 [n, k]; `weight_scale_inv` fp32 [ceil(n/bn), ceil(k/bk)] (blocks) or
[] (per tensor).
Layouts:
    fp8_block   HF fine-grained FP8 (quant_method "fp8"): `weight` e4m3 + `weight_scale_inv` fp32 (real exports
                also name it `scale` / `qscale_weight`; ue8m0 checkpoints store E8M0 bytes), `weight_block_size`
                in the config (null: one scale per tensor). Written by save_pretrained, read by stock transformers.
    fp8_tensor  ModelOpt FP8 (quant_algo "FP8"): `weight` e4m3 + per-tensor `weight_scale` fp32 [], optional
                static `input_scale` (carried).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ... import formats as F
from ... import ops
from ...kernels import registry as _cuda
from .base import (
    SCALAR_SHAPES, Format, Layout, OptionError, Options, _chunked, check_bool, expect, input_scale, is_int, register,
    stack_units, unit_index,
)

FP8_BLOCK_SIDES = (16, 32, 64, 128, 256, 512)  # block sides online quantization accepts (GPU kernels tile in 2^n)
FP8_SCALE_ALIASES = ("weight_scale_inv", "scale", "qscale_weight")  # real exports; transformers renames the same
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclasses.dataclass(frozen=True)
class FP8Options(Options):
    """block_size: weight block (rows, cols), None (or "tensor") = one per-tensor scale; ue8m0: power-of-two
    (UE8M0) block scales."""

    CONFIG_FIELDS = {"block_size": "block_size", "ue8m0": "ue8m0"}

    block_size: tuple[int, int] | None = (128, 128)
    ue8m0: bool = False

    def validate(self):
        bs = self.block_size
        bad = OptionError("block_size", f"{{opt}} must be two ints, None or 'tensor'; got {bs!r}")
        if isinstance(bs, str):
            if bs.lower() != "tensor":
                raise bad
            bs = None
        if bs is not None:
            try:
                bs = tuple(bs)
            except TypeError:
                raise bad from None
            if len(bs) != 2 or not all(is_int(b) for b in bs):
                raise bad
        self._set("block_size", bs)
        check_bool("ue8m0", self.ue8m0)

    @classmethod
    def from_config(cls, values, where="SurogateConfig"):
        opts = super().from_config(values, where)
        # Online quantization: the GPU kernels tile in powers of two; a per-tensor scale has no ue8m0 form.
        if opts.block_size is not None and not all(b in FP8_BLOCK_SIDES for b in opts.block_size):
            raise ValueError(f"{where}: unsupported block_size {opts.block_size}; each side must be one of {FP8_BLOCK_SIDES}")
        if opts.ue8m0 and opts.block_size is None:
            raise ValueError(f"{where}: ue8m0 scales need block scaling; block_size is per-tensor (None)")
        return opts


class FP8Format(Format):
    name = "fp8"
    options_class = FP8Options
    per_component = True

    def __init__(self, block_size=(128, 128), ue8m0: bool = False):
        block_size = None if block_size is None else (int(block_size[0]), int(block_size[1]))
        self.options = FP8Options(block_size, bool(ue8m0))
        self.block_size, self.ue8m0 = self.options.block_size, self.options.ue8m0

    def slots(self, n, k, expert=False):
        scale = () if self.block_size is None else (-(-n // self.block_size[0]), -(-k // self.block_size[1]))
        return {"": ((n, k), F.E4M3), "_scale_inv": (scale, torch.float32)}

    def quantize(self, w, expert=False):
        if self.block_size is None:
            scale = F.fp8_scale_from_amax(w.detach().abs().amax(), F.E4M3)

            def one(c):
                q, s = F.quantize_fp8_tensorwise(c, F.E4M3, scale=scale)
                return {"": q, "_scale_inv": s.reshape(()).float()}

            return _chunked(w, 1, one)
        bn, bk = self.block_size

        def one(c):
            q, s = ops.quantize_fp8_blocks(c, bn, bk, self.ue8m0)
            return {"": q, "_scale_inv": s}

        return _chunked(w, bn, one)

    def _blocks(self, t, n, k):
        # per-tensor scaling is one block covering the whole weight
        if self.block_size is None:
            return n, k, t["_scale_inv"].reshape(1, 1)
        return self.block_size[0], self.block_size[1], t["_scale_inv"]

    def element_scales(self, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        return F.fp8._expand_blocks(s.float(), bn, bk, n, k)

    def round_to_grid(self, v):
        return F.cast_to_fp8(v, F.E4M3).float()

    def encode_on_scales(self, t, w, n, k):
        return {**t, "": F.cast_to_fp8(w.float() / self.element_scales(t, n, k), F.E4M3)}

    def dequantize(self, t, n, k, dtype):
        bn, bk, s = self._blocks(t, n, k)
        return ops.dequantize_fp8_blocks(t[""], s, bn, bk, dtype)

    def weight_only(self, n, k) -> bool:
        """A small 128x128-block weight: the linear keeps x in its dtype (formats.fp8_linear_weight_only). Other
        block sizes and per-tensor scales keep the W8A8 math (they run the reference path on CUDA anyway)."""
        return self.block_size == (128, 128) and F.fp8_linear_weight_only(n, k)

    def dequantize_traced(self, t, n, k, dtype):
        bn, bk, s = self._blocks(t, n, k)
        return F.dequantize_fp8_blocks(t[""], s, (bn, bk), dtype)

    def decodes_in_gemm(self, x, n, k):
        # only a weight-only linear is a decode plus a GEMM; the W8A8 one also quantizes x, at every token count
        return self.weight_only(n, k)

    def linear(self, x, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        if self.weight_only(n, k):
            return torch.nn.functional.linear(x, ops.dequantize_fp8_blocks(t[""], s, bn, bk, x.dtype))
        if x.is_cuda:  # torch.compile graphs: the extension's C++ op when it applies
            y = _cuda.fp8_block_linear_native(x, t[""], s, bn, bk, False)
            if y is not None:
                return y
        # x in 1x128 tiles (or 1xK) as in the fine-grained recipe
        return ops.fp8_block_linear(x, t[""], s, bn, bk)

    def dgrad(self, dy, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        if self.weight_only(n, k):
            return dy @ ops.dequantize_fp8_blocks(t[""], s, bn, bk, dy.dtype)
        if dy.is_cuda:
            dx = _cuda.fp8_block_linear_native(dy, t[""], s, bn, bk, True)
            if dx is not None:
                return dx
        return ops.fp8_block_linear_dgrad(dy, t[""], s, bn, bk)

    def cuda_plan(self, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        if self.weight_only(n, k):
            return _cuda.plan_fp8_weight_only(t[""], s, bn, bk)
        return _cuda.plan_fp8(t[""], s, bn, bk)

    def decode_args(self, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        return (t[""], s, None, None, bn, None) if self.weight_only(n, k) and bn == bk else None

    def w8a8_cuda_plan(self, t, n, k):
        """The W8A8 plan (x in 1x128 E4M3 tiles x the stored blocks) whatever the weight's size: what an FP8 recipe runs
        on a base whose own linear is weight-only (recipes.qlora, kind fp8_stored); the same kernels and prepared
        scale layouts as a larger base's own linear."""
        bn, bk, s = self._blocks(t, n, k)
        return _cuda.plan_fp8(t[""], s, bn, bk)

    def bytes_per_param(self):
        if self.block_size is None:
            return 1.0
        return 1.0 + 4.0 / (self.block_size[0] * self.block_size[1])

    def path_options(self):
        return {"block_size": self.block_size}

    # ---- HF fine-grained FP8 on save (ue8m0 scales are written as fp32 powers of two: identical values)
    def checkpoint_config(self, dense_names):
        from transformers.utils.quantization_config import FineGrainedFP8Config  # the config.json form, lazily

        d = FineGrainedFP8Config(
            activation_scheme="dynamic",
            weight_block_size=None if self.block_size is None else list(self.block_size),
            modules_to_not_convert=dense_names,
        ).to_dict()
        d["quant_method"] = "fp8"
        return d

    def save_caveats(self, layers):
        if self.block_size is None:
            return None
        bn, bk = self.block_size
        partial = [name for name, (n, k) in layers.items() if (n > bn and n % bn) or (k > bk and k % bk)]
        if not partial:
            return None
        return ("surogate_hf: fp8 layers with a dimension above the block size and not a multiple of it use partial "
                f"edge blocks (DeepSeek-V3 layout; vLLM reads it, stock transformers' dequantize does not): {partial}")


# ============================================================================ stored scales
def e8m0_bytes_to_float(t: torch.Tensor) -> torch.Tensor:
    return F.e8m0_to_float(t.view(torch.uint8) if t.dtype != torch.uint8 else t)


def float_to_e8m0(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 powers of two back to the stored E8M0 (float8_e8m0fnu or its uint8 bytes); exact or an error."""
    e = t.float().to(torch.float8_e8m0fnu)
    if not torch.equal(e.float(), t.float()):
        raise ValueError("ue8m0 scales changed after loading: a scale is no longer a power of two")
    return e if dtype == torch.float8_e8m0fnu else e.view(torch.uint8)


def scale_to_working(t: torch.Tensor, shape) -> torch.Tensor:
    t = e8m0_bytes_to_float(t) if t.dtype in (torch.uint8, _E8M0) else t.float()
    return t.reshape(shape)


# ============================================================================ checkpoint layouts
class _FP8Layout(Layout):
    format = "fp8"
    scale = ""  # the stored scale slot
    zero_scale_masks = {}  # set per layout: E4M3 bytes, every bit but the sign makes an element non-zero

    def stored_encoding(self, working, dtype):
        if dtype in (torch.uint8, _E8M0) and working == "weight_scale_inv":
            return "e8m0"  # ue8m0 exponents -> the fp32 powers of two FP8Linear works with
        return None

    def fuse(self, stored, comps, num_experts, slot_shapes, n_units, fmt, warn):
        # per-component units (blocks never straddle gate and up): the bytes stack as stored
        ws = [torch.stack(stored(c, "weight")) for c in comps]
        ss = [torch.stack([scale_to_working(t, slot_shapes["_scale_inv"][0]) for t in stored(c, self.scale)]) for c in comps]
        return {"": stack_units(ws, n_units), "_scale_inv": stack_units(ss, n_units)}

    def split(self, t, e, j, crows, n_units):
        idx = unit_index(e, j, n_units)
        return {"weight": t[""][idx], self.scale: t["_scale_inv"][idx]}


class FP8BlockLayout(_FP8Layout):
    """HF fine-grained FP8 (`weight_scale_inv`, block scales or one per tensor)."""

    kind = "fp8_block"
    scale = "weight_scale_inv"
    label = "FP8 block-quantized"
    zero_scale_masks = {"weight_scale_inv": 0x7F}

    def module_options(self, lf):
        return {"block_size": lf.block, "ue8m0": lf.ue8m0}

    def check(self, module, key, lf, index):
        n, k, errors = self.preamble(module, key, index)
        if errors:
            return {}, {}, errors
        w = expect(index, f"{key}.weight", ("F8_E4M3",), (n, k), errors, "FP8 E4M3 weight")
        alias = next((a for a in FP8_SCALE_ALIASES if f"{key}.{a}" in index), None)
        if alias is None:
            errors.append(f"missing scale: {key}.weight_scale_inv (or .scale / .qscale_weight) not found in the checkpoint")
            return {}, {}, errors
        bn, bk = lf.block or (n, k)  # no weight_block_size: one scale for the whole tensor (transformers' reading)
        grid = (math.ceil(n / bn), math.ceil(k / bk))
        dtypes = ("F32", "F8_E8M0", "U8") if lf.ue8m0 else ("F32",)
        s = expect(index, f"{key}.{alias}", dtypes, [grid] if lf.block else [grid, (), (1,)], errors,
                   f"fp8 block scale for block {bn}x{bk}")
        slots = {"weight": w, "weight_scale_inv": s}
        return slots, {"weight": "weight", "weight_scale_inv": alias}, errors

    def scale_block(self, lf, n, kb, scale):
        if lf.block is not None and scale.numel() > 1:
            return lf.block
        return n, kb


class FP8TensorLayout(_FP8Layout):
    """ModelOpt FP8: per-tensor `weight_scale`, loaded into FP8Linear's 1x1 `weight_scale_inv`."""

    kind = "fp8_tensor"
    scale = "weight_scale"
    label = "ModelOpt FP8"
    working_names = {"weight_scale": "weight_scale_inv"}
    zero_scale_masks = {"weight_scale": 0x7F}

    def module_options(self, lf):
        return {"block_size": None}

    def check(self, module, key, lf, index):
        n, k, errors = self.preamble(module, key, index)
        if errors:
            return {}, {}, errors
        w = expect(index, f"{key}.weight", ("F8_E4M3",), (n, k), errors, "ModelOpt FP8 weight")
        s = expect(index, f"{key}.weight_scale", ("F32",), list(SCALAR_SHAPES), errors, "ModelOpt FP8 per-tensor weight_scale")
        slots = {"weight": w, "weight_scale": s}
        input_scale(index, key, slots, errors)
        return slots, {s_: s_ for s_ in slots}, errors


register(FP8Format, FP8BlockLayout(), FP8TensorLayout())
