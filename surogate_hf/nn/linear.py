"""Frozen quantized linear layers: packed weight + scales as frozen Parameters, forward through surogate:: ops.

Slots (named as in the standard checkpoint layouts, so a checkpoint loads straight into them; logical dtypes
and shapes below, held as integer-storage Parameters, see nn/slots.py):
    FP8Linear    weight e4m3 [N, K]; weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)] (blocks) or [] (per tensor)
    NVFP4Linear  weight uint8 [N, K/2] (two E2M1, even index in the low nibble); weight_scale e4m3 [N, K/16];
                 weight_scale_2 fp32 [] (decode global, ModelOpt's name)
    MXFP4Linear  weight uint8 [N, K/2]; weight_scale uint8 E8M0 [N, K/32]
    NF4Linear    weight uint8 [N*K/2, 1] (bitsandbytes packing); weight_absmax (uint8 codes with double
                 quantization, else fp32) [nblocks]; weight_quant_map fp32 [16]; with double quantization
                 also weight_nested_absmax fp32 [ceil(nblocks/256)], weight_nested_quant_map fp32 [256],
                 weight_offset fp32 []. (bitsandbytes' checkpoint keys `weight.absmax` etc. carry dots, which
                 module attribute names cannot; save/load translate `weight_x` <-> `weight.x`.)
The bias, when present, is a frozen Parameter in the model dtype. No dense weight is ever kept:
forward and the input gradient decode inside the ops (one layer at a time on CPU).

`Format` objects (nn/formats/, one home per format) describe one 2-D weight unit [N, K] of a format (slots,
quantize, dequantize, linear, dgrad, GEMM plan, checkpoint layout); the experts module reuses them per expert.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import Tensor, nn

from ..kernels import paths as _paths
from ..ops._warn import warn_once
from . import slots as S
from .formats import FORMAT_CLASSES, FP8Format, Format, MXFP4Format, NF4Format, NVFP4Format, make_format
from .formats.base import QUANTIZE_CHUNK_ELEMENTS, _row_chunks  # noqa: F401  (their home: nn/formats/base.py)
from .formats.base import SHARED_GRAPH_TABLES

__all__ = [  # the Format classes and make_format live in nn/formats/ (one home per format); re-exported here
    "FP8Format", "FP8Linear", "Format", "LINEAR_CLASSES", "MXFP4Format", "MXFP4Linear", "NF4Format", "NF4Linear",
    "NVFP4Format", "NVFP4Linear", "QuantizedLinear", "linear_class", "make_format", "set_registered_graph_route",
]


# ============================================================================ autograd
class QuantLinearFunction(torch.autograd.Function):
    """y = x W^T over a frozen quantized W: the gradient flows to x only, nothing dense is saved."""

    @staticmethod
    def forward(ctx, x, fmt, n, k, keys, *tensors):
        ctx.fmt, ctx.n, ctx.k, ctx.keys = fmt, n, k, keys
        ctx.save_for_backward(*tensors)
        return fmt.linear(x, dict(zip(keys, tensors)), n, k)

    @staticmethod
    def backward(ctx, dy):
        # Unpack saved tensors exactly once: non-reentrant activation checkpointing allows a single unpack.
        saved = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.fmt.dgrad(dy.contiguous(), dict(zip(ctx.keys, saved)), ctx.n, ctx.k)
        return (dx, None, None, None, None, *([None] * len(saved)))


class GemmPlan:
    """A unit's CUDA forward / dgrad and their prepared arguments, cached on the owning module.

    Valid while every source slot is the same tensor object at the same version: replacing a buffer
    (loading, `.to(device)`) or writing into one in place rebuilds it. Sources are held weakly so a
    plan never keeps replaced buffers alive."""

    __slots__ = ("refs", "versions", "fwd", "dgrad", "_args", "_build_args", "decoded")

    @property
    def args(self) -> tuple:
        """fwd's / dgrad's arguments after the input, built on first use where the format deferred them (an NF4
        base's de-nested fp32 absmax: only its few-token and Python paths take it, so a plan that only ever runs the
        C++ decode route, which de-nests per block, never holds it)."""
        if self._args is None:
            self._args, self._build_args = self._build_args(), None
        return self._args

    def valid_for(self, sources: tuple[Tensor, ...]) -> bool:
        refs = self.refs
        if len(refs) != len(sources):
            return False
        for r, s, v in zip(refs, sources, self.versions):
            if r() is not s or s._version != v:
                return False
        return True


def gemm_plan(cache: dict, key, sources: tuple[Tensor, ...], build) -> GemmPlan:
    """cache[key] if still valid for `sources`, else a new plan from build() -> (fwd, dgrad, args, decoded): args a
    tuple or a callable that builds it on first use; decoded, the weight's operands of the C++ decode + GEMM op
    (kernels.registry.decode_operands) and the NF4 nested absmax operands or None, or None."""
    plan = cache.get(key)
    if plan is not None and plan.valid_for(sources):
        return plan
    plan = GemmPlan()
    plan.refs = tuple(weakref.ref(s) for s in sources)
    plan.versions = tuple(s._version for s in sources)
    plan.fwd, plan.dgrad, args, plan.decoded = build()
    plan._args, plan._build_args = (None, args) if callable(args) else (args, None)
    cache[key] = plan
    return plan


def use_cuda_plan(x: Tensor) -> bool:
    """The direct CUDA path: CUDA input, outside torch.compile tracing (which sees the ops)."""
    return x.is_cuda and not torch.compiler.is_compiling()


class PlannedLinearFunction(torch.autograd.Function):
    """CUDA hot path of QuantLinearFunction: calls the registered CUDA implementations of the
    forward / dgrad ops directly with a cached plan, skipping the custom-op dispatch (autograd,
    redispatch and dynamo-disable wrappers) and the per-call derivation of GEMM arguments. The
    frozen tensors live on the plan (module-owned), so nothing new is saved for backward."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return plan.fwd(x, *plan.args)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            plan = ctx.plan
            dx = plan.dgrad(dy.contiguous(), *plan.args)
        return dx, None


_DECODED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_decoded_linear_op = None  # the extension's surogate::ext_decoded_linear once looked up, False without the extension


def decoded_linear_op():
    """surogate::ext_decoded_linear (the decode + GEMM route, forward and backward in C++) when the CUDA extension is
    loaded, else None: the route then runs the Python plan with the Triton decode, and says so once. (An extension
    loaded later in the process, e.g. built by a test, is picked up.)"""
    global _decoded_linear_op
    if _decoded_linear_op:
        return _decoded_linear_op
    from ..kernels import ext

    if _decoded_linear_op is None or ext.loaded():
        if ext.load(build=False) is not None:
            _decoded_linear_op = torch.ops.surogate.ext_decoded_linear.default
            return _decoded_linear_op
        _decoded_linear_op = False
        warn_once("decoded_linear_ext", "surogate_hf: quantized linears on the decode + GEMM route run it from Python "
                  "with a Triton decode (several times the host time per layer of the extension's C++ op, which "
                  f"decides small models' step time); the CUDA extension is {ext.status()[1]}")
    return None


# Inside torch.compile: True, the decode + GEMM route as the extension's graph ops (one opaque call each way); False,
# the decode traced into the graph (decoded_linear below). benchmarks/bench_e2e.py's `_traced` setups measure the two
# side by side; read at trace time.
COMPILED_DECODED_ROUTE = True


def _with_nested(op, nested):
    """op(..., block) -> op(..., block, *nested): ext_decoded_linear with an NF4 base's nested absmax operands."""
    return lambda *args: op(*args, *nested)


def graph_decoded_linear_ready() -> bool:
    """Whether compiled graphs call the extension's decode + GEMM ops (COMPILED_DECODED_ROUTE, and the extension loaded
    or loading without a build). Dynamo evaluates it once at trace time (the marker below) and keeps the answer as a
    constant."""
    return COMPILED_DECODED_ROUTE and decoded_linear_op() is not None


graph_decoded_linear_ready._dynamo_marked_constant = True  # torch.compiler.assume_constant_result, spelled out


_NO_NESTED = (None, None, None)


def graph_decoded_linear(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling: float, fmt: int, n: int,
                         k: int, block: int, nested: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """ext_decoded_linear inside a torch.compile graph: the forward op (y and the adapter's h) with the backward op
    through its registered autograd, one opaque extern call each way; the same aten calls as the eager op's C++
    node. nested: an NF4 base's double-quantization operands (nested absmax, nested code, offset), de-nested by the
    decode kernel."""
    return torch.ops.surogate.ext_decoded_linear_fwd.default(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b,
                                                              scaling, fmt, n, k, block, *(nested or _NO_NESTED))[0]


# (device, codes' data_ptr) -> (the data_ptrs of the layer's slots when its operands were registered, the layer): what
# the compiled route checks at trace time (graph_operands_registered), so that a layer whose slots were replaced since
# (FSDP2's unsharded parameters, a slot set without a reload) keeps every operand in the graph
_REGISTERED_SLOT_ADDRESSES: dict[tuple[str, int], tuple[tuple[int, ...], "weakref.ref[nn.Module]"]] = {}


def graph_operands_registered(codes: Tensor) -> bool:
    """Whether the decode operands registered for these codes (a layer's weight slot, as stored) are its layer's
    current slots'. Dynamo calls it with the real tensor at trace time and keeps the answer as a constant (the marker
    below): a graph that other layers reuse (a compiled decoder layer) finds each one's operands registered by its own
    slots_loaded. It takes the codes alone and finds the layer's other slots through the registration: a slot the
    traced code touched would be guarded on every call (benchmarks/probe_guard_time_cpu.py, SmolLM2-135M compiled
    whole, on a CPU: the guard check with every slot passed nvfp4 3.05 ms a call, nf4 0.75; with the codes alone 0.83
    and 0.73; PEFT's 0.60)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    from ..ops.ext import decode_registry_key

    if isinstance(codes, DTensor) or codes.is_meta or is_fake(codes):
        return False  # (a shard, or no storage of its own: a meta or fake tensor, e.g. while exporting)
    entry = _REGISTERED_SLOT_ADDRESSES.get(decode_registry_key(codes))
    layer = entry[1]() if entry is not None else None
    if layer is None:
        return False
    raw = layer._slot_sources()
    if any(isinstance(t, DTensor) or t.is_meta for t in raw):
        return False
    return raw[0].data_ptr() == codes.data_ptr() and tuple(t.data_ptr() for t in raw) == entry[0]


graph_operands_registered._dynamo_marked_constant = True  # torch.compiler.assume_constant_result, spelled out


def graph_registered_linear(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling: float, fmt: int,
                            n: int, k: int, block: int) -> Tensor:
    """graph_decoded_linear for a layer whose operands are registered: the codes w alone go in (scales, gscale, levels,
    fmt and block are the registered ones and unused here), one graph input per linear as a bf16 linear's weight."""
    return torch.ops.surogate.ext_registered_linear_fwd.default(x, x_lora, w, bias, lora_a, lora_b, scaling, n, k)[0]


def set_registered_graph_route(model: nn.Module, enabled: bool) -> None:
    """Whether the quantized linears of `model` register their decode operands (QuantizedLinear.registers_graph_operands,
    re-registered or released now): registered, a compiled graph hands each one's ops its codes alone; not, every
    operand as a graph input (the route before; benchmarks compare the two in one process)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.registers_graph_operands = bool(enabled)
            module.slots_loaded()


# Whether a layer's operands are registered: a flag in its __dict__, always present (dynamo guards a key's value, not
# its absence), read by the compiled route so that a graph traced on one route never serves a layer on the other
# (dynamo's cache keys on the forward's code, which every instance of a class shares); the value is the same for every
# registered layer, so one compiled decoder layer still serves them all.
_REGISTERED_FLAG = "_graph_operands_registered"


def _release_registration(key, operands, module_ref) -> None:
    from ..ops.ext import REGISTERED_DECODE_OPERANDS, release_decode_operands

    module = module_ref()
    if module is not None:
        module.__dict__[_REGISTERED_FLAG] = False
    if REGISTERED_DECODE_OPERANDS.get(key) is operands:  # (not a later layer's registration under the same address)
        _REGISTERED_SLOT_ADDRESSES.pop(key, None)
        release_decode_operands(key)


def planned_linear(x: Tensor, plan: GemmPlan) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return PlannedLinearFunction.apply(x, plan)
    return plan.fwd(x, *plan.args)


def _decoded_linear(x: Tensor, fmt: Format, n: int, k: int, keys: tuple[str, ...], *tensors: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, fmt.dequantize_traced(dict(zip(keys, tensors)), n, k, x.dtype))


def decoded_linear(x: Tensor, fmt: Format, t: dict[str, Tensor], n: int, k: int) -> Tensor:
    """y = x deq(W)^T with the decode in plain torch ops (Format.dequantize_traced), for compiled graphs with
    many tokens: inductor fuses the decode into one kernel ahead of the extern GEMM, the eager dense route's
    math without a custom op (and its Python host time) per call. The region is checkpointed so that the
    partitioner recomputes the decode for the input gradient instead of saving the dense weight (measured:
    without it, the compiled graph saved the [n, k] weight of every layer for backward)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _decoded_linear(x, fmt, n, k, tuple(t), *t.values())
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_decoded_linear, x, fmt, n, k, tuple(t), *t.values(), use_reentrant=False)


def traced_decode_applies(x: Tensor, fmt: Format, n: int, k: int) -> bool:
    """Inside torch.compile, where the eager CUDA kernels take the dense route (Format.decodes_in_gemm: the weight-only
    formats from paths.DENSE_MIN_TOKENS tokens, a small fp8 weight at any count), for a format with a traced decode."""
    return (torch.compiler.is_compiling() and type(fmt).dequantize_traced is not Format.dequantize_traced
            and fmt.decodes_in_gemm(x, n, k))


def quantized_linear(x: Tensor, fmt: Format, t: dict[str, Tensor], n: int, k: int) -> Tensor:
    keys = tuple(t)
    if traced_decode_applies(x, fmt, n, k):
        return decoded_linear(x, fmt, t, n, k)
    if torch.is_grad_enabled() and x.requires_grad:
        return QuantLinearFunction.apply(x, fmt, n, k, keys, *t.values())
    return fmt.linear(x, t, n, k)


# ============================================================================ modules
_KEEP_DTYPE_ATTR = "_surogate_keep_dtype"


def keep_buffer_dtype(module: nn.Module, *names: str) -> None:
    """Mark extra tensors of a quantized module (beyond its own slots, e.g. a loader's stored-form buffers
    before adoption) whose dtype module-wide casts must preserve like the slots': `.to(bf16)` moves them only."""
    kept = frozenset(getattr(module, _KEEP_DTYPE_ATTR, frozenset()) | set(names))
    object.__setattr__(module, _KEEP_DTYPE_ATTR, kept)


def _apply_keep_dtypes(module: nn.Module, fn, names: set[str], parent_apply, recurse: bool):
    names = set(names) | getattr(module, _KEEP_DTYPE_ATTR, frozenset())
    module.__dict__.pop("_gemm_plans", None)  # cached GPU plans hold device tensors: let them go with the move
    kept = {id(t) for n in names for t in (module._parameters.get(n), module._buffers.get(n)) if t is not None}

    def keep_dtype(t):
        moved = fn(t)
        if id(t) in kept and moved.dtype != t.dtype:
            return t.to(device=moved.device)
        return moved

    return parent_apply(keep_dtype, recurse)


def slot_represents(shape, n: int, k: int, suffix: str) -> int:
    """Weights represented per stored element of a slot (0 for scales): what PackedParameter.numel counts."""
    return (n * k) // max(1, math.prod(shape)) if suffix == "" else 0


def _slots_loaded_after_load_state_dict(module, incompatible_keys) -> None:
    module.slots_loaded()  # (a module-level function: a model with the hook stays picklable)


class QuantizedLinear(nn.Linear):
    """Base of the quantized linears. Built on meta (every slot registered, nothing allocated);
    `from_linear` quantizes a dense nn.Linear; `load_dense_weight` fills the slots from a dense weight."""

    quant_format = ""
    # Register the decode operands at every load and move, for the compiled graphs' registered route (the codes alone
    # in the graph); set_registered_graph_route switches a model's layers
    registers_graph_operands = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        *,
        fmt: Format,
    ):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a dense weight
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.fmt = fmt
        self.prequantized = False
        device = torch.device("meta") if device is None else torch.device(device)
        self.dtype = dtype or torch.get_default_dtype()  # the dtype forward returns and dequantize defaults to
        problem = fmt.shape_problem(self.out_features, self.in_features)
        if problem:
            raise ValueError(f"{type(self).__name__}({in_features}, {out_features}): {problem}")
        n, k = self.out_features, self.in_features
        for suffix, (shape, dt) in fmt.slots(n, k).items():
            S.register_slot(self, "weight" + suffix, shape, dt, device, slot_represents(shape, n, k, suffix))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=self.dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.register_load_state_dict_post_hook(_slots_loaded_after_load_state_dict)
        self.__dict__[_REGISTERED_FLAG] = False  # (until slots_loaded registers the operands)

    def _apply(self, fn, recurse=True):
        # Module-wide casts (model.half(), .to(bf16)) must not re-type packed data or scales: they move
        # device only. Dtype changes of the bias follow the model as usual.
        moved = _apply_keep_dtypes(self, fn, set(self.slot_names()), super()._apply, recurse)
        self.slots_loaded()  # the shared tables live per device
        return moved

    def slots_loaded(self) -> None:
        """Rebuild what this layer derives from its slots' values (slots.DERIVED_ATTR, which setting a slot drops): the
        format's shared constant tables that a compiled graph takes in place of this layer's own copies
        (Format.shared_graph_tables). Runs after every load (slots.finalize_slots, load_state_dict, load_dense_weight)
        and move, eagerly: it compares values."""
        self.__dict__.pop(S.DERIVED_ATTR, None)
        self._release_graph_operands()
        self.__dict__[_REGISTERED_FLAG] = False
        if not all(S.is_storage_form(self, name) for name in self.slot_names()):
            return  # a loader is still filling the slots (its stored layouts need not be the logical shapes yet)
        self.__dict__[S.DERIVED_ATTR] = {"graph_tables": self.fmt.shared_graph_tables(self._tensors())}
        self._register_graph_operands()

    def _register_graph_operands(self) -> None:
        """Register this layer's decode operands for the compiled graphs' registered route (ops.ext
        register_decode_operands: views of the slots, no copy), keyed by the codes' address, for as long as the codes
        Parameter lives or until the next load or move. Not for a sharded (DTensor) or meta layer, nor a format without
        a decode route."""
        from torch.distributed.tensor import DTensor

        from ..ops.ext import decode_registry_key, register_decode_operands

        raw = self._slot_sources()
        if not self.registers_graph_operands or any(isinstance(t, DTensor) or t.is_meta for t in raw):
            return
        operands = self.graph_decode_operands(quiet=True)  # (operands that do not fit are said where a route asks)
        if operands is None or operands[0].data_ptr() != raw[0].data_ptr():
            return
        key = decode_registry_key(raw[0])
        operands = tuple(operands)
        register_decode_operands(operands)
        layer = weakref.ref(self)
        _REGISTERED_SLOT_ADDRESSES[key] = (tuple(t.data_ptr() for t in raw), layer)
        # released with the codes Parameter (FSDP2's sharding drops it; so does a slot set anew) or the next load
        registration = weakref.finalize(raw[0], _release_registration, key, operands, layer)
        registration.atexit = False  # (nothing to release at exit)
        self.__dict__["_graph_registration"] = registration
        self.__dict__[_REGISTERED_FLAG] = True

    def _release_graph_operands(self) -> None:
        registration = self.__dict__.pop("_graph_registration", None)
        if registration is not None:
            registration()

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_graph_registration", None)  # (a copy registers its own slots: __setstate__)
        state[_REGISTERED_FLAG] = False
        state.pop("_gemm_plans", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if all(name in self._parameters for name in self.slot_names()):
            self.slots_loaded()

    # ---- slots
    def slot_names(self) -> list[str]:
        return ["weight" + s for s in self.fmt.slots(self.out_features, self.in_features)]

    def _tensors(self) -> dict[str, Tensor]:
        # read at call time: FSDP2 re-sets the parameters on every unshard
        return {s: S.get_slot(self, "weight" + s) for s in self.fmt.slots(self.out_features, self.in_features)}

    @torch.no_grad()
    def quantize_weight(self, w: Tensor) -> dict[str, Tensor]:
        """Quantize a dense [out, in] weight into {slot name: logical tensor} without touching the module."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"{type(self).__name__}: weight of shape {tuple(w.shape)} given, expected "
                f"({self.out_features}, {self.in_features})"
            )
        if not w.is_floating_point():
            raise TypeError(f"{type(self).__name__}: cannot quantize a non-floating weight of dtype {w.dtype}")
        return {"weight" + s: v for s, v in self.fmt.quantize(w).items()}

    @torch.no_grad()
    def load_dense_weight(self, w: Tensor) -> None:
        for name, v in self.quantize_weight(w).items():
            S.set_slot(self, name, v)
        self.dtype = w.dtype
        self.slots_loaded()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "QuantizedLinear":
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device, dtype=w.dtype, **options)
        m.load_dense_weight(w)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    # ---- numerics
    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return self.fmt.dequantize(self._tensors(), self.out_features, self.in_features, dtype or self.dtype)

    def _slot_sources(self) -> tuple[Tensor, ...]:
        names = self.__dict__.get("_slot_name_cache")
        if names is None:
            names = self.__dict__["_slot_name_cache"] = tuple(self.slot_names())
        return tuple(S.raw_slot(self, name) for name in names)

    def _cuda_plan(self) -> GemmPlan:
        cache = self.__dict__.get("_gemm_plans")
        if cache is None:
            cache = self.__dict__["_gemm_plans"] = {}
        n, k = self.out_features, self.in_features
        return gemm_plan(cache, None, self._slot_sources(), lambda: self.fmt.cuda_plan(self._tensors(), n, k))

    def _w8a8_plan(self) -> GemmPlan:
        """FP8Format.w8a8_cuda_plan of this layer, cached like _cuda_plan (fp8 128x128-block bases only)."""
        cache = self.__dict__.get("_gemm_plans")
        if cache is None:
            cache = self.__dict__["_gemm_plans"] = {}
        n, k = self.out_features, self.in_features
        return gemm_plan(cache, "w8a8", self._slot_sources(), lambda: self.fmt.w8a8_cuda_plan(self._tensors(), n, k))

    def decoded_route(self, x: Tensor):
        """(op, w, scales, gscale, levels, fmt, n, k, block) when this layer's GEMM of x is the extension's C++ decode +
        GEMM (CUDA x, no training recipe on this base, the format's decode route for x's token count, a frozen bias,
        the extension loaded), else None; op(x, x_lora, w, scales, gscale, levels, bias, lora_a, lora_b, scaling, fmt,
        n, k, block) -> y. Eager, op is surogate::ext_decoded_linear (its backward a C++ autograd node); inside
        torch.compile, graph_decoded_linear (the same kernels as two graph ops, operands from the traced slots).
        SurogateLoraLinear fuses its adapter into the same call."""
        if (not x.is_cuda or x.dtype not in _DECODED_DTYPES or self.__dict__.get("recipe_gemm") is not None
                or not self.fmt.decodes_in_gemm(x, self.out_features, self.in_features)
                or (self.bias is not None and self.bias.requires_grad)):  # the op treats the bias as frozen
            return None
        if torch.compiler.is_compiling():
            route = self.graph_route() if graph_decoded_linear_ready() else None
            return None if route is None or route[1].device != x.device else route
        decoded = self._cuda_plan().decoded
        op = decoded_linear_op() if decoded is not None and decoded[0].device == x.device else None
        if op is None:
            return None
        *operands, nested = decoded
        return (op if nested is None else _with_nested(op, nested), *operands)

    def graph_route(self):
        """decoded_route's tuple inside torch.compile: graph_registered_linear and the codes where this layer's operands
        are registered for its current slots (registers_graph_operands), else graph_decoded_linear (with an NF4 base's
        nested absmax operands bound) and graph_decode_operands' operands; None where the format has no decode route."""
        # (the flag, guarded; of the slots, the codes alone enter the traced code)
        if self.__dict__.get(_REGISTERED_FLAG, False):
            codes = S.raw_slot(self, "weight")
            if graph_operands_registered(codes):  # (a constant at trace time; the layer's other slots stay untouched)
                return (graph_registered_linear, codes.detach(), None, None, None, 0, self.out_features,
                        self.in_features, 0)
        operands = self.graph_decode_operands()
        if operands is None:
            return None
        *ops, nested = operands
        op = graph_decoded_linear if nested is None else functools.partial(graph_decoded_linear, nested=nested)
        return (op, *ops)

    def graph_decode_operands(self, quiet: bool = False):
        """The weight's operands of the decode ops (kernels.registry.decode_operands' tuple, then the NF4 nested absmax
        operands or None) from this layer's slots in torch ops that a compiled graph traces (the eager plan's are cached
        tensors a graph cannot take); None where the format has no decode route (or the operands do not fit the ops,
        said once unless quiet)."""
        n, k = self.out_features, self.in_features
        # a standard constant table (NF4's levels and nested code) as the one tensor every such layer shares on this
        # device (Format.shared_graph_tables, rebuilt eagerly by slots_loaded): one graph input for the model, and this
        # layer's own copy is never read into the graph
        codes = S.get_slot(self, "weight")
        shared = {}
        for suffix, key in self.__dict__.get(S.DERIVED_ATTR, {}).get("graph_tables", {}).items():
            table = SHARED_GRAPH_TABLES.get(key)  # (absent in a process that unpickled this layer: its own copy then)
            if table is not None and table.device == codes.device:
                shared[suffix] = table
        logical = {s: shared[s] if s in shared else S.get_slot(self, "weight" + s) for s in self.fmt.slots(n, k)}
        args = self.fmt.decode_args(logical, n, k)
        if args is None:
            return None
        from ..kernels.registry import decode_operands

        # An operand that is a slot as such goes in as stored (its integer view of the same bytes; the ops read bytes):
        # a compiled graph runs each logical dtype view (aten.view.dtype, which inductor cannot fold into a
        # reinterpretation) as a call of its own per op call, four per nvfp4 or fp8 linear and step.
        # (detached: a plain tensor, whose numel() is its elements, not PackedParameter's represented weights; a
        # sharded slot outside FSDP2's unshard keeps its gathered logical view)
        from torch.distributed.tensor import DTensor

        raw = {name: S.raw_slot(self, "weight" + name) for name in logical if name not in shared}
        stored = {name: t.detach() for name, t in raw.items() if not isinstance(t, DTensor)}

        def as_stored(t):
            for name, view in logical.items():
                if t is view and name in stored:
                    return stored[name]
            return t

        w, scales, gscale, levels, block, nested = args
        w, scales, gscale, levels = (None if t is None else as_stored(t) for t in (w, scales, gscale, levels))
        nested = None if nested is None else tuple(as_stored(t) for t in nested)
        ops = decode_operands(self.fmt.name, w, scales, gscale, levels, n, k, block, nested, quiet=quiet)
        return None if ops is None else (*ops, nested)

    def forward(self, x: Tensor) -> Tensor:
        route = self.decoded_route(x)
        if route is not None:
            op, w, s, g, levels, fmt, n, k, block = route
            return op(x, None, w, s, g, levels, self.bias, None, None, 1.0, fmt, n, k, block)
        # a training recipe's GEMMs for this frozen base (recipes.qlora.BaseRecipeGemm, set by apply_recipe); None:
        # the format's own GEMM is the recipe's
        recipe_gemm = self.__dict__.get("recipe_gemm")
        y = recipe_gemm(x) if recipe_gemm is not None else None
        if y is None:
            if use_cuda_plan(x):
                y = planned_linear(x, self._cuda_plan())
            else:
                y = quantized_linear(x, self.fmt, self._tensors(), self.out_features, self.in_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def gemm_path(self, tokens: int, dtype: torch.dtype | None = None, capability="current") -> "_paths.GemmPath":
        """The CUDA path this layer's forward and dgrad take for `tokens` rows of `dtype` (default: the layer's
        dtype) on the current GPU (capability="current"), on a GPU of the given (major, minor), or with no
        GPU (None). Callable on CPU; the kernels decide with the same function."""
        if capability == "current":
            capability = _paths.device_capability(torch.cuda.current_device()) if torch.cuda.is_available() else None
        return self.fmt.gemm_path(tokens, self.out_features, self.in_features, dtype or self.dtype, capability)

    def to_dense(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain nn.Linear holding the dequantized weight (and this layer's bias)."""
        dtype = dtype or self.dtype
        w = self.dequantize(dtype)
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype)
        lin.weight = nn.Parameter(w, requires_grad=False)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return lin

    def quantized_nbytes(self) -> int:
        """Bytes of the packed weight and its scales (bias excluded; the whole tensors, also when sharded)."""
        return sum(torch.numel(S.raw_slot(self, n)) * S.raw_slot(self, n).element_size() for n in self.slot_names())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format={self.quant_format}"


class FP8Linear(QuantizedLinear):
    quant_format = "fp8"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, block_size=(128, 128), ue8m0=False):
        super().__init__(in_features, out_features, bias, device, dtype, fmt=FP8Format(block_size, ue8m0))

    @property
    def block_size(self):
        return self.fmt.block_size


class NVFP4Linear(QuantizedLinear):
    quant_format = "nvfp4"

    def __init__(
        self, in_features, out_features, bias=True, device=None, dtype=None, *, four_over_six=True, four_over_six_rule="mse"
    ):
        super().__init__(in_features, out_features, bias, device, dtype, fmt=NVFP4Format(four_over_six, four_over_six_rule))


class MXFP4Linear(QuantizedLinear):
    quant_format = "mxfp4"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype, fmt=MXFP4Format())


class NF4Linear(QuantizedLinear):
    quant_format = "nf4"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, block_size=64, double_quant=True,
                 scale_search=True):
        super().__init__(in_features, out_features, bias, device, dtype,
                         fmt=NF4Format(block_size, double_quant, scale_search))

    def quant_state(self):
        """The bitsandbytes QuantState of the weight (for bitsandbytes-layout export)."""
        return self.fmt.quant_state(self._tensors(), self.out_features, self.in_features, self.dtype)


LINEAR_CLASSES: dict[str, type[QuantizedLinear]] = {
    "fp8": FP8Linear,
    "nvfp4": NVFP4Linear,
    "mxfp4": MXFP4Linear,
    "nf4": NF4Linear,
}


class _RegisteredFormatLinear(QuantizedLinear):
    """The quantized linear of a format registered in nn/formats/ without a named class here."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, **options):
        fmt = make_format(self.quant_format, **options)
        super().__init__(in_features, out_features, bias, device, dtype, fmt=fmt)


def linear_class(name: str) -> type[QuantizedLinear]:
    """The quantized linear of format `name`: its named class above, else one made (once) for the format's home,
    so a new format needs no class here. Raises ValueError naming the known formats."""
    cls = LINEAR_CLASSES.get(name)
    if cls is None:
        if name not in FORMAT_CLASSES:
            raise ValueError(f"unknown format {name!r}; expected one of {tuple(FORMAT_CLASSES)}")
        cls = LINEAR_CLASSES[name] = type(f"{name.upper()}Linear", (_RegisteredFormatLinear,), {"quant_format": name})
    return cls
