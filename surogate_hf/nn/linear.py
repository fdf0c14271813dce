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

`Format` objects below describe one 2-D weight unit [N, K] of a format (slots, quantize, dequantize,
linear, dgrad); the experts module reuses them per expert.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor, nn

from .. import formats as F
from .. import ops
from ..kernels import paths as _paths
from ..kernels import registry as _cuda
from ..formats.mxfp4 import MXFP4_BLOCK
from ..formats.nvfp4 import NVFP4_BLOCK
from . import slots as S

_NESTED_BLOCK = 256  # bitsandbytes' block size for double-quantized absmaxes
# Large weights are quantized in row chunks of about this many elements: the reference quantizers
# keep ~8 fp32 temporaries per element, so chunking bounds the load-time work space to a few MB per
# chunk instead of ~16x the dense tensor. Results are bit-identical to one-shot quantization (the
# per-tensor quantities, the NVFP4 global and the per-tensor FP8 scale, come from the whole tensor).
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def _row_chunks(n: int, k: int, multiple: int = 1):
    rows = max(multiple, (QUANTIZE_CHUNK_ELEMENTS // max(k, 1)) // multiple * multiple)
    return [(r, min(r + rows, n)) for r in range(0, n, rows)]


def _chunked(w: Tensor, multiple: int, fn) -> dict[str, Tensor]:
    """Apply fn to row chunks of w and concatenate each output along rows (0-d outputs: first chunk's)."""
    parts = [fn(w[a:b]) for a, b in _row_chunks(w.shape[0], w.shape[1], multiple)]
    if len(parts) == 1:
        return parts[0]
    return {key: parts[0][key] if parts[0][key].dim() == 0 else torch.cat([p[key] for p in parts]) for key in parts[0]}


# ============================================================================ formats
class Format:
    """One weight format, for a 2-D unit [n, k] (rows = output features, k = reduction dim)."""

    name = ""
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

    def linear(self, x: Tensor, t: dict[str, Tensor], n: int, k: int) -> Tensor:
        raise NotImplementedError

    def dgrad(self, dy: Tensor, t: dict[str, Tensor], n: int, k: int) -> Tensor:
        raise NotImplementedError

    def cuda_plan(self, t: dict[str, Tensor], n: int, k: int):
        """(forward, dgrad, args) of the registered CUDA implementations with the GEMM's arguments
        prepared once (see `GemmPlan`): forward(x, *args), dgrad(dy, *args)."""
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


class FP8Format(Format):
    name = "fp8"
    per_component = True

    def __init__(self, block_size=(128, 128), ue8m0: bool = False):
        self.block_size = None if block_size is None else (int(block_size[0]), int(block_size[1]))
        self.ue8m0 = bool(ue8m0)

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

    def dequantize(self, t, n, k, dtype):
        bn, bk, s = self._blocks(t, n, k)
        return ops.dequantize_fp8_blocks(t[""], s, bn, bk, dtype)

    def linear(self, x, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        if x.is_cuda:  # torch.compile graphs: the extension's C++ op when it applies
            y = _cuda.fp8_block_linear_native(x, t[""], s, bn, bk, False)
            if y is not None:
                return y
        # activations always use 1x128 tiles (or 1xK) as in the fine-grained recipe
        return ops.fp8_block_linear(x, t[""], s, bn, bk)

    def dgrad(self, dy, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        if dy.is_cuda:
            dx = _cuda.fp8_block_linear_native(dy, t[""], s, bn, bk, True)
            if dx is not None:
                return dx
        return ops.fp8_block_linear_dgrad(dy, t[""], s, bn, bk)

    def cuda_plan(self, t, n, k):
        bn, bk, s = self._blocks(t, n, k)
        return _cuda.plan_fp8(t[""], s, bn, bk)

    def bytes_per_param(self):
        if self.block_size is None:
            return 1.0
        return 1.0 + 4.0 / (self.block_size[0] * self.block_size[1])

    def path_options(self):
        return {"block_size": self.block_size}


class NVFP4Format(Format):
    name = "nvfp4"

    def __init__(self, four_over_six: bool = True, four_over_six_rule: str = "mse"):
        self.four_over_six = bool(four_over_six)
        self.rule = four_over_six_rule

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

    def linear(self, x, t, n, k):
        return ops.nvfp4_linear(x, t[""], t["_scale"], t["_scale_2"])

    def dgrad(self, dy, t, n, k):
        return ops.nvfp4_linear_dgrad(dy, t[""], t["_scale"], t["_scale_2"])

    def cuda_plan(self, t, n, k):
        return _cuda.plan_nvfp4(t[""], t["_scale"], t["_scale_2"])

    def bytes_per_param(self):
        return 0.5 + 1.0 / NVFP4_BLOCK


class MXFP4Format(Format):
    """Linear: weight [n, k/2] + weight_scale [n, k/32]. Experts use GPT-OSS' shapes and names:
    `{P}` packed as [n, k/32, 16] (GPT-OSS' `{P}_blocks`) and `{P}_scales` [n, k/32]."""

    name = "mxfp4"

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

    def dequantize(self, t, n, k, dtype):
        return ops.dequantize_mxfp4(*self._canon(t, n, k), dtype)

    def linear(self, x, t, n, k):
        return ops.mxfp4_linear(x, *self._canon(t, n, k))

    def dgrad(self, dy, t, n, k):
        return ops.mxfp4_linear_dgrad(dy, *self._canon(t, n, k))

    def cuda_plan(self, t, n, k):
        return _cuda.plan_mxfp4(*self._canon(t, n, k))

    def bytes_per_param(self):
        return 0.5 + 1.0 / MXFP4_BLOCK


class NF4Format(Format):
    name = "nf4"
    per_component = True

    def __init__(self, block_size: int = 64, double_quant: bool = True):
        if block_size not in F.nf4.NF4_BLOCK_SIZES:
            raise ValueError(f"nf4 block_size must be one of {F.nf4.NF4_BLOCK_SIZES}, got {block_size}")
        self.block_size = int(block_size)
        self.double_quant = bool(double_quant)

    def shape_problem(self, n, k):
        # bitsandbytes 0.50's CPU dequantize_4bit mis-decodes blocks that straddle rows (k % block != 0)
        # while its quantize flattens them: such layers stay dense so what we write decodes alike everywhere.
        if k % self.block_size:
            return f"NF4 needs in_features % {self.block_size} == 0, got {k}"
        return None

    def slots(self, n, k, expert=False):
        nb = n * k // self.block_size
        s = {
            "": ((n * k // 2, 1), torch.uint8),
            "_absmax": ((nb,), torch.uint8 if self.double_quant else torch.float32),
            "_quant_map": ((16,), torch.float32),
        }
        if self.double_quant:
            s["_nested_absmax"] = ((-(-nb // _NESTED_BLOCK),), torch.float32)
            s["_nested_quant_map"] = ((256,), torch.float32)
            s["_offset"] = ((), torch.float32)
        return s

    def quantize(self, w, expert=False):
        packed, qs = F.quantize_nf4(w, self.block_size, self.double_quant)
        t = {"": packed.reshape(-1, 1), "_absmax": qs.absmax, "_quant_map": qs.code.float()}
        if qs.nested:
            t["_nested_absmax"] = qs.state2.absmax.float()
            t["_nested_quant_map"] = qs.state2.code.float()
            t["_offset"] = torch.as_tensor(qs.offset, dtype=torch.float32).reshape(())
        return t

    def quant_state(self, t, n, k, dtype):
        """The bitsandbytes QuantState of a unit (dtype = the dtype bitsandbytes decodes to)."""
        from bitsandbytes.functional import QuantState

        state2 = None
        offset = None
        if self.double_quant:
            state2 = QuantState(
                absmax=t["_nested_absmax"], code=t["_nested_quant_map"], blocksize=_NESTED_BLOCK, dtype=torch.float32
            )
            offset = t["_offset"]
        return QuantState(
            absmax=t["_absmax"],
            shape=torch.Size((n, k)),
            code=t["_quant_map"],
            blocksize=self.block_size,
            quant_type="nf4",
            dtype=dtype,
            offset=offset,
            state2=state2,
        )

    def _absmax(self, t, n, k):
        return F.nf4_absmax(self.quant_state(t, n, k, torch.float32))

    def dequantize(self, t, n, k, dtype):
        # the same decode the linear ops use (bitsandbytes' dequantize_4bit agrees for k % block == 0)
        return F.dequantize_nf4_raw(t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, (n, k), dtype)

    def linear(self, x, t, n, k):
        return ops.nf4_linear(x, t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, n, k)

    def dgrad(self, dy, t, n, k):
        return ops.nf4_linear_dgrad(dy, t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, n, k)

    def cuda_plan(self, t, n, k):
        # The plan holds the de-nested fp32 absmax (4 bytes per block: +0.0625 B/param at block 64,
        # on the device only, never saved): undoing double quantization per call was a bitsandbytes
        # call (QuantState + dequantize_blockwise + offset add) on every forward and dgrad.
        return _cuda.plan_nf4(t[""], self._absmax(t, n, k), t["_quant_map"], self.block_size, n, k)

    def path_options(self):
        return {"nf4_block": self.block_size}

    def bytes_per_param(self):
        if not self.double_quant:
            return 0.5 + 4.0 / self.block_size
        return 0.5 + 1.0 / self.block_size + 4.0 / (self.block_size * _NESTED_BLOCK)


_FORMAT_CLASSES = {"fp8": FP8Format, "nvfp4": NVFP4Format, "mxfp4": MXFP4Format, "nf4": NF4Format}


def make_format(name: str, **options) -> Format:
    try:
        cls = _FORMAT_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {tuple(_FORMAT_CLASSES)}") from None
    return cls(**options)


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

    __slots__ = ("refs", "versions", "fwd", "dgrad", "args")

    def valid_for(self, sources: tuple[Tensor, ...]) -> bool:
        refs = self.refs
        if len(refs) != len(sources):
            return False
        for r, s, v in zip(refs, sources, self.versions):
            if r() is not s or s._version != v:
                return False
        return True


def gemm_plan(cache: dict, key, sources: tuple[Tensor, ...], build) -> GemmPlan:
    """cache[key] if still valid for `sources`, else a new plan from build() -> (fwd, dgrad, args)."""
    plan = cache.get(key)
    if plan is not None and plan.valid_for(sources):
        return plan
    plan = GemmPlan()
    plan.refs = tuple(weakref.ref(s) for s in sources)
    plan.versions = tuple(s._version for s in sources)
    plan.fwd, plan.dgrad, plan.args = build()
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


def planned_linear(x: Tensor, plan: GemmPlan) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return PlannedLinearFunction.apply(x, plan)
    return plan.fwd(x, *plan.args)


def quantized_linear(x: Tensor, fmt: Format, t: dict[str, Tensor], n: int, k: int) -> Tensor:
    keys = tuple(t)
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


class QuantizedLinear(nn.Linear):
    """Base of the quantized linears. Built on meta (every slot registered, nothing allocated);
    `from_linear` quantizes a dense nn.Linear; `load_dense_weight` fills the slots from a dense weight."""

    quant_format = ""

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

    def _apply(self, fn, recurse=True):
        # Module-wide casts (model.half(), .to(bf16)) must not re-type packed data or scales: they move
        # device only. Dtype changes of the bias follow the model as usual.
        return _apply_keep_dtypes(self, fn, set(self.slot_names()), super()._apply, recurse)

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

    def forward(self, x: Tensor) -> Tensor:
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

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, block_size=64, double_quant=True):
        super().__init__(in_features, out_features, bias, device, dtype, fmt=NF4Format(block_size, double_quant))

    def quant_state(self):
        """The bitsandbytes QuantState of the weight (for bitsandbytes-layout export)."""
        return self.fmt.quant_state(self._tensors(), self.out_features, self.in_features, self.dtype)


LINEAR_CLASSES: dict[str, type[QuantizedLinear]] = {
    "fp8": FP8Linear,
    "nvfp4": NVFP4Linear,
    "mxfp4": MXFP4Linear,
    "nf4": NF4Linear,
}
