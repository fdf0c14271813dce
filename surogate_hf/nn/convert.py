"""Swap a model's linears and fused experts for quantized modules, on meta, before weights load.

Rules (in order) deciding whether a module is quantized:
  1. only `nn.Linear` of exactly that type (not subclasses such as LoRA or already-quantized layers)
     and fused experts modules (3-D `gate_up_proj` / `up_proj` / `down_proj` parameters);
  2. `skip` patterns keep a module in the model dtype: transformers' defaults (lm_head / output
     embeddings, tied weights), `modules_to_not_convert`, `_keep_in_fp32_modules`; matched like
     transformers does (module-boundary prefix, regex, or suffix: `should_convert_module`) against
     the module's name or any ancestor's (so "self_attn" keeps every projection of attention dense);
  3. decoder layers `skip_quant_first_layers` / `skip_quant_last_layers` stay in the model dtype;
  4. `module_filter(module, fqn) -> bool`, when given, can veto more;
  5. a module whose shape the format cannot tile (NVFP4/MXFP4 need in_features % 16 / % 32, NF4
     needs out*in % block) stays in the model dtype, named in one warning per conversion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .experts import QuantizedExperts, experts_shape_problem, is_experts_module
from .linear import QuantizedLinear, linear_class, make_format


class SurogateWarning(UserWarning):
    """A module was kept in high precision or an option had no effect."""


@dataclass
class ConversionReport:
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Names of the decoder layers, in order: the longest ModuleList whose length equals
    config.num_hidden_layers (or the longest `*.layers` ModuleList)."""
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if n_layers is None and hasattr(model, "config") and hasattr(model.config, "get_text_config"):
        n_layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    exact = [(name, m) for name, m in lists if len(m) == n_layers]
    pool = exact or [(name, m) for name, m in lists if name.split(".")[-1] == "layers"]
    if not pool:
        return []
    name, ml = max(pool, key=lambda nm: len(nm[1]))
    prefix = f"{name}." if name else ""
    return [f"{prefix}{i}" for i in range(len(ml))]


def _matches(name: str, patterns: list[str]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return not should_convert_module(name, patterns)


def _matches_self_or_ancestor(name: str, patterns: list[str]) -> bool:
    """A pattern naming a module also keeps everything inside it dense ("self_attn" covers its q_proj)."""
    parts = name.split(".")
    return any(_matches(".".join(parts[:i]), patterns) for i in range(len(parts), 0, -1))


def unmatched_patterns(model: nn.Module, patterns: list[str] | None) -> list[str]:
    if not patterns:
        return []
    names = [n for n, _ in model.named_modules() if n]
    return [p for p in patterns if not any(_matches(n, [p]) for n in names)]


def quantized_module_for(module: nn.Module, fmt_name: str, options: dict, dtype=None) -> nn.Module:
    """The meta quantized replacement of a dense nn.Linear or experts module."""
    if is_experts_module(module):
        return QuantizedExperts(module, make_format(fmt_name, **options), dtype=dtype)
    dtype = dtype or module.weight.dtype
    return linear_class(fmt_name)(
        module.in_features, module.out_features, bias=module.bias is not None, device="meta", dtype=dtype, **options
    )


def check_skip_layers(first: int, last: int, n_layers: int) -> None:
    """skip_quant_first_layers / skip_quant_last_layers must select decoder layers the model has."""
    if not (first or last):
        return
    if n_layers <= 0:
        raise ValueError(
            f"skip_quant_first_layers={first} / skip_quant_last_layers={last}: no decoder layer list was found in "
            "the model, so the knobs select nothing; drop them"
        )
    if first + last > n_layers:
        raise ValueError(
            f"skip_quant_first_layers ({first}) + skip_quant_last_layers ({last}) exceed the model's {n_layers} "
            "decoder layers"
        )


def module_plan(
    model: nn.Module,
    is_candidate: Callable[[nn.Module], bool],
    *,
    skip: list[str] | tuple[str, ...] = (),
    skip_first_layers: int = 0,
    skip_last_layers: int = 0,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    only_in_layers: bool = False,
) -> list[tuple[str, nn.Module, str | None]]:
    """(fqn, module, why it stays in the model dtype or None) for every candidate module, in model order.

    The one module selection of the package: the quantizer (replace_with_quantized_modules) and apply_recipe
    both use it, so the same knob selects the same modules. Rules 2-4 of the module docstring: `skip` patterns
    against the module and its ancestors (transformers' should_convert_module), the first / last decoder layers
    (decoder_layer_names), then `module_filter(module, fqn)`; with `only_in_layers`, modules outside the decoder
    layers stay too (the recipes convert the transformer blocks only).
    """
    layers = decoder_layer_names(model)
    check_skip_layers(skip_first_layers, skip_last_layers, len(layers))
    kept_layers = layers[:skip_first_layers] + (layers[len(layers) - skip_last_layers :] if skip_last_layers else [])
    skip = list(skip)
    plan = []
    for name, module in model.named_modules():
        if not is_candidate(module):
            continue
        in_layer = lambda prefixes: any(name.startswith(p + ".") for p in prefixes)  # noqa: E731
        if skip and _matches_self_or_ancestor(name, skip):
            why = "modules_to_not_convert / default skip"
        elif in_layer(kept_layers):
            why = "skip_quant_first_layers / skip_quant_last_layers"
        elif only_in_layers and not in_layer(layers):
            why = "outside the decoder layers"
        elif module_filter is not None and not module_filter(module, name):
            why = "module_filter"
        else:
            why = None
        plan.append((name, module, why))
    return plan


def replace_with_quantized_modules(
    model: nn.Module,
    fmt_name: str,
    options: dict | None = None,
    *,
    skip: list[str] | None = None,
    skip_first_layers: int = 0,
    skip_last_layers: int = 0,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    dtype: torch.dtype | None = None,
) -> ConversionReport:
    options = options or {}
    fmt = make_format(fmt_name, **options)
    report = ConversionReport()
    plan = module_plan(
        model, lambda m: type(m) is nn.Linear or is_experts_module(m), skip=skip or [],
        skip_first_layers=skip_first_layers, skip_last_layers=skip_last_layers, module_filter=module_filter,
    )
    bad_shape: dict[str, str] = {}
    for name, module, why in plan:
        if why is not None:
            report.skipped[name] = why
            continue
        experts = is_experts_module(module)
        problem = (
            experts_shape_problem(module, fmt) if experts else fmt.shape_problem(module.out_features, module.in_features)
        )
        if problem:
            report.skipped[name] = problem
            bad_shape[name] = problem
            continue
        new = quantized_module_for(module, fmt_name, options, dtype=dtype if experts else (dtype or module.weight.dtype))
        model.set_submodule(name, new)
        report.quantized.append(name)

    if bad_shape:
        listed = "; ".join(f"{n} ({why})" for n, why in list(bad_shape.items())[:8])
        more = f" and {len(bad_shape) - 8} more" if len(bad_shape) > 8 else ""
        warnings.warn(
            f"surogate_hf: {len(bad_shape)} module(s) kept in the model dtype because format {fmt_name!r} cannot "
            f"tile their shape: {listed}{more}",
            SurogateWarning,
            stacklevel=2,
        )
    return report


def quantized_modules(model: nn.Module):
    """(name, module) for every surogate quantized module of `model`."""
    for name, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedExperts)):
            yield name, m


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized module by its dense equivalent (nn.Linear / the original experts)."""
    for name, m in list(quantized_modules(model)):
        model.set_submodule(name, m.to_dense(dtype))
    return model

