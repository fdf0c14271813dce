"""Quantized modules built from a plan: slots exactly as stored, adoption into working encodings after loading,
export back to the stored layout, and the loading op that fuses per-expert MoE linears."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers.core_model_loading import ConversionOps

from ...nn import slots as S
from ...nn.experts import QuantizedExperts
from ...nn.formats import LAYOUTS, make_format
from ...nn.formats.fp8 import e8m0_bytes_to_float, float_to_e8m0
from ...nn.linear import keep_buffer_dtype, linear_class
from .checkpoint import FusedLayout, ModulePlan, _fmt, _st_dtype
from .scheme import LayerFormat, PrequantizedCheckpointError

# What differs between layouts (slot names, stored encodings, carried metadata, fusing per-expert tensors) is
# asked of the layout's home in nn/formats/ (`LAYOUTS[kind]`); this module builds, adopts and exports generically.

_STORED_ATTR = "_surogate_stored"  # on each loaded module: {stored slot name: StoredSlot}
_LAYOUT_ATTR = "_surogate_layout"  # on each loaded module: its layout kind (nn/formats LAYOUTS)


@dataclass(frozen=True)
class StoredSlot:
    working: str | None  # the module's own slot it feeds (None: carried only, e.g. a static input_scale)
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str = "same"  # same | e8m0 (power-of-two scale bytes) | reshape | metadata (e.g. QuantState JSON, carried)
    derived: tuple[str, ...] = ()  # metadata: the working slots filled from it (Layout.derive)


_FUSED_STATES_ATTR = "_surogate_bnb_states"  # fused experts: {"{expert}.{component}": metadata bytes (QuantState JSON)}


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
    layout = LAYOUTS.get(kind)
    if layout is not None and layout.experts:
        return _build_experts(plan, dense, layout)
    if layout is None:
        raise PrequantizedCheckpointError(f"{plan.key}: no linear module for stored format {kind!r}")
    bias = dense.bias is not None
    dtype = dense.weight.dtype
    m = linear_class(layout.format)(dense.in_features, dense.out_features, bias, "meta", dtype,
                                    **layout.module_options(plan.fmt))
    derived = layout.derived_slots(plan.fmt)
    for slot in derived:
        del m._parameters[slot]  # not a stored tensor: adopt_stored derives it from the carried metadata
    stored = {}
    for slot, info in plan.slots.items():
        dt = _st_dtype(info)
        working = layout.working_name(slot)
        encoding = "same"
        if slot in layout.carried:
            working = None  # carried for save (a static activation scale; bitsandbytes' QuantState JSON)
            encoding = "metadata" if slot == layout.metadata_slot else encoding
        if working is not None:
            want_shape, want_dtype, _ = S.slot_specs(m)[working]
            encoding = layout.stored_encoding(working, dt)
            if encoding is None and dt != want_dtype:
                raise PrequantizedCheckpointError(f"{plan.key}.{slot}: stored {info.dtype}, {type(m).__name__} needs {want_dtype}")
            elif encoding is None:
                encoding = "reshape" if tuple(info.shape) != tuple(want_shape) else "same"
        if working != slot and working is not None:
            del m._parameters[working]  # filled from the stored slot after loading
        if working is None:  # carried for save: a slot of its own, stored form = logical form
            S.declare_slots(m, {slot: (tuple(info.shape), dt, 0)})
        _stored_buffer(m, slot, dt, info.shape)
        stored[slot] = StoredSlot(working, dt, tuple(info.shape), encoding, derived if encoding == "metadata" else ())
    keep_buffer_dtype(m, *stored)  # e.g. an fp32 input_scale must survive model.to(bf16) bit for bit
    setattr(m, _STORED_ATTR, stored)
    setattr(m, _LAYOUT_ATTR, kind)
    return m


def _build_experts(plan: ModulePlan, dense, layout):
    """Natively fused experts (GPT-OSS MXFP4): QuantizedExperts' slots are the stored tensors byte for byte;
    only names may differ (`layout.working_name`)."""
    m = QuantizedExperts(dense, _unit_format(plan.fmt), dtype=dense.gate_up_proj.dtype, device="meta")
    stored = {}
    for slot, info in plan.slots.items():
        working = layout.working_name(slot)
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
    setattr(m, _LAYOUT_ATTR, plan.fmt.kind)
    return m


# ---------------------------------------------------------------- experts fused from per-expert linears
_FUSED_ATTR = "_surogate_fused"  # on each fused experts module: its FusedLayout


def _unit_format(fmt: LayerFormat):
    layout = LAYOUTS[fmt.kind]
    return make_format(layout.format, **layout.module_options(fmt))


def _build_fused_experts(plan: ModulePlan, dense):

    first = next(iter(dense.parameters()))
    m = QuantizedExperts(dense, _unit_format(plan.fmt), dtype=first.dtype, device="meta")
    lay = plan.fused
    if lay.input_scale:  # static activation scales: carried for save, the forward scales activations itself
        for p, comps in lay.projections.items():
            S.register_slot(m, f"{p}_input_scale", (lay.num_experts, len(comps)), torch.float32, "meta")
    setattr(m, _FUSED_ATTR, lay)
    if LAYOUTS[lay.kind].metadata_slot:
        setattr(m, _FUSED_STATES_ATTR, {})
    return m


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

        layout = LAYOUTS[lay.kind]
        if layout.metadata_slot:  # carried for save, byte for byte
            states = getattr(m, _FUSED_STATES_ATTR)
            for c in comps:
                for e, t in enumerate(stored(c, layout.metadata_slot)):
                    states[f"{e}.{c}"] = bytes(t.reshape(-1).tolist())

        def warn(message):
            if not FuseStoredExperts._warned:
                FuseStoredExperts._warned = True
                warnings.warn(f"{module_name}.{proj}: {message}", stacklevel=4)  # convert's caller

        fused = layout.fuse(stored, comps, lay.num_experts, slot_shapes, n_units, m.fmt, warn)
        out = {full_layer_name + suffix: t for suffix, t in fused.items()}
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
        layout = LAYOUTS[lay.kind]
        for e in range(lay.num_experts):
            for j, c in enumerate(comps):
                def put(slot, value):
                    dtype, shape = lay.stored[(c, slot)]
                    if layout.stored_encoding(slot, dtype) == "e8m0":
                        value = float_to_e8m0(value, dtype)
                    out[f"{prefix}{e}.{c}.{lay.suffix[(c, slot)]}"] = value.to(dtype).reshape(shape).clone()

                tensors = layout.split(t, e, j, crows, n_units)
                for cc, slot in lay.suffix:  # in stored order
                    if cc != c:
                        continue
                    if slot == layout.metadata_slot:  # the stored metadata (QuantState JSON), byte for byte
                        data = getattr(module, _FUSED_STATES_ATTR)[f"{e}.{c}"]
                        out[f"{prefix}{e}.{c}.{lay.suffix[(c, slot)]}"] = torch.tensor(list(data), dtype=torch.uint8)
                    elif slot in tensors:
                        put(slot, tensors[slot])
                if lay.input_scale:
                    put("input_scale", S.get_slot(module, f"{proj}_input_scale")[e, j])
    return out, replaced


@torch.no_grad()
def adopt_stored(module) -> None:
    """After loading: turn stored encodings into the module's working slots (frozen storage-form Parameters,
    nn/slots.py); freeze the base."""
    stored: dict[str, StoredSlot] = getattr(module, _STORED_ATTR, {})
    for slot, s in stored.items():
        if s.derived:  # working slots held in carried metadata (NF4's weight_offset in the QuantState JSON)
            t = S.raw_slot(module, slot)
            for name, value in LAYOUTS[getattr(module, _LAYOUT_ATTR)].derive(slot, t, module.fmt).items():
                S.set_slot(module, name, value)
        t = S.raw_slot(module, slot)
        if t.is_meta:
            raise PrequantizedCheckpointError(f"{slot} of {type(module).__name__} was not filled by the checkpoint")
        if s.working is None:  # carried as stored
            S.set_slot(module, slot, t)
            continue
        if s.encoding == "e8m0":
            t = e8m0_bytes_to_float(t)
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
            t = float_to_e8m0(t, s.dtype)
        out[prefix + slot] = t.to(s.dtype).reshape(s.shape)
        replaced.add(prefix + src)
        if s.encoding == "metadata":  # slots derived from it (weight_offset) live in the metadata on disk
            replaced.update(prefix + d for d in s.derived)
    return out, replaced
