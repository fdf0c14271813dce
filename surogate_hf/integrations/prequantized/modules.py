"""Quantized modules built from a plan: slots exactly as stored, adoption into working encodings after loading,
export back to the stored layout, and the loading op that fuses per-expert MoE linears."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch
from transformers.core_model_loading import ConversionOps

from ... import formats as F
from ...formats.mxfp4 import e8m0_to_float
from ...nn import slots as S
from ...nn.experts import QuantizedExperts
from ...nn.linear import (
    FP8Format,
    FP8Linear,
    MXFP4Format,
    MXFP4Linear,
    NF4Format,
    NF4Linear,
    NVFP4Format,
    NVFP4Linear,
    keep_buffer_dtype,
)
from .checkpoint import _ST_DTYPES, NF4_STATE_SLOT, FusedLayout, ModulePlan, _fmt, _st_dtype
from .scheme import LayerFormat, PrequantizedCheckpointError


_STORED_ATTR = "_surogate_stored"  # on each loaded module: {stored slot name: StoredSlot}


@dataclass(frozen=True)
class StoredSlot:
    working: str | None  # the module's own slot it feeds (None: carried only, e.g. a static input_scale)
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str = "same"  # same | e8m0 (power-of-two scale bytes) | reshape | bnb_state (QuantState JSON, carried)


_NF4_OFFSET = "_offset"  # NF4 unit slot filled from the QuantState JSON's nested_offset (not a stored tensor)
_FUSED_STATES_ATTR = "_surogate_bnb_states"  # fused nf4 experts: {"{expert}.{component}": QuantState JSON bytes}


def _bnb_state(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.reshape(-1).tolist()))


def _nf4_offset(t: torch.Tensor, device) -> torch.Tensor:
    return torch.tensor(float(_bnb_state(t)["nested_offset"]), dtype=torch.float32, device=device)


def _e8m0_bytes_to_float(t: torch.Tensor) -> torch.Tensor:
    return e8m0_to_float(t.view(torch.uint8) if t.dtype != torch.uint8 else t)


def _float_to_e8m0(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 powers of two back to the stored E8M0 (float8_e8m0fnu or its uint8 bytes); exact or an error."""
    e = t.float().to(torch.float8_e8m0fnu)
    if not torch.equal(e.float(), t.float()):
        raise ValueError("ue8m0 scales changed after loading: a scale is no longer a power of two")
    return e if dtype == torch.float8_e8m0fnu else e.view(torch.uint8)


def _stored_buffer(m, slot: str, dtype: torch.dtype, shape) -> None:
    """A meta buffer in the stored dtype and shape for the loader to fill; `adopt_stored` turns it into the
    module's frozen storage-form Parameter (nn/slots.py) after loading."""
    m._parameters.pop(slot, None)
    m.register_buffer(slot, torch.empty(shape, dtype=dtype, device="meta"))


def _build_module(plan: ModulePlan, dense: torch.nn.Module):
    """The quantized module for `plan`, on meta, with slots exactly as stored (dtype and shape)."""
    kind = plan.fmt.kind
    if plan.fused is not None:
        return _build_fused_experts(plan, dense)
    if kind == "mxfp4_experts":
        return _build_experts(plan, dense)
    bias = dense.bias is not None
    dtype = dense.weight.dtype
    if kind == "fp8_block":
        m = FP8Linear(dense.in_features, dense.out_features, bias, "meta", dtype,
                      block_size=plan.fmt.block, ue8m0=plan.fmt.ue8m0)
    elif kind == "fp8_tensor":
        m = FP8Linear(dense.in_features, dense.out_features, bias, "meta", dtype, block_size=None)
    elif kind == "nvfp4":
        m = NVFP4Linear(dense.in_features, dense.out_features, bias, "meta", dtype, four_over_six=False)
    elif kind == "mxfp4":
        m = MXFP4Linear(dense.in_features, dense.out_features, bias, "meta", dtype)
    elif kind == "nf4":
        m = NF4Linear(dense.in_features, dense.out_features, bias, "meta", dtype,
                      block_size=plan.fmt.nf4_block, double_quant=plan.fmt.double_quant)
        if plan.fmt.double_quant:
            del m._parameters["weight" + _NF4_OFFSET]  # not a stored tensor: adopt_stored reads it from the JSON
    else:
        raise PrequantizedCheckpointError(f"{plan.key}: no linear module for stored format {kind!r}")
    stored = {}
    for slot, info in plan.slots.items():
        dt = _st_dtype(info)
        working = {"weight_scale": "weight_scale_inv"}.get(slot, slot) if kind == "fp8_tensor" else slot
        encoding = "same"
        if slot in ("input_scale", NF4_STATE_SLOT):
            working = None  # carried for save (a static activation scale; bitsandbytes' QuantState JSON)
            encoding = "bnb_state" if slot == NF4_STATE_SLOT else encoding
        if working is not None:
            want_shape, want_dtype, _ = S.slot_specs(m)[working]
            if dt in (torch.uint8, _ST_DTYPES["F8_E8M0"]) and working == "weight_scale_inv":
                encoding = "e8m0"  # ue8m0 exponents -> the fp32 powers of two FP8Linear works with
            elif dt != want_dtype:
                raise PrequantizedCheckpointError(f"{plan.key}.{slot}: stored {info.dtype}, {type(m).__name__} needs {want_dtype}")
            elif tuple(info.shape) != tuple(want_shape):
                encoding = "reshape"
        if working != slot and working is not None:
            del m._parameters[working]  # filled from the stored slot after loading
        if working is None:  # carried for save: a slot of its own, stored form = logical form
            S.declare_slots(m, {slot: (tuple(info.shape), dt, 0)})
        _stored_buffer(m, slot, dt, info.shape)
        stored[slot] = StoredSlot(working, dt, tuple(info.shape), encoding)
    keep_buffer_dtype(m, *stored)  # e.g. an fp32 input_scale must survive model.to(bf16) bit for bit
    setattr(m, _STORED_ATTR, stored)
    return m


def _build_experts(plan: ModulePlan, dense):
    """GPT-OSS experts: QuantizedExperts' MXFP4 slots `{P}` / `{P}_scales` are the stored `{P}_blocks` /
    `{P}_scales` byte for byte; only the blocks' name differs."""
    m = QuantizedExperts(dense, MXFP4Format(), dtype=dense.gate_up_proj.dtype, device="meta")
    stored = {}
    for slot, info in plan.slots.items():
        working = slot.removesuffix("_blocks")
        want_shape, want_dtype, _ = S.slot_specs(m)[working]
        if (_st_dtype(info), tuple(info.shape)) != (want_dtype, tuple(want_shape)):
            raise PrequantizedCheckpointError(
                f"{plan.key}.{slot}: stored {_fmt(info)} does not match the experts module's {working} "
                f"{want_dtype} {list(want_shape)}"
            )
        if working != slot:
            del m._parameters[working]
        _stored_buffer(m, slot, want_dtype, info.shape)
        stored[slot] = StoredSlot(working, want_dtype, tuple(info.shape))
    setattr(m, _STORED_ATTR, stored)
    return m


# ---------------------------------------------------------------- experts fused from per-expert linears
_FUSED_ATTR = "_surogate_fused"  # on each fused experts module: its FusedLayout


def _unit_format(fmt: LayerFormat):
    if fmt.kind == "fp8_block":
        return FP8Format(fmt.block, fmt.ue8m0)
    if fmt.kind == "fp8_tensor":
        return FP8Format(None)
    if fmt.kind == "mxfp4":
        return MXFP4Format()
    if fmt.kind == "nf4":
        return NF4Format(fmt.nf4_block, fmt.double_quant)
    return NVFP4Format(four_over_six=False)  # ModelOpt's encode (global = 6 * 448 / amax) when re-quantizing


def _build_fused_experts(plan: ModulePlan, dense):

    first = next(iter(dense.parameters()))
    m = QuantizedExperts(dense, _unit_format(plan.fmt), dtype=first.dtype, device="meta")
    lay = plan.fused
    if lay.input_scale:  # static activation scales: carried for save, the forward scales activations itself
        for p, comps in lay.projections.items():
            S.register_slot(m, f"{p}_input_scale", (lay.num_experts, len(comps)), torch.float32, "meta")
    setattr(m, _FUSED_ATTR, lay)
    if lay.kind == "nf4":
        setattr(m, _FUSED_STATES_ATTR, {})
    return m


def _scale_to_working(t: torch.Tensor, shape) -> torch.Tensor:
    t = _e8m0_bytes_to_float(t) if t.dtype in (torch.uint8, _ST_DTYPES["F8_E8M0"]) else t.float()
    return t.reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


class FuseStoredExperts(ConversionOps):
    """Loading op: per-expert component tensors (as stored) -> the fused experts module's slots.

    FP8 units are per component (blocks never straddle gate and up), so their bytes are stacked as stored.
    NVFP4 holds one global scale per expert for the fused [gate; up]: equal stored globals concatenate exactly;
    different ones are dequantized, fused and re-quantized (warned once per model, naming the first module)."""

    _warned = False

    def __init__(self, sources: dict[tuple[str, str], str]):
        self.sources = sources  # (component, slot) -> the converter's source pattern

    def __repr__(self):
        return f"{type(self).__name__}({sorted(self.sources)})"

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        module_name, _, proj = full_layer_name.rpartition(".")
        m = model.get_submodule(module_name)
        lay: FusedLayout = getattr(m, _FUSED_ATTR)
        comps = lay.projections[proj]
        n_units, rows, k = m.units(proj)
        slot_shapes = m.fmt.slots(rows, k, expert=True)

        def stored(c, slot):
            ts = input_dict[self.sources[(c, slot)]]
            ts = ts if isinstance(ts, list) else [ts]
            if len(ts) != lay.num_experts:
                raise PrequantizedCheckpointError(
                    f"{module_name}: {len(ts)} stored {c}.{slot} tensors for {lay.num_experts} experts"
                )
            return ts

        out = {}
        if lay.kind in ("fp8_block", "fp8_tensor"):
            scale_slot = "weight_scale_inv" if lay.kind == "fp8_block" else "weight_scale"
            ws = [torch.stack(stored(c, "weight")) for c in comps]
            ss = [torch.stack([_scale_to_working(t, slot_shapes["_scale_inv"][0]) for t in stored(c, scale_slot)]) for c in comps]
            out[full_layer_name] = torch.stack(ws, 1) if n_units > 1 else ws[0]
            out[full_layer_name + "_scale_inv"] = torch.stack(ss, 1) if n_units > 1 else ss[0]
        elif lay.kind == "mxfp4":  # no per-tensor scale: the components' rows concatenate exactly
            w = [torch.cat([stored(c, "weight")[e] for c in comps]) for e in range(lay.num_experts)]
            s = [torch.cat([stored(c, "weight_scale")[e] for c in comps]) for e in range(lay.num_experts)]
            out[full_layer_name] = torch.stack(w).reshape((lay.num_experts,) + slot_shapes[""][0])
            out[full_layer_name + "_scales"] = torch.stack(s)
        elif lay.kind == "nf4":  # per-component units: each stored QuantState is stacked as is
            states = getattr(m, _FUSED_STATES_ATTR)  # carried for save, byte for byte
            for c in comps:
                for e, t in enumerate(stored(c, NF4_STATE_SLOT)):
                    states[f"{e}.{c}"] = bytes(t.reshape(-1).tolist())
            for suffix, (shape, _) in slot_shapes.items():
                per_comp = []
                for c in comps:
                    if suffix == _NF4_OFFSET:
                        per_comp.append(torch.stack([_nf4_offset(t, t.device) for t in stored(c, NF4_STATE_SLOT)]))
                    else:
                        per_comp.append(torch.stack([t.reshape(shape) for t in stored(c, "weight" + suffix)]))
                out[full_layer_name + suffix] = torch.stack(per_comp, 1) if n_units > 1 else per_comp[0]
        else:
            per = {c: (stored(c, "weight"), stored(c, "weight_scale"), stored(c, "weight_scale_2")) for c in comps}
            packed, block, glob = [], [], []
            for e in range(lay.num_experts):
                parts = [(per[c][0][e], per[c][1][e], per[c][2][e].reshape(())) for c in comps]
                if all(_same_bits(g, parts[0][2]) for _, _, g in parts):
                    packed.append(torch.cat([w for w, _, _ in parts]))
                    block.append(torch.cat([s for _, s, _ in parts]))
                    glob.append(parts[0][2].float())
                    continue
                if not FuseStoredExperts._warned:
                    FuseStoredExperts._warned = True
                    warnings.warn(
                        f"{module_name}.{proj}: the stored {' and '.join(comps)} of an expert have different NVFP4 global "
                        "scales, while the fused projection holds one per expert; dequantizing, fusing and "
                        "re-quantizing them (values change within NVFP4 rounding). Export with a unified amax "
                        "for fused layers to load them exactly.",
                        stacklevel=2,
                    )
                dense = torch.cat([F.dequantize_nvfp4(w, s, g, torch.float32) for w, s, g in parts])
                q = m.fmt.quantize(dense, expert=True)
                packed.append(q[""])
                block.append(q["_scale"])
                glob.append(q["_scale_2"].reshape(()))
            out[full_layer_name] = torch.stack(packed)
            out[full_layer_name + "_scale"] = torch.stack(block)
            out[full_layer_name + "_scale_2"] = torch.stack(glob)
        if lay.input_scale:
            out[f"{module_name}.{proj}_input_scale"] = torch.stack(
                [torch.stack([t.reshape(()).float() for t in stored(c, "input_scale")]) for c in comps], 1
            )
        return out

    @property
    def reverse_op(self):
        return _ExportedByQuantizer()


class _ExportedByQuantizer(ConversionOps):
    """Reverse of FuseStoredExperts: get_state_dict_and_metadata already writes the per-expert layout, so the
    fused keys this would match never reach transformers' revert step."""

    def convert(self, input_dict, **kwargs):
        raise RuntimeError(f"fused experts keys {list(input_dict)} reached the revert step; they are exported by "
                           "PrequantizedHfQuantizer.get_state_dict_and_metadata")

    @property
    def reverse_op(self):
        return self


@torch.no_grad()
def export_fused(module, prefix: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    lay: FusedLayout = getattr(module, _FUSED_ATTR)
    out, replaced = {}, set()
    for proj, comps in lay.projections.items():
        n_units, rows, k = module.units(proj)
        t = {suffix: S.get_slot(module, proj + suffix) for suffix in module.fmt.slots(rows, k, expert=True)}
        replaced.update(prefix + proj + suffix for suffix in t)
        if lay.input_scale:
            replaced.add(f"{prefix}{proj}_input_scale")
        crows = rows * n_units // len(comps)
        for e in range(lay.num_experts):
            for j, c in enumerate(comps):
                def put(slot, value):
                    dtype, shape = lay.stored[(c, slot)]
                    if dtype in (torch.uint8, _ST_DTYPES["F8_E8M0"]) and slot == "weight_scale_inv":
                        value = _float_to_e8m0(value, dtype)
                    out[f"{prefix}{e}.{c}.{lay.suffix[(c, slot)]}"] = value.to(dtype).reshape(shape).clone()

                if lay.kind in ("fp8_block", "fp8_tensor"):
                    idx = (e, j) if n_units > 1 else (e,)
                    put("weight", t[""][idx])
                    put("weight_scale_inv" if lay.kind == "fp8_block" else "weight_scale", t["_scale_inv"][idx])
                elif lay.kind == "mxfp4":
                    put("weight", t[""][e, j * crows : (j + 1) * crows])
                    put("weight_scale", t["_scales"][e, j * crows : (j + 1) * crows])
                elif lay.kind == "nf4":
                    idx = (e, j) if n_units > 1 else (e,)
                    for cc, slot in lay.suffix:
                        if cc != c:
                            continue
                        if slot == NF4_STATE_SLOT:  # the stored QuantState JSON, byte for byte
                            data = getattr(module, _FUSED_STATES_ATTR)[f"{e}.{c}"]
                            out[f"{prefix}{e}.{c}.{lay.suffix[(c, slot)]}"] = torch.tensor(list(data), dtype=torch.uint8)
                        else:
                            put(slot, t[slot.removeprefix("weight")][idx])
                else:
                    put("weight", t[""][e, j * crows : (j + 1) * crows])
                    put("weight_scale", t["_scale"][e, j * crows : (j + 1) * crows])
                    put("weight_scale_2", t["_scale_2"][e])
                if lay.input_scale:
                    put("input_scale", S.get_slot(module, f"{proj}_input_scale")[e, j])
    return out, replaced


@torch.no_grad()
def adopt_stored(module) -> None:
    """After loading: turn stored encodings into the module's working slots (frozen storage-form Parameters,
    nn/slots.py); freeze the base."""
    stored: dict[str, StoredSlot] = getattr(module, _STORED_ATTR, {})
    for slot, s in stored.items():
        if s.encoding == "bnb_state" and module.fmt.double_quant:
            t = S.raw_slot(module, slot)
            S.set_slot(module, "weight" + _NF4_OFFSET, _nf4_offset(t, t.device))
        t = S.raw_slot(module, slot)
        if t.is_meta:
            raise PrequantizedCheckpointError(f"{slot} of {type(module).__name__} was not filled by the checkpoint")
        if s.working is None:  # carried as stored
            S.set_slot(module, slot, t)
            continue
        if s.encoding == "e8m0":
            t = _e8m0_bytes_to_float(t)
        if s.working != slot:
            module._buffers.pop(slot, None)
        S.set_slot(module, s.working, t.reshape(S.slot_specs(module)[s.working][0]))
    S.finalize_slots(module)  # slots a loading op filled directly (fused experts)
    for p in module.parameters(recurse=False):
        p.requires_grad_(False)
    module.prequantized = True


@torch.no_grad()
def export_stored(module, prefix: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The module's tensors in the stored layout: ({state-dict key: tensor}, working keys they replace)."""
    stored: dict[str, StoredSlot] = getattr(module, _STORED_ATTR)
    out, replaced = {}, set()
    for slot, s in stored.items():
        src = s.working or slot
        t = S.get_slot(module, src)
        if s.encoding == "e8m0":
            t = _float_to_e8m0(t, s.dtype)
        out[prefix + slot] = t.to(s.dtype).reshape(s.shape)
        replaced.add(prefix + src)
        if s.encoding == "bnb_state":  # weight_offset lives in the JSON on disk
            replaced.add(prefix + "weight" + _NF4_OFFSET)
    return out, replaced
