"""SDPA's causal mask under torch.compile on torch < 2.13: let transformers skip it as it does in eager.

transformers builds no attention mask for SDPA when a batch has no padding (`attention_mask=None`) and the query
and key lengths allow it (`masking_utils._ignore_causal_mask_sdpa`): SDPA then runs with `is_causal=True`, on its
flash / cuDNN causal kernels. That skip is refused while exporting, which transformers tests with
`torch.compiler.is_exporting()`. Before torch 2.13, dynamo folds that call to a constant True in every compiled
frame (`torch._dynamo.variables.torch`'s constant-folded functions; 2.13 reads the real flag). So a model compiled
whole (`torch.compile(model)`, the Trainer's `torch_compile=True`) materializes a [batch, 1, seq, seq] causal mask
and SDPA runs its masked, non-causal kernels. On an H200 at SmolLM2-135M's shape (batch 4 x 2048) a built mask made
the attention kernels 2.6x slower (fprop 166 vs 61 us, bprop 416 vs 159 us a layer), about a quarter of the step.

Not covered here, on any torch: with `use_cache=False` (gradient checkpointing sets it) transformers checks
`position_ids` for packed sequences first, a check of tensor values that a graph cannot make, so it keeps the mask
(`allow_is_causal_skip=False`, which this function respects); and a batch with an `attention_mask` keeps its mask.

`install_compiled_causal_mask_skip()` registers, through transformers' public mask registry
(`AttentionMaskInterface.register("sdpa", ...)`), a mask function that returns None where transformers' own rule
would skip the mask with `attention_mask=None` (the padding-free batch) and the real export flag, and otherwise
calls the stock `sdpa_mask` unchanged. The attention math is the same causal softmax either way. It is a no-op on
torch >= 2.13 and off dynamo (eager calls the stock function, whose rule already holds there). Entry points call it:
`prepare_for_training`, `apply_recipe`, and our quantizers when they load a model (as for the PEFT dispatch);
`uninstall_compiled_causal_mask_skip()` restores the stock function. tests/integrations/test_causal_mask.py checks
the rule against transformers' own on every case it covers, and fails when upstream changes it.
"""

from __future__ import annotations

import torch

__all__ = [
    "install_compiled_causal_mask_skip",
    "uninstall_compiled_causal_mask_skip",
    "is_compiled_causal_mask_skip_installed",
    "dynamo_folds_is_exporting",
]

_STOCK = {}  # the sdpa mask function replaced, while installed


def dynamo_folds_is_exporting() -> bool:
    """Whether this torch's dynamo turns `torch.compiler.is_exporting()` into a constant True while compiling (before
    2.13; tests/integrations/test_causal_mask.py checks the version bound against a compiled probe)."""
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _skips_causal_mask(kwargs: dict) -> bool:
    """transformers' `_ignore_causal_mask_sdpa` for a batch without padding (`attention_mask=None`), with the real
    export flag: the mask is causal over equal query / key lengths, a single query, or an empty cache."""
    if not torch.compiler.is_compiling() or getattr(torch.compiler, "_is_exporting_flag", True):
        return False
    if not kwargs.get("allow_is_causal_skip", True) or kwargs.get("attention_mask", 0) is not None:
        return False
    q_length, kv_length, q_offset = kwargs.get("q_length"), kwargs.get("kv_length"), kwargs.get("q_offset", 0)
    if not isinstance(q_length, int) or not isinstance(kv_length, int) or isinstance(q_offset, torch.Tensor):
        return False  # a static cache's tensor offset (reading it would break the graph), or an unknown signature
    local = kwargs.get("local_size")
    if local is not None and kv_length >= local:
        return False  # a sliding window: the mask has more than the causal pattern
    return q_length == 1 or kv_length == q_length or q_offset == 0


def _sdpa_mask(*args, **kwargs):
    if not args and _skips_causal_mask(kwargs):
        return None
    return _STOCK["sdpa"](*args, **kwargs)


def is_compiled_causal_mask_skip_installed() -> bool:
    return "sdpa" in _STOCK


def install_compiled_causal_mask_skip(force: bool = False) -> bool:
    """Register the mask function on transformers' "sdpa" key (idempotent). Returns whether it is installed: only
    where dynamo folds `is_exporting()` (torch < 2.13), or with `force` (tests)."""
    if is_compiled_causal_mask_skip_installed():
        return True
    if not (force or dynamo_folds_is_exporting()):
        return False
    from transformers.masking_utils import AttentionMaskInterface

    _STOCK["sdpa"] = AttentionMaskInterface._global_mapping["sdpa"]
    AttentionMaskInterface.register("sdpa", _sdpa_mask)
    return True


def uninstall_compiled_causal_mask_skip() -> None:
    if not is_compiled_causal_mask_skip_installed():
        return
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("sdpa", _STOCK.pop("sdpa"))
