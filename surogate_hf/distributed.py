"""Multi-GPU helpers: FSDP2 sharding of a quantized model and the byte counts that show what shards.

The packed base (weights and scales of every quantized module) is held as frozen integer-storage
Parameters (nn/slots.py), so:
  - FSDP2 (`fully_shard`) shards it like any parameter: each rank keeps ~1/world_size of every layer's
    packed bytes and all-gathers one layer's bytes before that layer runs. A `MixedPrecisionPolicy`
    leaves it untouched (it casts floating parameters only; the packed slots are integer views).
  - DDP does not broadcast it per step (DDP broadcasts buffers before each forward, parameters once at
    construction); frozen parameters get no gradient buckets either.

    from surogate_hf.distributed import shard_model
    model = get_peft_model(model, lora_config)          # adapters first: they shard with their layer
    shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

accelerate's `fsdp_version: 2` with TRANSFORMER_BASED_WRAP does the same (one unit per decoder layer
plus the root); `shard_model` is for plain torch / accelerate-free loops.
"""

from __future__ import annotations

import torch
from torch import nn

from .nn import slots as S
from .nn.convert import decoder_layer_names, quantized_modules


def shard_model(model: nn.Module, *, mesh=None, mp_policy=None, reshard_after_forward: bool = True, offload_policy=None):
    """`fully_shard` every decoder layer, then the root (embeddings, final norm, lm_head). Returns the model.

    Raises if no decoder layer list is found (one unit for the whole model would all-gather the whole base)."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layer_names(model)
    if not layers:
        raise ValueError(
            f"shard_model: no decoder layer list found in {type(model).__name__}; call fully_shard on its "
            "blocks yourself (one FSDP unit for the whole model would all-gather the whole packed base)"
        )
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    packed = [n for n, p in model.named_parameters() if not (p.is_floating_point() or p.is_complex())]
    if packed and not fully_shard_takes_integer_params():
        # checked before the first fully_shard: a failure half-way would leave the model half sharded
        raise RuntimeError(
            f"shard_model: torch {torch.__version__}'s fully_shard cannot shard the packed base ({len(packed)} frozen "
            f"integer Parameters, e.g. {packed[0]}): it creates each sharded Parameter with requires_grad=True, "
            "which integer tensors refuse (pytorch/pytorch#177844, fixed in later releases; 2.13 has the fix). "
            "Upgrade torch, or use DDP (it replicates the base and does not broadcast it per step)"
        )
    for name in layers:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model


def fully_shard_takes_integer_params() -> bool:
    """Whether this torch's FSDP2 can shard frozen integer Parameters (the packed base). Builds without the fix of
    pytorch/pytorch#177844 (torch 2.11, for one) create each sharded Parameter as `nn.Parameter(dtensor)`, i.e.
    with requires_grad=True, and integer tensors raise there; the fix passes the original's requires_grad."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    try:
        src = inspect.getsource(FSDPParam._init_sharded_param)
    except (OSError, TypeError):  # no source shipped: assume a current torch
        return True
    return "requires_grad=param.requires_grad" in src


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    return torch.numel(t) * t.element_size()


def packed_base_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the packed base this rank holds, bytes of the whole packed base): every slot of every
    quantized module (packed weights and scales; biases excluded)."""
    local = total = 0
    for _, m in quantized_modules(model):
        for name in S.slot_specs(m):
            t = m._parameters.get(name)
            if t is None:
                t = m._buffers.get(name)
            if t is None:
                continue
            local += _nbytes(_local(t))
            total += _nbytes(t)
    return local, total


def fsdp2_bytes_per_rank(model: nn.Module, world_size: int) -> list[int]:
    """Packed base bytes each of `world_size` ranks would hold under FSDP2, from the slot shapes alone (works on
    meta-device models): FSDP2 splits every parameter along dim 0 with torch.chunk semantics (ceil-sized
    chunks, trailing ranks possibly empty). tests/test_distributed.py checks it against the measured shards."""
    per_rank = [0] * world_size
    for _, m in quantized_modules(model):
        for name in S.slot_specs(m):
            t = m._parameters.get(name)
            if t is None:
                continue
            rows = t.shape[0]
            row_bytes = (torch.numel(t) // max(rows, 1)) * t.element_size()
            chunk = -(-rows // world_size)
            for r in range(world_size):
                per_rank[r] += max(0, min(chunk, rows - r * chunk)) * row_bytes
    return per_rank


def ddp_broadcast_bytes(module: nn.Module) -> int:
    """Bytes DDP(broadcast_buffers=True) broadcasts from rank 0 before every forward: the module's buffers
    (persistent or not) minus `_ddp_params_and_buffers_to_ignore`."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return sum(_nbytes(b) for name, b in module.named_buffers() if name not in ignore)
