"""One call that readies a (quantized) transformers model for LoRA training.

Replaces `peft.prepare_model_for_kbit_training`, which for quantization methods it does not know casts every
bf16/fp16 parameter (norms, embeddings, lm_head) to fp32 and skips gradient checkpointing. Here every parameter
keeps the model's dtype: the adapters' fp32 masters are handled by `lora_dtype`, not by upcasting the model.
"""

from __future__ import annotations

from torch import nn

from .integrations.causal_mask import install_compiled_causal_mask_skip
from .integrations.peft import install_peft_dispatch
from .recipes.norm import fuse_norms


def prepare_for_training(
    model: nn.Module,
    gradient_checkpointing: bool = True,
    checkpointing_kwargs: dict | None = None,
    fused_norms: bool = True,
) -> nn.Module:
    """Freeze the base, enable (non-reentrant) gradient checkpointing and input gradients, and route LoRA on
    surogate quantized linears to SurogateLoraLinear. Returns `model` (modified in place); dtypes are untouched.

    Args:
        gradient_checkpointing: recompute each decoder layer in backward (transformers' activation checkpointing).
        checkpointing_kwargs: passed to torch.utils.checkpoint; default {"use_reentrant": False}.
        fused_norms: swap transformers' recognised RMSNorms for recipes.norm.FusedRMSNorm (the module the recipes
            use: same weight Parameter and state_dict key, the stock formula bit for bit on CPU, one Triton kernel
            each way on CUDA instead of the stock module's fp32 round trip of ~8 ops).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_for_training expects a torch nn.Module, got {type(model).__name__}")
    for name, flag in (("gradient_checkpointing", gradient_checkpointing), ("fused_norms", fused_norms)):
        if not isinstance(flag, bool):
            raise TypeError(f"prepare_for_training: {name} must be True or False, got {flag!r}")
    install_peft_dispatch()
    install_compiled_causal_mask_skip()
    for p in model.parameters():
        p.requires_grad_(False)
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"{type(model).__name__} does not support gradient checkpointing; pass gradient_checkpointing=False"
            )
        kwargs = {"use_reentrant": False} if checkpointing_kwargs is None else dict(checkpointing_kwargs)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers before the activation_checkpointing rename
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # reentrant checkpointing only propagates gradients when an input requires them; the frozen embedding
        # output does not, so ask for it (harmless for non-reentrant checkpointing)
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False  # the KV cache is useless in training and conflicts with recompute
    if fused_norms:
        fuse_norms(model, None)
    return model
