"""What a checkpoint holds (safetensors headers and scales) and the per-module plan checked against it.

Every check runs before any weight loads; errors are collected so one exception names every bad tensor or key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ...nn.experts import experts_projections, is_experts_module
from ...nn.formats import LAYOUTS
from ...nn.formats.base import FLOAT_DTYPES, SCALAR_SHAPES  # noqa: F401  (re-exported)
from ...nn.formats.base import describe as _fmt
from ...nn.formats.fp8 import FP8_SCALE_ALIASES  # noqa: F401  (re-exported)
from ...nn.formats.nf4 import BNB_COMPANION as _BNB_COMPANION
from ...nn.formats.nf4 import NF4_NESTED_BLOCK, NF4_STATE_SLOT, NF4_STORED  # noqa: F401  (re-exported)
from ..checkpoint_files import open_safetensors
from .scheme import CheckpointScheme, LayerFormat, PrequantizedCheckpointError, _is_gpt_oss_experts

# The per-layout checks (headers, QuantState, scale geometry) live with each format in nn/formats/ (`Layout`);
# this module walks the model, asks `LAYOUTS[kind]`, and collects every error before anything loads.
QUANT_LEAVES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "activation_scale")


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
        layout = LAYOUTS[fmt.kind]
        fmt, errs = layout.refine(fmt, module, key, index)
        slots, stored = {}, {}
        if not errs:
            slots, stored, errs = layout.check(module, key, fmt, index)
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
    layout = LAYOUTS[fmt.kind]
    if layout.experts:
        return None, [f"{name}: experts in {fmt.kind} are not supported"]
    if layout.packed_experts_only and not _stored_packed(index, f"{key}.0.{first}"):
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
    slots, stored_names, suffix, stored, has_input = {}, {}, {}, {}, set()
    unit_fmts = set()
    for p, (n, k, _) in projections.items():
        rows = n // len(comps[p])
        for c in comps[p]:
            for e in range(num_experts):
                unit_key = f"{key}.{e}.{c}"
                unit = SimpleNamespace(out_features=rows, in_features=k)
                ufmt, errs = layout.refine(fmt, unit, unit_key, index)
                s_, names = {}, {}
                if not errs:
                    unit_fmts.add(ufmt)
                    s_, names, errs = layout.check(unit, unit_key, ufmt, index)
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
            if leaf != "weight" and not leaf.endswith("_blocks") and leaf != LAYOUTS[p.fmt.kind].metadata_slot:
                by_file.setdefault(index.get(f"{p.key}.{p.stored_names[slot]}").file, []).append((p, slot))
    errors = []
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for p, slot in entries:
                key, leaf = f"{p.key}.{p.stored_names[slot]}", slot.rsplit(".", 1)[-1]
                scale = f.get_tensor(key)
                problems = LAYOUTS[p.fmt.kind].scale_problems(key, leaf, scale)
                if not problems and leaf in LAYOUTS[p.fmt.kind].zero_scale_masks and bool((scale.float() == 0).any()):
                    problems = _zero_scale_problems(p, slot, key, scale, index)
                errors.extend(problems)
    return errors


def _zero_scale_problems(p: ModulePlan, slot: str, key: str, scale: torch.Tensor, index: CheckpointIndex) -> list[str]:
    """A zero scale is only right over a block of zero codes; over non-zero codes it silently zeroes the weights."""
    stem = slot.rpartition(".")[0]
    layout = LAYOUTS[p.fmt.kind]
    codes = index.read(f"{p.key}.{p.stored_names[stem + '.weight' if stem else 'weight']}")
    # mask: the stored code bits that make an element non-zero (a zero scale over such codes decodes them to zero)
    nonzero = (codes.contiguous().view(torch.uint8) & layout.zero_scale_masks[slot.rsplit('.', 1)[-1]]) != 0
    n, kb = nonzero.shape
    bn, bk = layout.scale_block(p.fmt, n, kb, scale)  # rows and code columns one scale element covers
    gn, gk = math.ceil(n / bn), math.ceil(kb / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.bool, device=nonzero.device)  # not the meta default of loading
    padded[:n, :kb] = nonzero
    blocks_nonzero = padded.reshape(gn, bn, gk, bk).any(dim=3).any(dim=1)
    bad = int(((scale.float().reshape(gn, gk) == 0) & blocks_nonzero).sum())
    if not bad:
        return []
    return [f"{key}: {bad} zero scale(s) over blocks of non-zero codes (they would decode to zeros)"]


def raise_if_errors(errors: list[str], scheme: CheckpointScheme, limit: int = 20) -> None:
    if not errors:
        return
    shown = "\n  - ".join(errors[:limit])
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    raise PrequantizedCheckpointError(
        f"cannot load the pre-quantized checkpoint in {scheme.source} as stored ({len(errors)} problem(s)); "
        f"nothing was loaded:\n  - {shown}{more}"
    )


