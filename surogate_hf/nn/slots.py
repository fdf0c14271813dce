"""Packed weights and scales of the quantized modules as frozen Parameters in integer storage.

Why Parameters and not buffers: FSDP2 (`fully_shard`) shards only parameters (buffers stay whole on every
rank), and DDP broadcasts every buffer from rank 0 before each forward. Frozen parameters are sharded by the
one and left alone by the other.

Why integer storage: FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` casts every floating parameter it
all-gathers, float8 and fp32 included, and leaves integer ones untouched. So a slot whose logical dtype is
floating (e4m3 weights, fp32 / e4m3 scales) is held as an integer view of the same bytes (uint8 / int16 /
int32) and reinterpreted at call time. FSDP2 also cannot shard 0-dim parameters: a 0-dim slot is held as [1].

Each module declares its slots' logical (shape, dtype) once (`declare_slots`); `get_slot` reads the module's
current attribute at call time (FSDP re-sets parameters on every unshard) and returns the logical view.
The module's `state_dict()` holds the storage form (keys unchanged); the quantizers' export paths write the
logical dtypes and shapes to checkpoint files, and loaders may fill a slot in either form (`finalize_slots`
turns whatever was loaded into the storage form).

Parameter counts: `PackedParameter.numel()` reports the weights a slot represents, the way transformers and
PEFT count bitsandbytes' 4-bit weights (two per stored byte), and 0 for scales and other companions, so
`model.num_parameters()` and PEFT's `print_trainable_parameters` match the dense model. The true element
count stays available as `torch.numel(p)` / `p.nbytes`. Once FSDP2 shards a module its parameters are plain
DTensors again and count their stored elements.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SPECS_ATTR = "_surogate_slot_specs"  # on each quantized module: {slot name: (logical shape, logical dtype)}
# on a module: what it derives from its slots' values (QuantizedLinear.slots_loaded), dropped whenever a slot is set
DERIVED_ATTR = "_surogate_slot_derived"
_STORAGE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PackedParameter(nn.Parameter):
    """A frozen packed slot. `represents` = weights represented per stored element (2 for packed 4-bit
    data, 1 for fp8, 0 for scales and companions); `numel()` reports stored elements x represents."""

    def __new__(cls, data: Tensor, represents: int = 1):
        p = super().__new__(cls, data, requires_grad=False)
        p.represents = int(represents)
        return p

    def numel(self) -> int:
        return torch.numel(self) * getattr(self, "represents", 1)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        result = type(self)(self.data.clone(memory_format=torch.preserve_format), self.represents)
        memo[id(self)] = result
        return result

    def __repr__(self):
        return f"PackedParameter(represents={self.represents}) containing:\n{self.data!r}"

    def __reduce_ex__(self, protocol):
        # nn.Parameter's own reduce rebuilds a plain Parameter: keep the class (and its count) through pickle
        return (_rebuild_packed, (self.data, self.represents))


def _rebuild_packed(data: Tensor, represents: int) -> PackedParameter:
    return PackedParameter(data, represents)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    if not (dtype.is_floating_point or dtype.is_complex):
        return dtype
    return _STORAGE_DTYPES[dtype.itemsize]


def storage_shape(shape) -> tuple[int, ...]:
    return tuple(shape) if len(shape) else (1,)


def to_storage(t: Tensor, represents: int = 0) -> PackedParameter:
    """A frozen PackedParameter holding the bytes of `t` in its integer storage form."""
    t = t.detach()
    if isinstance(t, nn.Parameter):
        t = t.data
    sd = storage_dtype(t.dtype)
    if sd != t.dtype:
        t = t.view(sd)
    if t.dim() == 0:
        t = t.reshape(1)
    return PackedParameter(t, represents)


def logical_view(t: Tensor, shape, dtype: torch.dtype) -> Tensor:
    """The logical (shape, dtype) view of a slot tensor held in either form. A sharded (DTensor) slot is
    all-gathered first: a collective, so every rank must call it (e.g. dequantize() outside forward)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    # a plain tensor (same storage and version counter), never the PackedParameter: its numel() counts
    # represented weights, which code sizing buffers from numel() (bitsandbytes) must not see
    t = t.detach()
    if t.dtype != dtype:
        t = t.view(dtype)
    if tuple(t.shape) != tuple(shape):
        t = t.reshape(shape)
    return t


def declare_slots(module: nn.Module, specs: dict[str, tuple[tuple[int, ...], torch.dtype, int]]) -> None:
    """Record slots' logical (shape, dtype, represents); later declarations of a name replace earlier ones."""
    current = dict(module.__dict__.get(SPECS_ATTR, {}))
    current.update({n: (tuple(s), d, int(r)) for n, (s, d, r) in specs.items()})
    object.__setattr__(module, SPECS_ATTR, current)


def forget_slot(module: nn.Module, name: str) -> None:
    specs = dict(module.__dict__.get(SPECS_ATTR, {}))
    specs.pop(name, None)
    object.__setattr__(module, SPECS_ATTR, specs)
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)


def slot_specs(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    return module.__dict__.get(SPECS_ATTR, {})


def _logical_to_storage_on_load(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: a slot given in its logical form (e.g. an fp32 scale from an older
    state_dict) becomes the storage form first; copying fp32 into the int32 Parameter would cast values."""
    from torch.distributed.tensor import DTensor

    for name, (shape, dtype, _) in slot_specs(module).items():
        v = state_dict.get(prefix + name)
        if v is None or isinstance(v, DTensor) or v.dtype != dtype:
            continue
        sd = storage_dtype(dtype)
        state_dict[prefix + name] = (v.view(sd) if sd != dtype else v).reshape(storage_shape(shape))


def register_slot(module: nn.Module, name: str, shape, dtype: torch.dtype, device, represents: int = 0) -> None:
    """Declare a slot and give it an empty storage-form Parameter (on meta until loaded)."""
    if SPECS_ATTR not in module.__dict__:
        module.register_load_state_dict_pre_hook(_logical_to_storage_on_load)
    declare_slots(module, {name: (shape, dtype, represents)})
    empty = torch.empty(storage_shape(shape), dtype=storage_dtype(dtype), device=device)
    module._buffers.pop(name, None)
    module._parameters[name] = PackedParameter(empty, represents)


def raw_slot(module: nn.Module, name: str) -> Tensor:
    """The tensor object held for a slot (a Parameter, or a buffer while a loader fills it)."""
    t = module._parameters.get(name)
    return t if t is not None else module._buffers[name]


def set_slot(module: nn.Module, name: str, value: Tensor) -> None:
    """Store a slot value given in its logical form (or already in storage form)."""
    shape, dtype, represents = slot_specs(module)[name]
    if value.dtype not in (dtype, storage_dtype(dtype)):
        raise TypeError(f"{type(module).__name__}.{name}: got dtype {value.dtype}, expected {dtype}")
    if tuple(value.shape) not in (tuple(shape), storage_shape(shape)):
        raise ValueError(f"{type(module).__name__}.{name}: got shape {list(value.shape)}, expected {list(shape)}")
    module._buffers.pop(name, None)
    module._parameters[name] = to_storage(value, represents)
    module.__dict__.pop(DERIVED_ATTR, None)
    release = getattr(module, "_release_graph_operands", None)  # registered operands would now be stale
    if release is not None:
        release()


def get_slot(module: nn.Module, name: str) -> Tensor:
    """A slot in its logical form, read from the module now (FSDP re-sets parameters on unshard)."""
    shape, dtype, _ = slot_specs(module)[name]
    return logical_view(raw_slot(module, name), shape, dtype)


def is_storage_form(module: nn.Module, name: str) -> bool:
    t = module._parameters.get(name)
    if not isinstance(t, PackedParameter) or t.requires_grad:
        return False
    shape, dtype, _ = slot_specs(module)[name]
    return t.dtype == storage_dtype(dtype) and tuple(t.shape) == storage_shape(shape)


@torch.no_grad()
def finalize_slots(module: nn.Module) -> None:
    """After a loader filled slots (as buffers or Parameters, logical or storage form): every declared slot
    becomes a frozen storage-form PackedParameter. Raises naming a slot that is missing or still on meta."""
    for name, (shape, dtype, _) in slot_specs(module).items():
        t = module._parameters.get(name)
        if t is None:
            t = module._buffers.get(name)
        if t is None:
            raise RuntimeError(f"{type(module).__name__}: slot {name!r} is missing")
        if t.is_meta:
            raise RuntimeError(f"{type(module).__name__}: slot {name!r} was not loaded (still on meta)")
        if is_storage_form(module, name):
            continue
        v = t.detach()
        if v.dtype == storage_dtype(dtype) and v.dtype != dtype:
            v = v.view(dtype)
        set_slot(module, name, v.reshape(shape))
    loaded = getattr(module, "slots_loaded", None)  # the module rebuilds what it derives from the values
    if loaded is not None:
        loaded()


def named_slots(module: nn.Module) -> dict[str, Tensor]:
    """{slot name: logical view} of a module's declared slots that hold a tensor now."""
    return {
        n: get_slot(module, n) for n in slot_specs(module) if n in module._parameters or n in module._buffers
    }
