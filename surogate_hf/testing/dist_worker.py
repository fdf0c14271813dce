"""One rank of the multi-process CPU (gloo) checks; launched by tests/test_distributed.py as

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m surogate_hf.testing.dist_worker OUT_DIR CASE_DIR...

(on CPU over gloo; with SUROGATE_DIST_DEVICE=cuda on one GPU per rank over NCCL, through the CUDA kernels).

Each CASE_DIR holds a checkpoint (bf16, or already quantized when `prequantized` is in its name) and a
case.json {"name", "format" (None: load as stored), "lora_targets"}. For every case each rank runs:

  fsdp   QLoRA under FSDP2 (`shard_model`: fully_shard per decoder layer + root), one SGD step on its half of
         the batch, against the same step taken by a single unsharded copy on the whole batch; packed base
         bytes this rank holds
  mp     FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): every quantized module's slots, as its forward
         sees them after the all-gather, bit-identical to the unsharded module's
  full   FULL state dict (get_model_state_dict full_state_dict) -> a fresh sharded model -> FULL again: bit-exact
  shard  SHARDED state dict through torch.distributed.checkpoint save/load into a fresh model: bit-exact
  accel  accelerate's fsdp2_prepare_model with cpu_ram_efficient_loading (rank 0's weights only): shards,
         slots bit-identical, the same training step
  ddp    DDP: the bytes it broadcasts per step (its modules_buffers) and the same training step

and rank 0 writes OUT_DIR/results.json (rank 1 writes its own byte counts to results_rank1.json).
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _device() -> torch.device:
    """cpu (gloo) unless SUROGATE_DIST_DEVICE=cuda (NCCL, one GPU per rank: tests/test_distributed.py's GPU run)."""
    if os.environ.get("SUROGATE_DIST_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_case(case_dir: str, out_dir: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import torch.distributed.checkpoint as dcp
    from surogate_hf import SurogateConfig
    from surogate_hf.distributed import ddp_broadcast_bytes, fsdp2_bytes_per_rank, packed_base_bytes, shard_model
    from surogate_hf.nn import quantized_modules
    from surogate_hf.nn import slots as S
    from surogate_hf.nn.linear import QuantizedLinear
    from surogate_hf.ops.ext import REGISTERED_DECODE_OPERANDS, decode_registry_key

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)
    pristine = AutoModelForCausalLM.from_pretrained(
        case_dir, quantization_config=SurogateConfig(format=case["format"]), dtype=torch.float32,
        device_map={"": device} if device.type == "cuda" else None,
    )
    pristine.config.use_cache = False
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=case["lora_targets"], lora_dropout=0.0, init_lora_weights=False)

    def fresh(seed=0):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(pristine), cfg)

    g = torch.Generator().manual_seed(1)
    per_rank = 2
    ids = torch.randint(0, pristine.config.vocab_size, (per_rank * world, 16), generator=g).to(device)
    mine = ids[rank * per_rank : (rank + 1) * per_rank]

    def step(model, batch):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        return loss.detach()

    res = {"name": case["name"], "world": world}
    # ---- the single-process reference (every rank computes it: cheap, and no broadcast needed)
    ref = fresh()
    ref_slots = {n: {k: v.clone() for k, v in S.named_slots(m).items()} for n, m in quantized_modules(ref)}
    ref_loss = step(ref, ids)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}

    # ---- fsdp: sharded bytes and one training step
    t0 = time.perf_counter()
    predicted = fsdp2_bytes_per_rank(pristine, world)[rank]
    model = fresh()
    # the decode operands each quantized linear registered for compiled graphs (views of its whole slots) go with the
    # Parameters FSDP2 replaces by shards, so that they keep no unsharded copy alive
    registered = {decode_registry_key(S.raw_slot(m, "weight")) for _, m in quantized_modules(model)
                  if isinstance(m, QuantizedLinear)} & REGISTERED_DECODE_OPERANDS.keys()
    model = shard_model(model)
    gc.collect()
    local, total = packed_base_bytes(model)
    loss = step(model, mine)
    dist.all_reduce(loss)
    res["fsdp"] = {
        "packed_local_bytes": local,
        "packed_total_bytes": total,
        "predicted_local_bytes": predicted,
        "loss_rel": abs(loss.item() / world - ref_loss.item()) / abs(ref_loss.item()),
        "param_max_rel": max(_max_rel(_full(p), ref_params[n]) for n, p in model.named_parameters() if p.requires_grad),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "registered_before_sharding": len(registered),
        "registered_after_sharding": len(registered & REGISTERED_DECODE_OPERANDS.keys()),
        "seconds": time.perf_counter() - t0,
    }

    # ---- mp: what the forward reads after a bf16-policy all-gather
    mp_model = shard_model(fresh(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen, bad = [], []

    def check(name):
        def hook(module, args, kwargs=None):
            for k, v in S.named_slots(module).items():
                seen.append(name)
                if not _bits_equal(v, ref_slots[name][k]):
                    bad.append(f"{name}.{k}")

        return hook

    handles = [m.register_forward_pre_hook(check(n)) for n, m in quantized_modules(mp_model)]
    with torch.no_grad():
        mp_model(input_ids=mine)
    for h in handles:
        h.remove()
    res["mp"] = {"checked_modules": len(set(seen)), "modules": len(ref_slots), "mismatched": bad[:8]}

    # ---- full: FULL state dict round trip into a fresh sharded model (different adapters before loading)
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=full_opts)
    other = shard_model(fresh(seed=7))
    # set_model_state_dict(broadcast_from_rank0) may replace the dict's values by shards: hand it a copy
    set_model_state_dict(other, dict(full), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    again = get_model_state_dict(other, options=full_opts)
    if rank == 0:
        base_sd = {k: v for k, v in ref.state_dict().items() if "lora_" not in k}
        res["full"] = {
            "keys": len(full),
            "same_keys_as_unsharded": sorted(full) == sorted(ref.state_dict()),
            "roundtrip_mismatched": [k for k in full if not _bits_equal(full[k], again[k])][:8],
            # frozen tensors (packed base, dense layers) are bit-identical to the single process's
            "frozen_mismatched": [k for k in base_sd if not _bits_equal(full[k], base_sd[k])][:8],
        }

    # ---- shard: SHARDED state dict through DCP (each rank writes and reads its own shards)
    ckpt = os.path.join(out_dir, "dcp_" + case["name"])
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
    loaded = shard_model(fresh(seed=11))
    sd = get_model_state_dict(loaded)
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(loaded, sd)
    want = dict(model.named_parameters())
    mism = [n for n, p in loaded.named_parameters() if not _bits_equal(p.to_local(), want[n].to_local())]
    mism_t = torch.tensor([len(mism)], device=device)
    dist.all_reduce(mism_t)
    res["shard"] = {"mismatched_here": mism[:8], "mismatched_all_ranks": int(mism_t.item())}

    # ---- accel: accelerate's own FSDP2 preparation (what `fsdp_version: 2` runs) with cpu_ram_efficient_loading:
    # only rank 0 holds the weights (the others are zeroed here), the model goes to meta, is sharded per decoder
    # layer, and rank 0's state dict is broadcast into the shards. accelerate enables FSDP only on GPU
    # distributed types, so its prepare function is called directly with the attributes it reads.
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    acc_model = fresh()
    if rank != 0:
        with torch.no_grad():
            for p in acc_model.parameters():
                p.zero_()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=True,
        transformer_cls_names_to_wrap=list(pristine._no_split_modules), state_dict_type="SHARDED_STATE_DICT",
    )
    acc = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                parallelism_config=None, device=device, is_main_process=rank == 0,
                                mixed_precision="no")
    acc_model = fsdp2_prepare_model(acc, acc_model)
    seen, bad = [], []
    handles = [m.register_forward_pre_hook(check(n)) for n, m in quantized_modules(acc_model)]
    aloss = step(acc_model, mine)
    for h in handles:
        h.remove()
    dist.all_reduce(aloss)
    res["accel"] = {
        "packed_local_bytes": packed_base_bytes(acc_model)[0],
        "checked_modules": len(set(seen)),
        "mismatched": bad[:8],
        "loss_rel": abs(aloss.item() / world - ref_loss.item()) / abs(ref_loss.item()),
        "param_max_rel": max(_max_rel(_full(p), ref_params[n]) for n, p in acc_model.named_parameters() if p.requires_grad),
    }

    # ---- ddp: per-step broadcast bytes, and the same step
    ddp_model = fresh()
    ddp = DDP(ddp_model, broadcast_buffers=True, device_ids=[device.index] if device.type == "cuda" else None)
    dloss = step(ddp, mine)
    dist.all_reduce(dloss)
    res["ddp"] = {
        "broadcast_bytes_per_step": sum(b.nbytes for b in ddp.modules_buffers),
        "buffer_bytes": ddp_broadcast_bytes(ddp_model),
        "packed_total_bytes": packed_base_bytes(ddp_model)[1],
        "loss_rel": abs(dloss.item() / world - ref_loss.item()) / abs(ref_loss.item()),
        "param_max_rel": max(_max_rel(p, ref_params[n]) for n, p in ddp_model.named_parameters() if p.requires_grad),
    }
    return res


def main():
    out_dir, case_dirs = sys.argv[1], sys.argv[2:]
    # a crash in native code (a signal, no Python exception) leaves this rank's Python stacks here for the test to show
    fault_log = open(os.path.join(out_dir, f"fault_rank{os.environ.get('RANK', '0')}.txt"), "w")
    faulthandler.enable(file=fault_log, all_threads=True)
    crash_marker = os.environ.get("SUROGATE_DIST_SEGFAULT_ONCE")  # the test of tests/test_distributed.py's relaunch
    if crash_marker and os.environ.get("RANK") == "0" and not os.path.exists(crash_marker):
        open(crash_marker, "w").close()
        faulthandler._sigsegv()
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        import surogate_hf.kernels  # noqa: F401  (registers the CUDA implementations)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    results = [run_case(d, out_dir) for d in case_dirs]
    name = "results.json" if rank == 0 else f"results_rank{rank}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
