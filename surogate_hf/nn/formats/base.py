"""What every format home provides (options, `Format`, checkpoint `Layout`s), the helpers they share, and the
registry that save and pre-quantized load loop over.

A format home (`fp8.py`, `nvfp4.py`, `mxfp4.py`, `nf4.py`) holds, for one weight format:
- its options: a frozen dataclass validated on creation (`Options`), with the SurogateConfig fields that set them;
- its `Format` (one 2-D weight unit [n, k]): packed slots, quantize / dequantize through surogate_hf.formats and
  the surogate:: ops, forward / dgrad, the GEMM plan of the registered CUDA implementations, and how a unit is
  written to its standard checkpoint layout (`to_checkpoint`, `checkpoint_config`);
- its checkpoint `Layout`s (one per stored layout a pre-quantized checkpoint may use): the header checks that
  name every bad tensor before anything loads, the module options, stored-to-working slot names, and how
  per-expert components fuse into (and split out of) the fused experts' slots.
Each home ends with `register(...)`; docs/adding_a_format.md says how to add one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...kernels import paths as _paths

# Large weights are quantized in row chunks of about this many elements: the reference quantizers
# keep ~8 fp32 temporaries per element, so chunking bounds the load-time work space to a few MB per
# chunk instead of ~16x the dense tensor. Results are bit-identical to one-shot quantization (the
# per-tensor quantities, the NVFP4 global and the per-tensor FP8 scale, come from the whole tensor).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


# (format name, slot suffix, device) -> one process-wide tensor of a format's standard constant table
# (Format.shared_graph_tables). A compiled graph reaches it through this one dict, so dynamo guards it once for the
# model; read through each layer, every layer would add an identity guard that runs in Python on every call.
SHARED_GRAPH_TABLES: dict[tuple[str, str, str], Tensor] = {}


def register_shared_graph_table(key: tuple[str, str, str], make) -> Tensor:
    """SHARED_GRAPH_TABLES[key], made by make() the first time; nothing writes into it afterwards."""
    table = SHARED_GRAPH_TABLES.get(key)
    if table is None:
        table = SHARED_GRAPH_TABLES[key] = make()
    return table


def _row_chunks(n: int, k: int, multiple: int = 1):
    rows = max(multiple, (QUANTIZE_CHUNK_ELEMENTS // max(k, 1)) // multiple * multiple)
    return [(r, min(r + rows, n)) for r in range(0, n, rows)]


def _chunked(w: Tensor, multiple: int, fn) -> dict[str, Tensor]:
    """Apply fn to row chunks of w and concatenate each output along rows (0-d outputs: first chunk's)."""
    parts = [fn(w[a:b]) for a, b in _row_chunks(w.shape[0], w.shape[1], multiple)]
    if len(parts) == 1:
        return parts[0]
    return {key: parts[0][key] if parts[0][key].dim() == 0 else torch.cat([p[key] for p in parts]) for key in parts[0]}


# ============================================================================ options
class OptionError(ValueError):
    """A bad option value. `template` names the option as `{opt}`, so SurogateConfig can name its own field."""

    def __init__(self, option: str, template: str):
        self.option, self.template = option, template
        super().__init__(template.format(opt=option))

    def named(self, name: str) -> str:
        return self.template.format(opt=name)


def is_bool(v) -> bool:
    return isinstance(v, bool)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_bool(name: str, v) -> None:
    if not is_bool(v):
        raise OptionError(name, f"{{opt}} must be True or False, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """A format's options, validated in `__post_init__` (values may be normalised there, e.g. a list -> tuple).

    CONFIG_FIELDS maps the SurogateConfig field to the option it sets (SurogateConfig spells some with the format's
    prefix, e.g. nf4_block_size -> block_size); `from_config` is the only place that translation happens."""

    CONFIG_FIELDS: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        pass

    def _set(self, name: str, value) -> None:  # normalise a field of the frozen dataclass in validate()
        object.__setattr__(self, name, value)

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_config(cls, values: dict[str, Any], where: str = "SurogateConfig") -> "Options":
        """Options from {SurogateConfig field: value}; a bad value raises ValueError naming the config's field."""
        try:
            return cls(**{opt: values[field] for field, opt in cls.CONFIG_FIELDS.items() if field in values})
        except OptionError as exc:
            field = next((f for f, o in cls.CONFIG_FIELDS.items() if o == exc.option), exc.option)
            raise ValueError(f"{where}: {exc.named(field)}") from None


# ============================================================================ Format
class Format:
    """One weight format, for a 2-D unit [n, k] (rows = output features, k = reduction dim)."""

    name = ""
    options_class: ClassVar[type[Options]] = Options  # the validated options; the instance holds `options`
    # Whether the halves of a fused [gate; up] projection are quantized as separate units, so a fused
    # expert weight splits exactly into the per-projection tensors of the standard layouts.
    per_component = False

    def shape_problem(self, n: int, k: int) -> str | None:
        """Why this format cannot hold an [n, k] weight, or None."""
        return None

    def slots(self, n: int, k: int, expert: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def quantize(self, w: Tensor, expert: bool = False) -> dict[str, Tensor]:
        raise NotImplementedError

    def dequantize(self, t: dict[str, Tensor], n: int, k: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def dequantize_traced(self, t: dict[str, Tensor], n: int, k: int, dtype: torch.dtype) -> Tensor | None:
        """The dense weight from the formats/ reference decode in plain torch ops (no custom op), so that a
        compiled graph fuses it into one kernel; bit-identical to `dequantize`. None: the format has no such
        route."""
        return None

    def decode_args(self, t: dict[str, Tensor], n: int, k: int):
        """(w, scales, gscale, levels, block, nested): this unit's operands of the extension's decode ops (the layouts
        ops.ext.decode_reference states), derived from the slots in torch ops that a compiled graph can trace, nested
        being NF4 double quantization's (nested absmax, nested code, offset) or None; None where the format has no
        decode route."""
        return None

    def shared_graph_tables(self, t: dict[str, Tensor]) -> dict[str, tuple[str, str, str]]:
        """{slot suffix: its SHARED_GRAPH_TABLES key} for the slots of this unit that hold the format's standard
        constant table (registered on the slot's device), which a compiled graph then takes once for every layer
        instead of each layer's own copy (a graph input costs host time every step: dynamo's guard, AOTAutograd's
        wrappers, inductor's size assert, a saved tensor). Computed eagerly (it compares values), never while tracing.
        None here: no such tables."""
        return {}

    def decodes_in_gemm(self, x: Tensor, n: int, k: int) -> bool:
        """Whether this format's GEMM of activation x over an [n, k] weight is a decode plus a dense GEMM (where a
        compiled graph takes dequantize_traced): the weight-only formats from paths.DENSE_MIN_TOKENS tokens on."""
        return x.numel() >= _paths.DENSE_MIN_TOKENS * k

    def linear(self, x: Tensor, t: dict[str, Tensor], n: int, k: int) -> Tensor:
        raise NotImplementedError

    def dgrad(self, dy: Tensor, t: dict[str, Tensor], n: int, k: int) -> Tensor:
        raise NotImplementedError

    def cuda_plan(self, t: dict[str, Tensor], n: int, k: int):
        """(forward, dgrad, args, decoded) of the registered CUDA implementations with the GEMM's arguments
        prepared once (see `GemmPlan`; args may be a callable that builds them on first use): forward(x, *args),
        dgrad(dy, *args); decoded: the weight's operands of the extension's decode + GEMM op
        (kernels.registry.decode_operands) followed by the NF4 nested absmax operands or None, or None where the
        format has no such route."""
        raise NotImplementedError

    def bytes_per_param(self) -> float:
        raise NotImplementedError

    def path_options(self) -> dict:
        """This format's options that kernels.paths.plan_gemm takes (fp8 block size, NF4 block size)."""
        return {}

    def gemm_path(self, m: int, n: int, k: int, dtype: torch.dtype, capability, **device) -> "_paths.GemmPath":
        """The CUDA path an [n, k] unit of this format takes for m tokens of `dtype` on a GPU of compute
        capability `capability` (None: no GPU): the very decision the kernels make (kernels.paths.plan_gemm)."""
        return _paths.plan_gemm(self.name, m, k, n, dtype, None if capability is None else tuple(capability),
                                **self.path_options(), **device)

    # ---- a fixed grid: what error-feedback quantizers (GPTQ, integrations/gptq.py) round onto
    def element_scales(self, t: dict[str, Tensor], n: int, k: int) -> Tensor:
        """[n, k] fp32: each element's decode scale in unit t, so that it decodes to (grid value) x scale."""
        raise NotImplementedError(f"format {self.name!r} has no fixed-grid rounding")

    def round_to_grid(self, v: Tensor) -> Tensor:
        """Values in units of their element scale, rounded to the nearest value of the element grid (fp32); the
        rounding the format's own encode does."""
        raise NotImplementedError(f"format {self.name!r} has no fixed-grid rounding")

    def encode_on_scales(self, t: dict[str, Tensor], w: Tensor, n: int, k: int) -> dict[str, Tensor]:
        """Unit t with its codes replaced by those of the dense w [n, k] on t's own scales (scales unchanged)."""
        raise NotImplementedError(f"format {self.name!r} has no fixed-grid rounding")

    # ---- writing the standard checkpoint layout (save_pretrained of an online-quantized model)
    def to_checkpoint(self, t: dict[str, Tensor], n: int, k: int, prefix: str, dtype) -> dict[str, Tensor]:
        """One [n, k] unit as the standard checkpoint tensors `{prefix}weight...` (dtype: the model's)."""
        return {prefix + "weight" + s: v for s, v in t.items()}

    def expert_rows(self, t: dict[str, Tensor], r0: int, r1: int) -> dict[str, Tensor]:
        """Rows [r0, r1) of a fused expert unit (formats without `per_component` units: one [gate; up] unit)."""
        raise NotImplementedError(f"{self.name}: a fused expert unit cannot be split by rows")

    def expert_checkpoint_name(self, p: str, suffix: str) -> str:
        """The key of natively fused experts' slot `{p}{suffix}` in the standard layout."""
        return p + suffix

    def checkpoint_config(self, dense_names: list[str]) -> dict:
        """The config.json `quantization_config` describing the written layout; dense_names stay unquantized."""
        raise NotImplementedError

    def save_caveats(self, layers: dict[str, tuple[int, int]]) -> str | None:
        """A warning about the written layout for these {name: (n, k)} linears, or None."""
        return None


# ============================================================================ checkpoint layouts
FLOAT_DTYPES = ("BF16", "F16", "F32")  # safetensors dtypes of a dense-stored tensor
SCALAR_SHAPES = ((), (1,))


def describe(info) -> str:
    return "absent" if info is None else f"{info.dtype} {list(info.shape)}"


def expect(index, key, dtypes, shape, errors, what):
    """index[key] if it has one of `dtypes` and `shape` (one shape or a list of accepted ones), else None and
    an error naming the key appended to `errors`."""
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


def weight_disagrees(index, key, expected: str, errors) -> bool:
    """Whether `{key}.weight` is stored dense although the config says `expected` (error appended)."""
    info = index.get(f"{key}.weight")
    if info is not None and info.dtype in FLOAT_DTYPES:
        errors.append(f"{key}.weight is {describe(info)}: stored dense, but the config says it is {expected}")
        return True
    return False


def input_scale(index, key, slots, errors) -> None:
    """ModelOpt's static activation scale, carried through load and save when stored."""
    if f"{key}.input_scale" in index:
        slots["input_scale"] = expect(index, f"{key}.input_scale", ("F32",), list(SCALAR_SHAPES), errors, "input_scale")


class Layout:
    """One stored checkpoint layout of a format, read by the pre-quantized loader and written back on save.

    `kind` is the name the loader's plan uses (LayerFormat.kind); `format` the Format it loads into. The methods
    are pure tensor / key transforms: `index` is anything with `get(key) -> info (dtype str, shape)`, `in`, and
    `read(key) -> Tensor`; `lf` is the loader's LayerFormat (kind, block, ue8m0, nf4_block, double_quant)."""

    kind = ""
    format = ""
    experts = False  # a layout of a natively fused experts module (else a linear's, fusable per expert)
    stored_names: ClassVar[dict[str, str]] = {}  # module slot -> stored suffix where they differ (dots)
    working_names: ClassVar[dict[str, str]] = {}  # stored slot -> the module's working slot it fills
    carried: ClassVar[tuple[str, ...]] = ("input_scale",)  # stored slots the module carries for save only
    zero_scale_masks: ClassVar[dict[str, int]] = {}  # scale leaf -> code bits that make an element non-zero
    metadata_slot: str | None = None  # a stored uint8 metadata tensor carried byte for byte (not a scale)
    # Experts stored per expert are this layout's only where the weights are stored packed (the readers of
    # transformers keep dense-stored ones dense: mxfp4, bitsandbytes).
    packed_experts_only = False

    label = ""  # how messages name the stored format ("NVFP4", "ModelOpt FP8", ...)
    block = 0  # elements per scale along in_features the stored layout needs (0: no constraint)

    def preamble(self, module, key: str, index) -> tuple[int, int, list[str]]:
        """(n, k, errors) of a linear `key`: in_features must tile into blocks, and `{key}.weight` must not be
        stored dense; a check returns at once when errors is not empty."""
        n, k = module.out_features, module.in_features
        if self.block and k % self.block:
            return n, k, [f"{key}: in_features {k} is not divisible by the {self.label} block ({self.block})"]
        errors: list[str] = []
        weight_disagrees(index, key, self.label, errors)
        return n, k, errors

    def working_name(self, slot: str) -> str:
        return self.working_names.get(slot, slot)

    def module_options(self, lf) -> dict[str, Any]:
        """Constructor options of the format's module / Format for a module stored as `lf`."""
        return {}

    def refine(self, lf, module, key: str, index) -> tuple[Any, list[str]]:
        """lf completed from per-tensor metadata (e.g. NF4's QuantState JSON), and errors."""
        return lf, []

    def check(self, module, key: str, lf, index) -> tuple[dict, dict[str, str], list[str]]:
        """Headers of module `key` checked against `lf`: ({slot: info}, {slot: stored suffix}, errors)."""
        raise NotImplementedError

    def derived_slots(self, lf) -> tuple[str, ...]:
        """Working slots filled from a carried slot (not stored as tensors), see `derive`."""
        return ()

    def derive(self, slot: str, t: Tensor, fmt) -> dict[str, Tensor]:
        """{working slot: value} derived from the carried stored slot `slot` after loading."""
        return {}

    def stored_encoding(self, working: str, dtype: torch.dtype) -> str | None:
        """A stored encoding of `working` other than its working dtype (e.g. "e8m0"), None when there is none."""
        return None

    def scale_block(self, lf, n: int, kb: int, scale: Tensor) -> tuple[int, int]:
        """Rows and stored code columns one scale element covers (zero-scale checks)."""
        return n, kb

    def scale_problems(self, key: str, leaf: str, t: Tensor) -> list[str]:
        """NaN / inf / negative scales (and a zero global) in the stored tensor `key`."""
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

    # ---- experts stored per expert and component, fused into QuantizedExperts' slots
    def fuse(self, stored, comps: list[str], num_experts: int, slot_shapes: dict, n_units: int, fmt, warn) -> dict:
        """{slot suffix: fused tensor} from stored(component, slot) -> [one tensor per expert]; warn(message)
        reports a lossy fuse once."""
        raise NotImplementedError(f"experts in {self.kind} cannot be fused from per-expert tensors")

    def split(self, t: dict[str, Tensor], e: int, j: int, crows: int, n_units: int) -> dict[str, Tensor]:
        """{stored slot: tensor} of component j of expert e, from the fused unit tensors t (the inverse of fuse)."""
        raise NotImplementedError(f"experts in {self.kind} cannot be split into per-expert tensors")


def unit_index(e: int, j: int, n_units: int) -> tuple[int, ...]:
    return (e, j) if n_units > 1 else (e,)


def stack_units(parts: list[Tensor], n_units: int) -> Tensor:
    """Per-component stacks [E, ...] -> the fused slot ([E, units, ...] with two units per expert)."""
    return torch.stack(parts, 1) if n_units > 1 else parts[0]


# ============================================================================ registry
FORMAT_CLASSES: dict[str, type[Format]] = {}
LAYOUTS: dict[str, Layout] = {}


def register(cls: type[Format], *layouts: Layout) -> type[Format]:
    """Make a format home known: make_format(cls.name) and every loop over formats / layouts see it."""
    if cls.name in FORMAT_CLASSES:
        raise ValueError(f"format {cls.name!r} is registered twice")
    FORMAT_CLASSES[cls.name] = cls
    for layout in layouts:
        if layout.kind in LAYOUTS:
            raise ValueError(f"checkpoint layout kind {layout.kind!r} is registered twice")
        LAYOUTS[layout.kind] = layout
    return cls


def make_format(name: str, **options) -> Format:
    try:
        cls = FORMAT_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {tuple(FORMAT_CLASSES)}") from None
    return cls(**options)
