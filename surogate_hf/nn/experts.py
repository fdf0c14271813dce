"""Quantized fused MoE experts (transformers 5 keeps experts as 3-D parameters).

`QuantizedExperts` replaces an experts module such as Qwen3MoeExperts (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], used as F.linear(x, W[e])) or GptOssExperts (`gate_up_proj` [E, H, 2I] and
`down_proj` [E, I, H], used as x @ W[e], gate/up interleaved, with biases). Each expert's projection
is quantized along its reduction dim (K = H for gate_up, I for down). The forward loops over the hit
experts like the eager transformers forward and decodes one expert's weight at a time inside the op.

Storage, for each projection P with N output rows and K inputs per expert (both layouts are stored
output-major, [N, K], whatever the dense parameter's orientation):
    unit    = one expert's weight, or, for formats with `per_component` (fp8, nf4) and a concatenated
              [gate; up] projection, each half separately (so blocks never straddle gate and up, and a
              fused expert splits exactly into the per-projection tensors of the standard layouts)
    slots   = `{P}{suffix}` (frozen integer-storage Parameters, nn/slots.py) for each slot of the unit (see nn/formats/), shaped [E, *unit] or, with two
              units per expert, [E, 2, *unit]:
      fp8    `{P}` e4m3 [E, N, K] ([E, 2, I, K] split), `{P}_scale_inv` fp32 [E, ceil(N/bn), ceil(K/bk)]
             ([E, 2, ceil(I/bn), ceil(K/bk)]), [E] / [E, 2] per tensor
      nvfp4  `{P}` uint8 [E, N, K/2], `{P}_scale` e4m3 [E, N, K/16], `{P}_scale_2` fp32 [E] (one decode
             global per expert, shared by gate and up)
      mxfp4  `{P}` uint8 [E, N, K/32, 16] and `{P}_scales` uint8 E8M0 [E, N, K/32]: GPT-OSS' checkpoint
             tensors `{P}_blocks` / `{P}_scales` byte for byte (even element in the low nibble, rows =
             output features); a GPT-OSS MXFP4 checkpoint loads by renaming `{P}_blocks` -> `{P}`.
      nf4    `{P}` uint8 [E, (2,) N*K/2, 1], `{P}_absmax`, `{P}_quant_map` and, with double
             quantization, `{P}_nested_absmax`, `{P}_nested_quant_map`, `{P}_offset` (bitsandbytes
             QuantState per unit)
    biases `{P}_bias` stay frozen Parameters in the model dtype.
`dequantize(P)` returns the dense parameter in the original module's layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import slots as S
from .linear import Format, _apply_keep_dtypes, gemm_plan, planned_linear, quantized_linear, slot_represents, use_cuda_plan

PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def experts_projections(module: nn.Module) -> dict[str, tuple[int, int, int]]:
    """{P: (N, K, components)} for the 3-D expert parameters of `module`, {} if it holds none."""
    out = {}
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    for p in PROJECTIONS:
        t = module._parameters.get(p)
        if t is None or t.dim() != 3:
            continue
        _, a, b = t.shape
        n, k = (b, a) if transposed else (a, b)
        comps = 2 if (p == "gate_up_proj" and concatenated) else 1
        out[p] = (int(n), int(k), comps)
    return out


def is_experts_module(module: nn.Module) -> bool:
    """A dense experts module (QuantizedExperts' packed 3-D slots are Parameters too, but not dense ones)."""
    return not isinstance(module, (nn.Linear, QuantizedExperts)) and bool(experts_projections(module))


def experts_shape_problem(module: nn.Module, fmt: Format) -> str | None:
    for p, (n, k, c) in experts_projections(module).items():
        units = c if fmt.per_component else 1
        if n % units:
            return f"{p}: {n} rows do not split into {units} components"
        problem = fmt.shape_problem(n // units, k)
        if problem:
            return f"{p}: {problem}"
    return None


class QuantizedExperts(nn.Module):
    def __init__(self, template: nn.Module, fmt: Format, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        projections = experts_projections(template)
        if not projections:
            raise ValueError(f"{type(template).__name__} has no 3-D expert parameters {PROJECTIONS}")
        problem = experts_shape_problem(template, fmt)
        if problem:
            raise ValueError(f"{type(template).__name__}: {problem}")
        device = torch.device("meta") if device is None else torch.device(device)
        first = template._parameters[next(iter(projections))]
        self.dtype = dtype or first.dtype
        self.fmt = fmt
        self.quant_format = fmt.name
        self.prequantized = False
        self.is_transposed = bool(getattr(template, "is_transposed", False))
        self.num_experts = int(first.shape[0])
        self.projections = projections
        self.template_class = type(template)
        # Plain attributes and parameter-free submodules (act_fn, limits, alpha, config) are what the
        # original class' `_apply_gate` reads.
        for key, value in vars(template).items():
            if key.startswith("_") or key == "training" or key in self.__dict__ or isinstance(value, Tensor):
                continue
            object.__setattr__(self, key, value)
        for key, sub in template._modules.items():
            if sub is not None and any(True for _ in sub.parameters()):
                raise ValueError(f"{type(template).__name__}.{key} holds parameters; cannot quantize these experts")
            self.add_module(key, sub)
        self._gate_fn = getattr(type(template), "_apply_gate", None)

        for p in projections:
            _, rows, k = self.units(p)
            for suffix, (shape, dt) in self._slots(p).items():
                unit_shape = self.fmt.slots(rows, k, expert=True)[suffix][0]
                S.register_slot(self, p + suffix, shape, dt, device, slot_represents(unit_shape, rows, k, suffix))
            bias = template._parameters.get(p + "_bias")
            if bias is not None:
                self.register_parameter(
                    p + "_bias", nn.Parameter(torch.empty(bias.shape, dtype=self.dtype, device=device), requires_grad=False)
                )
            elif p + "_bias" in template._parameters:
                self.register_parameter(p + "_bias", None)
        # The dense module's skeleton (on meta), kept outside the module tree for `to_dense`.
        object.__setattr__(self, "_template", template)

    # ------------------------------------------------------------------ layout
    def units(self, p: str) -> tuple[int, int, int]:
        """(units per expert, rows per unit, K) of projection p."""
        n, k, c = self.projections[p]
        u = c if self.fmt.per_component else 1
        return u, n // u, k

    def _slots(self, p: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        u, n, k = self.units(p)
        lead = (self.num_experts,) if u == 1 else (self.num_experts, u)
        return {s: (lead + shape, dt) for s, (shape, dt) in self.fmt.slots(n, k, expert=True).items()}

    def slot_names(self) -> list[str]:
        return [p + s for p in self.projections for s in self._slots(p)]

    def unit_tensors(self, p: str, expert: int, unit: int = 0) -> dict[str, Tensor]:
        u, _, _ = self.units(p)
        idx = (expert,) if u == 1 else (expert, unit)
        # read at call time: FSDP2 re-sets the parameters on every unshard
        return {s: S.get_slot(self, p + s)[idx] for s in self.fmt.slots(*self.units(p)[1:], expert=True)}

    def _apply(self, fn, recurse=True):
        return _apply_keep_dtypes(self, fn, set(self.slot_names()), super()._apply, recurse)

    # ------------------------------------------------------------------ quantize / dequantize
    @torch.no_grad()
    def quantize_weight(self, p: str, w: Tensor) -> dict[str, Tensor]:
        """Quantize the dense 3-D parameter `p` (original layout) into {slot name: logical tensor}."""
        if p not in self.projections:
            raise KeyError(f"{type(self).__name__} has no projection {p!r}; it has {list(self.projections)}")
        n, k, _ = self.projections[p]
        expect = (self.num_experts, k, n) if self.is_transposed else (self.num_experts, n, k)
        if tuple(w.shape) != expect:
            raise ValueError(f"experts {p}: got shape {tuple(w.shape)}, expected {expect}")
        if not w.is_floating_point():
            raise TypeError(f"experts {p}: cannot quantize a non-floating tensor of dtype {w.dtype}")
        u, rows, _ = self.units(p)
        out = {p + s: torch.empty(shape, dtype=dt, device=w.device) for s, (shape, dt) in self._slots(p).items()}
        for e in range(self.num_experts):
            we = w[e].t() if self.is_transposed else w[e]
            for j in range(u):
                q = self.fmt.quantize(we[j * rows : (j + 1) * rows].contiguous(), expert=True)
                idx = (e,) if u == 1 else (e, j)
                for s, v in q.items():
                    out[p + s][idx] = v
        return out

    @torch.no_grad()
    def load_dense_weight(self, p: str, w: Tensor) -> None:
        for name, v in self.quantize_weight(p, w).items():
            S.set_slot(self, name, v)

    def dequantize(self, p: str | None = None, dtype: torch.dtype | None = None):
        """Dense parameter `p` in the original layout, or {P: dense} for all projections when p is None."""
        if p is None:
            return {q: self.dequantize(q, dtype) for q in self.projections}
        dtype = dtype or self.dtype
        u, rows, k = self.units(p)
        per_expert = []
        for e in range(self.num_experts):
            w = torch.cat([self.fmt.dequantize(self.unit_tensors(p, e, j), rows, k, dtype) for j in range(u)], 0)
            per_expert.append(w.t() if self.is_transposed else w)
        return torch.stack(per_expert).contiguous()

    def to_dense(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The original experts module holding the dequantized weights."""
        dtype = dtype or self.dtype
        dense = self._template
        for p in self.projections:
            dense._parameters[p] = nn.Parameter(self.dequantize(p, dtype), requires_grad=False)
            bias = self._parameters.get(p + "_bias")
            if bias is not None:
                dense._parameters[p + "_bias"] = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return dense

    def gemm_paths(self, tokens: int, dtype: torch.dtype | None = None, capability="current") -> dict:
        """{projection: kernels.paths.GemmPath} for `tokens` rows routed to one expert (see
        QuantizedLinear.gemm_path): each expert unit's GEMM takes the path the kernels pick for its [rows, K]."""
        from ..kernels import paths

        if capability == "current":
            capability = paths.device_capability(torch.cuda.current_device()) if torch.cuda.is_available() else None
        out = {}
        for p in self.projections:
            _, rows, k = self.units(p)
            out[p] = self.fmt.gemm_path(tokens, rows, k, dtype or self.dtype, capability)
        return out

    def quantized_nbytes(self) -> int:
        return sum(torch.numel(S.raw_slot(self, n)) * S.raw_slot(self, n).element_size() for n in self.slot_names())

    # ------------------------------------------------------------------ forward
    def _unit_linear(self, p: str, e: int, j: int, x: Tensor, rows: int, k: int) -> Tensor:
        if not use_cuda_plan(x):
            return quantized_linear(x, self.fmt, self.unit_tensors(p, e, j), rows, k)
        # one cached plan per (projection, expert, unit), valid while the projection's slots are
        cache = self.__dict__.get("_gemm_plans")
        if cache is None:
            cache = self.__dict__["_gemm_plans"] = {}
        sources = tuple(S.raw_slot(self, p + s) for s in self.fmt.slots(rows, k, expert=True))
        plan = gemm_plan(cache, (p, e, j), sources, lambda: self.fmt.cuda_plan(self.unit_tensors(p, e, j), rows, k))
        return planned_linear(x, plan)

    def _project(self, p: str, e: int, x: Tensor) -> Tensor:
        u, rows, k = self.units(p)
        ys = [self._unit_linear(p, e, j, x, rows, k) for j in range(u)]
        y = ys[0] if u == 1 else torch.cat(ys, dim=-1)
        bias = self._parameters.get(p + "_bias")
        if bias is not None:
            y = y + bias[e].to(y.dtype)
        return y

    def _gate(self, gate_up: Tensor) -> Tensor:
        if self._gate_fn is not None:
            return self._gate_fn(self, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: Tensor, top_k_index: Tensor = None, top_k_weights: Tensor = None, **kwargs):
        top_k_index = kwargs.pop("router_indices", top_k_index)
        top_k_weights = kwargs.pop("routing_weights", top_k_weights)
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unexpected arguments {sorted(kwargs)}")
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            if "gate_up_proj" in self.projections:
                h = self._gate(self._project("gate_up_proj", e, x))
            else:
                h = self.act_fn(self._project("up_proj", e, x))
            out = self._project("down_proj", e, h) * top_k_weights[tok, pos, None].to(h.dtype)
            final.index_add_(0, tok, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{p}={n}x{k}" for p, (n, k, _) in self.projections.items())
        return f"num_experts={self.num_experts}, {shapes}, format={self.quant_format}, transposed={self.is_transposed}"
