"""What a checkpoint holds (safetensors headers and scales) and the per-module plan checked against it.

Every check runs before any weight loads; errors are collected so one exception names every bad tensor or key.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ...nn.experts import experts_projections, is_experts_module
from ..checkpoint_files import open_safetensors
from .scheme import (
    MXFP4_GROUP,
    NVFP4_GROUP,
    CheckpointScheme,
    LayerFormat,
    PrequantizedCheckpointError,
    _is_gpt_oss_experts,
)

FP8_SCALE_ALIASES = ("weight_scale_inv", "scale", "qscale_weight")  # real exports; transformers renames the same
SCALAR_SHAPES = ((), (1,))
QUANT_LEAVES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "activation_scale")
FLOAT_DTYPES = ("BF16", "F16", "F32")

# bitsandbytes NF4: module slot (NF4Linear buffer) -> checkpoint suffix. Buffer names cannot hold dots, so the
# quantizer renames the stored keys onto the slots while loading (transformers reverts that when saving);
# the QuantState JSON is carried as a uint8 slot and its nested_offset becomes NF4Linear's weight_offset.
NF4_STORED = {
    "weight": "weight",
    "weight_absmax": "weight.absmax",
    "weight_quant_map": "weight.quant_map",
    "weight_nested_absmax": "weight.nested_absmax",
    "weight_nested_quant_map": "weight.nested_quant_map",
    "weight_quant_state": "weight.quant_state.bitsandbytes__nf4",
}
NF4_STATE_SLOT = "weight_quant_state"
NF4_BLOCKS = (64, 128)
NF4_NESTED_BLOCK = 256
_BNB_COMPANION = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__\w+)$")


_ST_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
}


def _st_dtype(info: TensorInfo) -> torch.dtype:
    dt = _ST_DTYPES.get(info.dtype)
    if dt is None:
        raise PrequantizedCheckpointError(f"safetensors dtype {info.dtype} is not supported by this torch")
    return dt



@dataclass
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]


class CheckpointIndex:
    """Names, dtypes and shapes of every tensor (from the safetensors headers; no weight is read)."""

    def __init__(self, files):
        self.files = [f for f in files or [] if f.endswith(".safetensors")]
        if not self.files:
            raise PrequantizedCheckpointError(
                f"pre-quantized loading reads safetensors checkpoints; got {list(files or [])!r}"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            with open_safetensors(path) as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    self.tensors[k] = TensorInfo(path, s.get_dtype(), tuple(s.get_shape()))

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> TensorInfo | None:
        return self.tensors.get(key)

    def read(self, key: str) -> torch.Tensor:
        """One tensor's values (used for small metadata such as bitsandbytes' QuantState JSON)."""
        with open_safetensors(self.tensors[key].file) as f:
            return f.get_tensor(key)


# ---------------------------------------------------------------- the plan: one entry per quantized module
@dataclass
class ModulePlan:
    name: str  # module name in the model
    key: str  # module name in the checkpoint (may differ by the base-model prefix)
    fmt: LayerFormat
    slots: dict[str, TensorInfo]  # slot name on the module -> stored tensor
    stored_names: dict[str, str]  # slot name -> suffix used in the checkpoint (scale aliases)
    fused: "FusedLayout | None" = None  # MoE experts fused on load from per-expert component linears


@dataclass
class FusedLayout:
    """Experts stored as per-expert linears (`{key}.{e}.gate_proj.weight`, ...) and fused into 3-D slots."""

    kind: str
    projections: dict[str, list[str]]  # P -> stored components, e.g. gate_up_proj -> [gate_proj, up_proj]
    suffix: dict[tuple[str, str], str]  # (component, slot) -> stored suffix (scale aliases)
    stored: dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]]  # (component, slot) -> stored dtype, shape
    input_scale: bool
    num_experts: int


def _checkpoint_name(name: str, index: CheckpointIndex, prefix: str, probe: str) -> str:
    """Checkpoints may store `model.layers...` for `layers...` (base model) or the reverse."""
    if f"{name}.{probe}" in index:
        return name
    if prefix and name.startswith(prefix + ".") and f"{name[len(prefix) + 1:]}.{probe}" in index:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}.{probe}" in index:
        return f"{prefix}.{name}"
    return name


def _fmt(info: TensorInfo | None) -> str:
    return "absent" if info is None else f"{info.dtype} {list(info.shape)}"


def plan_modules(model, scheme: CheckpointScheme, index: CheckpointIndex) -> tuple[list[ModulePlan], list[str]]:
    """Decide every module's stored format and check the headers against it. Returns (plans, errors)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    plans, errors = [], []
    claimed: set[str] = set()

    for name, module in model.named_modules():
        if is_experts_module(module) and not (scheme.method == "mxfp4" and _is_gpt_oss_experts(module)):
            plan, errs = _plan_fused_experts(name, module, scheme, index, prefix)
            errors.extend(errs)
            if plan is not None:
                plans.append(plan)
                claimed.update(f"{plan.key}.{plan.stored_names[s]}" for s in plan.slots)
            continue
        fmt = scheme.layer_format(name, module)
        if fmt is not None and fmt.packed_only and not _stored_packed(index, _checkpoint_name(name, index, prefix, "weight")):
            fmt = None  # stored dense: the format quantizes packed-stored linears only
        if fmt is None:
            if isinstance(module, torch.nn.Linear):
                key = _checkpoint_name(name, index, prefix, "weight")
                info = index.get(f"{key}.weight")
                if info is not None and info.dtype not in ("BF16", "F16", "F32"):
                    errors.append(
                        f"{key}.weight is {_fmt(info)} but {scheme.source} keeps {name} unquantized "
                        f"(excluded or not listed); the checkpoint disagrees with its config"
                    )
            continue
        probe = "gate_up_proj_blocks" if fmt.kind == "mxfp4_experts" else "weight"
        key = _checkpoint_name(name, index, prefix, probe)
        fmt, errs = _refine(fmt, module, key, index)
        slots, stored = {}, {}
        if not errs:
            slots, stored, errs = _CHECKS[fmt.kind](module, key, fmt, index)
        errors.extend(f"{e} [{fmt.origin}]" for e in errs)
        if not errs:
            plans.append(ModulePlan(name, key, fmt, slots, stored))
            claimed.update(f"{key}.{stored[s]}" for s in slots)
    # Scale-like tensors no planned module claims: the config and the tensors disagree.
    for key, info in index.tensors.items():
        if key in claimed:
            continue
        base, _, leaf = key.rpartition(".")
        if leaf in ("scale", "qscale_weight"):  # generic names: a scale only next to a non-float weight
            sibling = index.get(f"{base}.weight")
            scale_like = sibling is not None and sibling.dtype not in FLOAT_DTYPES
        elif _BNB_COMPANION.search(key):
            scale_like = True
        else:
            scale_like = leaf in QUANT_LEAVES or leaf.endswith(("_blocks", "_scales"))
        if scale_like:
            errors.append(
                f"{key} ({_fmt(info)}) is a quantization tensor of a module {scheme.source} does not quantize "
                "(excluded, unlisted or of an unsupported type); the checkpoint disagrees with its config"
            )
    return plans, errors


def _stored_packed(index, key: str) -> bool:
    """Whether `{key}.weight` is stored packed (non-float); absent or dense-stored is False."""
    info = index.get(f"{key}.weight")
    return info is not None and info.dtype not in FLOAT_DTYPES


def _expect(index, key, dtypes, shape, errors, what) -> TensorInfo | None:
    info = index.get(key)
    if info is None:
        errors.append(f"missing {what}: {key} not found in the checkpoint")
        return None
    if info.dtype not in dtypes:
        errors.append(f"{key} has dtype {info.dtype}, expected {' or '.join(dtypes)} ({what})")
        return None
    if shape is not None and info.shape not in (shape if isinstance(shape, list) else [shape]):
        want = " or ".join(str(list(s)) for s in (shape if isinstance(shape, list) else [shape]))
        errors.append(f"{key} has shape {list(info.shape)}, expected {want} ({what})")
        return None
    return info


def _weight_disagrees(index, key, expected: str, errors) -> bool:
    info = index.get(f"{key}.weight")
    if info is not None and info.dtype in FLOAT_DTYPES:
        errors.append(f"{key}.weight is {_fmt(info)}: stored dense, but the config says it is {expected}")
        return True
    return False


def _plan_fp8_block(module, key, fmt, index):
    errors, n, k = [], module.out_features, module.in_features
    if _weight_disagrees(index, key, "FP8 block-quantized", errors):
        return {}, {}, errors
    w = _expect(index, f"{key}.weight", ("F8_E4M3",), (n, k), errors, "FP8 E4M3 weight")
    alias = next((a for a in FP8_SCALE_ALIASES if f"{key}.{a}" in index), None)
    if alias is None:
        errors.append(f"missing scale: {key}.weight_scale_inv (or .scale / .qscale_weight) not found in the checkpoint")
        return {}, {}, errors
    bn, bk = fmt.block or (n, k)  # no weight_block_size: one scale for the whole tensor (transformers' reading)
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    dtypes = ("F32", "F8_E8M0", "U8") if fmt.ue8m0 else ("F32",)
    s = _expect(index, f"{key}.{alias}", dtypes, [grid] if fmt.block else [grid, (), (1,)], errors,
                f"fp8 block scale for block {bn}x{bk}")
    slots = {"weight": w, "weight_scale_inv": s}
    return slots, {"weight": "weight", "weight_scale_inv": alias}, errors


def _plan_fp8_tensor(module, key, fmt, index):
    errors, n, k = [], module.out_features, module.in_features
    if _weight_disagrees(index, key, "ModelOpt FP8", errors):
        return {}, {}, errors
    w = _expect(index, f"{key}.weight", ("F8_E4M3",), (n, k), errors, "ModelOpt FP8 weight")
    s = _expect(index, f"{key}.weight_scale", ("F32",), list(SCALAR_SHAPES), errors, "ModelOpt FP8 per-tensor weight_scale")
    slots = {"weight": w, "weight_scale": s}
    if f"{key}.input_scale" in index:
        slots["input_scale"] = _expect(index, f"{key}.input_scale", ("F32",), list(SCALAR_SHAPES), errors, "input_scale")
    return slots, {s_: s_ for s_ in slots}, errors


def _plan_nvfp4(module, key, fmt, index):
    errors, n, k = [], module.out_features, module.in_features
    if k % NVFP4_GROUP:
        return {}, {}, [f"{key}: in_features {k} is not divisible by the NVFP4 block ({NVFP4_GROUP})"]
    if _weight_disagrees(index, key, "NVFP4", errors):
        return {}, {}, errors
    w = _expect(index, f"{key}.weight", ("U8",), (n, k // 2), errors, "NVFP4 packed E2M1 weight (uint8 [N, K/2])")
    s = _expect(index, f"{key}.weight_scale", ("F8_E4M3",), (n, k // NVFP4_GROUP), errors,
                "NVFP4 block scale (E4M3 [N, K/16])")
    g = _expect(index, f"{key}.weight_scale_2", ("F32",), list(SCALAR_SHAPES), errors, "NVFP4 global scale weight_scale_2")
    slots = {"weight": w, "weight_scale": s, "weight_scale_2": g}
    if f"{key}.input_scale" in index:
        slots["input_scale"] = _expect(index, f"{key}.input_scale", ("F32",), list(SCALAR_SHAPES), errors, "input_scale")
    return slots, {s_: s_ for s_ in slots}, errors


def _plan_mxfp4(module, key, fmt, index):
    """Dense linear: weight uint8 [N, K/2] (two E2M1, even element in the low nibble) + weight_scale E8M0 bytes."""
    errors, n, k = [], module.out_features, module.in_features
    if k % MXFP4_GROUP:
        return {}, {}, [f"{key}: in_features {k} is not divisible by the MXFP4 block ({MXFP4_GROUP})"]
    if _weight_disagrees(index, key, "MXFP4", errors):
        return {}, {}, errors
    w = _expect(index, f"{key}.weight", ("U8",), (n, k // 2), errors, "MXFP4 packed E2M1 weight (uint8 [N, K/2])")
    s = _expect(index, f"{key}.weight_scale", ("U8",), (n, k // MXFP4_GROUP), errors,
                "MXFP4 E8M0 block scale (uint8 [N, K/32])")
    return {"weight": w, "weight_scale": s}, {"weight": "weight", "weight_scale": "weight_scale"}, errors


def _refine(fmt: LayerFormat, module, key: str, index) -> tuple[LayerFormat, list[str]]:
    """nf4: blocksize and double quantization are per tensor, in the stored QuantState; other kinds as given."""
    if fmt.kind != "nf4":
        return fmt, []
    errors: list[str] = []
    if _weight_disagrees(index, key, "NF4 (bitsandbytes)", errors):
        return fmt, errors
    state_key = f"{key}.{NF4_STORED[NF4_STATE_SLOT]}"
    if state_key not in index:
        other = [k for k in index.tensors if k.startswith(f"{key}.weight.quant_state.")]
        if other:
            return fmt, [f"{other[0]}: bitsandbytes 4-bit type other than nf4 is not supported"]
        return fmt, [f"missing NF4 QuantState: {state_key} not found in the checkpoint"]
    if index.get(state_key).dtype != "U8":
        return fmt, [f"{state_key} has dtype {index.get(state_key).dtype}, expected U8 (bitsandbytes QuantState JSON)"]
    try:
        state = json.loads(bytes(index.read(state_key).reshape(-1).tolist()))
    except ValueError as exc:
        return fmt, [f"{state_key}: not a bitsandbytes QuantState JSON ({exc})"]
    n, k = module.out_features, module.in_features
    block = state.get("blocksize")
    nested = "nested_blocksize" in state or "nested_offset" in state
    if state.get("quant_type") != "nf4":
        errors.append(f"{state_key}: quant_type {state.get('quant_type')!r}, expected 'nf4'")
    if list(state.get("shape") or []) != [n, k]:
        errors.append(f"{state_key}: shape {state.get('shape')}, expected [{n}, {k}] (the module's [out, in])")
    if block not in NF4_BLOCKS:
        errors.append(f"{state_key}: blocksize {block!r} unsupported; expected one of {NF4_BLOCKS}")
    elif k % block:
        # bitsandbytes' CPU dequantize misdecodes blocks that straddle rows; NF4Linear keeps whole-row blocks
        errors.append(f"{key}: in_features {k} is not divisible by the NF4 blocksize ({block})")
    if nested and (state.get("nested_blocksize") != NF4_NESTED_BLOCK or not isinstance(state.get("nested_offset"), (int, float))):
        errors.append(f"{state_key}: nested_blocksize {state.get('nested_blocksize')!r} / nested_offset "
                      f"{state.get('nested_offset')!r}; expected {NF4_NESTED_BLOCK} and a number")
    has_nested = f"{key}.{NF4_STORED['weight_nested_absmax']}" in index
    if nested != has_nested:
        errors.append(f"{state_key}: the QuantState says nested={nested} but {key}.weight.nested_absmax is "
                      f"{'present' if has_nested else 'absent'}")
    if errors:
        return fmt, errors
    return LayerFormat("nf4", origin=fmt.origin, nf4_block=int(block), double_quant=nested,
                       packed_only=fmt.packed_only), []


def _plan_nf4(module, key, fmt, index):
    """bitsandbytes layout, checked against the QuantState read by `_refine` (fmt.nf4_block, fmt.double_quant)."""
    errors, n, k = [], module.out_features, module.in_features
    nb = n * k // fmt.nf4_block
    want = {
        "weight": (("U8",), (n * k // 2, 1), "NF4 packed weight (uint8 [N*K/2, 1])"),
        "weight_absmax": (("U8",) if fmt.double_quant else ("F32",), (nb,), "NF4 block absmax"),
        "weight_quant_map": (("F32",), (16,), "NF4 quant_map"),
    }
    if fmt.double_quant:
        want["weight_nested_absmax"] = (("F32",), (-(-nb // NF4_NESTED_BLOCK),), "NF4 nested absmax")
        want["weight_nested_quant_map"] = (("F32",), (256,), "NF4 nested quant_map")
    slots = {s: _expect(index, f"{key}.{NF4_STORED[s]}", d, shp, errors, what) for s, (d, shp, what) in want.items()}
    slots[NF4_STATE_SLOT] = index.get(f"{key}.{NF4_STORED[NF4_STATE_SLOT]}")
    return slots, {s: NF4_STORED[s] for s in slots}, errors


def _plan_mxfp4_experts(module, key, fmt, index):
    errors, slots = [], {}
    e = module.num_experts
    h, i = module.hidden_size, module.intermediate_size
    for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        if k % MXFP4_GROUP:
            errors.append(f"{key}.{proj}: input dimension {k} is not divisible by the MXFP4 block ({MXFP4_GROUP})")
            continue
        dense = index.get(f"{key}.{proj}")
        if dense is not None:
            errors.append(f"{key}.{proj} is stored dense ({_fmt(dense)}), but the config says MXFP4 experts")
            continue
        slots[f"{proj}_blocks"] = _expect(index, f"{key}.{proj}_blocks", ("U8",), (e, rows, k // MXFP4_GROUP, 16), errors,
                                          "MXFP4 expert blocks (uint8 [E, rows, K/32, 16])")
        slots[f"{proj}_scales"] = _expect(index, f"{key}.{proj}_scales", ("U8",), (e, rows, k // MXFP4_GROUP), errors,
                                          "MXFP4 expert E8M0 scales (uint8 [E, rows, K/32])")
    return slots, {s: s for s in slots}, errors


_CHECKS = {"fp8_block": _plan_fp8_block, "fp8_tensor": _plan_fp8_tensor, "nvfp4": _plan_nvfp4, "mxfp4": _plan_mxfp4,
           "nf4": _plan_nf4, "mxfp4_experts": _plan_mxfp4_experts}
FUSABLE = ("fp8_block", "fp8_tensor", "nvfp4", "mxfp4", "nf4")  # kinds per-expert linears can be fused from


def _components(p: str, comps: int) -> list[str]:
    if p == "gate_up_proj":
        return ["gate_proj", "up_proj"] if comps == 2 else []
    return [p]


def _plan_fused_experts(name, module, scheme, index, prefix):
    """Experts whose checkpoint stores one linear per expert and component; None when they are stored dense."""
    projections = experts_projections(module)
    num_experts = next(iter(module._parameters[p] for p in projections)).shape[0]
    comps = {p: _components(p, c) for p, (_, _, c) in projections.items()}
    first = next(c for cs in comps.values() for c in cs) if any(comps.values()) else None
    key = _checkpoint_name(name, index, prefix, f"0.{first}.weight") if first else name
    fmts = {(e, c): scheme.linear_format(f"{name}.{e}.{c}") for p in comps for c in comps[p] for e in range(num_experts)}
    kinds = {(f.kind, f.block, f.ue8m0) if f else None for f in fmts.values()}
    if kinds == {None} or not fmts:
        return None, []
    if None in kinds or len(kinds) > 1:
        return None, [f"{name}: its experts' projections are stored in different formats ({sorted(map(str, kinds))}); "
                      "surogate_hf's fused experts hold one format per experts module"]
    fmt = next(iter(fmts.values()))
    if fmt.kind not in FUSABLE:
        return None, [f"{name}: experts in {fmt.kind} are not supported"]
    if fmt.kind in ("mxfp4", "nf4") and not _stored_packed(index, f"{key}.0.{first}"):
        return None, []  # transformers' mxfp4 / bitsandbytes readers keep such experts dense: stored dense here
    errors = []
    if any(module._parameters.get(p + "_bias") is not None for p in projections):
        errors.append(f"{name}: fused experts with biases are not supported for per-expert checkpoints")
    for p in projections:
        if not comps[p]:
            errors.append(f"{name}.{p}: interleaved (non-concatenated) gate/up experts cannot be fused from components")
        if f"{key}.{p}" in index:
            errors.append(f"{key}.{p} is stored dense ({_fmt(index.get(f'{key}.{p}'))}), but the config says "
                          f"{fmt.kind} [{fmt.origin}]")
    if errors:
        return None, errors
    check = _CHECKS[fmt.kind]
    slots, stored_names, suffix, stored, has_input = {}, {}, {}, {}, set()
    unit_fmts = set()
    for p, (n, k, _) in projections.items():
        rows = n // len(comps[p])
        for c in comps[p]:
            for e in range(num_experts):
                unit_key = f"{key}.{e}.{c}"
                unit = SimpleNamespace(out_features=rows, in_features=k)
                ufmt, errs = _refine(fmt, unit, unit_key, index)
                s_, names = {}, {}
                if not errs:
                    unit_fmts.add(ufmt)
                    s_, names, errs = check(unit, unit_key, ufmt, index)
                errors.extend(f"{x} [{fmt.origin}]" for x in errs)
                has_input.add("input_scale" in s_)
                for slot, info in s_.items():
                    if info is None:
                        continue
                    prev = suffix.setdefault((c, slot), names[slot])
                    if prev != names[slot]:
                        errors.append(f"{unit_key}.{names[slot]}: named differently from {key}.0.{c}.{prev} in the same experts")
                    stored.setdefault((c, slot), (_st_dtype(info), tuple(info.shape)))
                    slots[f"{e}.{c}.{slot}"] = info
                    stored_names[f"{e}.{c}.{slot}"] = f"{e}.{c}.{names[slot]}"
    if len(has_input) > 1:
        errors.append(f"{key}: input_scale is stored for some experts' projections and not for others")
    if len(unit_fmts) > 1:
        seen = sorted({(f.nf4_block, f.double_quant) for f in unit_fmts})
        errors.append(f"{key}: its experts' NF4 QuantStates differ in (blocksize, double quantization) {seen}; "
                      "surogate_hf's fused experts hold one format per experts module")
    if errors:
        return None, errors
    fmt = unit_fmts.pop() if unit_fmts else fmt
    layout = FusedLayout(fmt.kind, comps, suffix, stored, has_input == {True}, num_experts)
    return ModulePlan(name, key, fmt, slots, stored_names, fused=layout), []


# ---------------------------------------------------------------- scale values
def check_scale_values(plans: list[ModulePlan], index: CheckpointIndex) -> list[str]:
    """NaN / inf / negative scales, read once before loading (scales are <= 1/16 of the checkpoint's bytes)."""
    by_file: dict[str, list[tuple[ModulePlan, str]]] = {}
    for p in plans:
        for slot in p.slots:
            leaf = slot.rsplit(".", 1)[-1]
            if leaf != "weight" and not leaf.endswith("_blocks") and leaf != NF4_STATE_SLOT:
                by_file.setdefault(index.get(f"{p.key}.{p.stored_names[slot]}").file, []).append((p, slot))
    errors = []
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for p, slot in entries:
                key, leaf = f"{p.key}.{p.stored_names[slot]}", slot.rsplit(".", 1)[-1]
                scale = f.get_tensor(key)
                problems = _scale_problems(key, leaf, scale, p.fmt.kind)
                if not problems and (p.fmt.kind, leaf) in _BLOCK_SCALES and bool((scale.float() == 0).any()):
                    problems = _zero_scale_problems(p, slot, key, scale, index)
                errors.extend(problems)
    return errors


# (kind, scale leaf) -> mask of the stored code bits that make an element non-zero (E4M3 bytes: all but the sign;
# packed E2M1 bytes: all but each nibble's sign). A zero scale over such codes decodes them to zero.
_BLOCK_SCALES = {("fp8_block", "weight_scale_inv"): 0x7F, ("fp8_tensor", "weight_scale"): 0x7F, ("nvfp4", "weight_scale"): 0x77}


def _zero_scale_problems(p: ModulePlan, slot: str, key: str, scale: torch.Tensor, index: CheckpointIndex) -> list[str]:
    """A zero scale is only right over a block of zero codes; over non-zero codes it silently zeroes the weights."""
    stem = slot.rpartition(".")[0]
    codes = index.read(f"{p.key}.{p.stored_names[stem + '.weight' if stem else 'weight']}")
    nonzero = (codes.contiguous().view(torch.uint8) & _BLOCK_SCALES[(p.fmt.kind, slot.rsplit('.', 1)[-1])]) != 0
    n, kb = nonzero.shape
    if p.fmt.kind == "nvfp4":
        bn, bk = 1, NVFP4_GROUP // 2  # one E4M3 scale per 16 elements = 8 packed bytes of a row
    elif p.fmt.kind == "fp8_block" and p.fmt.block is not None and scale.numel() > 1:
        bn, bk = p.fmt.block
    else:
        bn, bk = n, kb  # one scale for the whole tensor
    gn, gk = math.ceil(n / bn), math.ceil(kb / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.bool, device=nonzero.device)  # not the meta default of loading
    padded[:n, :kb] = nonzero
    blocks_nonzero = padded.reshape(gn, bn, gk, bk).any(dim=3).any(dim=1)
    bad = int(((scale.float().reshape(gn, gk) == 0) & blocks_nonzero).sum())
    if not bad:
        return []
    return [f"{key}: {bad} zero scale(s) over blocks of non-zero codes (they would decode to zeros)"]


def _scale_problems(key: str, leaf: str, t: torch.Tensor, kind: str = "") -> list[str]:
    if kind == "nf4":
        if t.dtype == torch.uint8:  # double-quantized absmax: 8-bit codes, every byte is valid
            return []
        v = t.float()
        nonfinite = int((~torch.isfinite(v)).sum())
        if nonfinite:
            return [f"{key}: {nonfinite} NaN/inf value(s)"]
        if leaf in ("weight_absmax", "weight_nested_absmax") and bool((v < 0).any()):
            return [f"{key}: negative absmax value(s) (min {v.min().item():g})"]
        return []  # quant maps hold signed levels
    if t.dtype == torch.uint8:  # E8M0 bytes (MXFP4 scales, ue8m0 FP8 scales): 255 is NaN
        bad = int((t == 255).sum())
        return [f"{key}: {bad} E8M0 scale byte(s) are 255 (NaN)"] if bad else []
    v = t.float()
    nonfinite = int((~torch.isfinite(v)).sum())
    if nonfinite:
        return [f"{key}: {nonfinite} NaN/inf value(s) in the scale"]
    if bool((v < 0).any()):
        return [f"{key}: negative scale value(s) (min {v.min().item():g})"]
    if leaf == "weight_scale_2" and bool((v == 0).all()):
        return [f"{key}: the global scale is zero"]
    return []


def raise_if_errors(errors: list[str], scheme: CheckpointScheme, limit: int = 20) -> None:
    if not errors:
        return
    shown = "\n  - ".join(errors[:limit])
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    raise PrequantizedCheckpointError(
        f"cannot load the pre-quantized checkpoint in {scheme.source} as stored ({len(errors)} problem(s)); "
        f"nothing was loaded:\n  - {shown}{more}"
    )


