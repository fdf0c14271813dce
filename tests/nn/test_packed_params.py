"""The packed base as frozen integer-storage Parameters: what FSDP2 and DDP see of it, and parameter counts.

Single-process checks (fast): storage form of every slot, parameter counts equal to the dense model's (in
transformers and PEFT), a FSDP2 MixedPrecisionPolicy cannot cast any slot, and the bytes DDP broadcasts
per step (its buffers) for a QLoRA model of every format. The multi-process gloo runs are in
tests/test_distributed.py.
"""

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from surogate_hf.testing.models import save_tiny_model
from surogate_hf import SurogateConfig
from surogate_hf.distributed import ddp_broadcast_bytes, packed_base_bytes
from surogate_hf.nn import quantized_modules
from surogate_hf.nn import slots as S

FORMATS = ("fp8", "nvfp4", "mxfp4", "nf4")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {kind: save_tiny_model(kind, root / kind, num_hidden_layers=2) for kind in ("llama", "qwen3_moe")}


def _load(path, fmt):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format=fmt), dtype=torch.bfloat16)


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_slots_are_frozen_integer_parameters_and_no_buffers(dirs, kind, fmt):
    model = _load(dirs[kind], fmt)
    mods = dict(quantized_modules(model))
    assert mods
    for name, m in mods.items():
        assert not list(m.buffers(recurse=False)), name
        for slot in S.slot_specs(m):
            p = m._parameters[slot]
            assert isinstance(p, S.PackedParameter) and not p.requires_grad, (name, slot)
            # FSDP2's MixedPrecisionPolicy casts floating parameters only; FSDP2 cannot shard 0-dim ones
            assert not p.is_floating_point() and p.dim() >= 1, (name, slot, p.dtype, tuple(p.shape))
    # state_dict keys are the slot names (storage form); nothing dense of weight size
    sd = model.state_dict()
    q = next(iter(mods))
    assert f"{q}.weight" in sd and sd[f"{q}.weight"].dtype == torch.uint8


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_parameter_counts_are_represented_weights(dirs, kind, fmt):
    dense = AutoModelForCausalLM.from_pretrained(dirs[kind], dtype=torch.bfloat16)
    model = _load(dirs[kind], fmt)
    # transformers counts bitsandbytes' packed 4-bit Params4bit as two weights per byte and leaves its
    # quant state out: the quantized model has as many parameters as the dense one
    assert model.num_parameters() == dense.num_parameters()
    # PEFT's print_trainable_parameters reads get_nb_trainable_parameters
    pm, pd = _lora(model), _lora(dense)
    trainable, total = pm.get_nb_trainable_parameters()
    trainable_d, total_d = pd.get_nb_trainable_parameters()
    assert (trainable, total) == (trainable_d, total_d)
    # the stored elements stay reachable: torch.numel / nbytes
    local, whole = packed_base_bytes(model)
    assert local == whole > 0
    assert whole == sum(m.quantized_nbytes() for _, m in quantized_modules(model))


def test_packed_parameter_keeps_its_count_through_copies_and_moves():
    p = S.to_storage(torch.zeros(8, 3, dtype=torch.uint8), represents=2)
    assert p.numel() == 48 and torch.numel(p) == 24 and p.nbytes == 24
    import copy
    import pickle

    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert isinstance(q, S.PackedParameter) and q.numel() == 48 and not q.requires_grad
    m = torch.nn.Module()
    m.w = p
    m.to("cpu")
    m.float()
    assert m.w is p and m.w.dtype == torch.uint8
    # call-time views are plain tensors: code sizing buffers from numel() sees the stored count
    assert type(S.logical_view(p, (8, 3), torch.uint8)) is torch.Tensor


@pytest.fixture()
def single_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt", FORMATS)
def test_ddp_broadcasts_no_packed_bytes_per_step(dirs, fmt, single_process_group):
    """DDP(broadcast_buffers=True), the Trainer's default, broadcasts `modules_buffers` before every forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    pm = _lora(_load(dirs["qwen3_moe"], fmt))
    _, packed = packed_base_bytes(pm)
    ddp = DDP(pm, broadcast_buffers=True)
    per_step = sum(b.nbytes for b in ddp.modules_buffers)
    assert per_step == ddp_broadcast_bytes(pm)
    print(f"[ddp {fmt}] per-step broadcast {per_step} B vs packed base {packed} B")
    # what remains is the rotary inv_freq (head_dim / 2 fp32 values per rotary embedding)
    assert per_step <= 1024 and per_step < packed / 1000
    # frozen packed slots get no gradient bucket: DDP all-reduces the LoRA gradients only
    assert all(not p.requires_grad for _, m in quantized_modules(pm) for p in m.parameters(recurse=False))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "nf4"])
def test_prequantized_checkpoint_counts_and_slots(dirs, tmp_path, fmt):
    """A checkpoint saved in the standard layout and loaded as stored (SurogateConfig()): same slots' storage
    form and the dense model's parameter count."""
    _load(dirs["llama"], fmt).save_pretrained(tmp_path / fmt)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / fmt, quantization_config=SurogateConfig(), dtype=torch.bfloat16)
    dense = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.bfloat16)
    mods = dict(quantized_modules(model))
    assert mods and all(m.prequantized for m in mods.values())
    for name, m in mods.items():
        assert not list(m.buffers(recurse=False)), name
        assert all(isinstance(p, S.PackedParameter) and not p.is_floating_point() and p.dim() >= 1
                   for n, p in m.named_parameters(recurse=False) if n in S.slot_specs(m)), name
    assert model.num_parameters() == dense.num_parameters()


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_state_dict_accepts_the_logical_form(fmt):
    """A state dict holding slots in their logical dtypes and shapes (fp32 / e4m3 scales, 0-dim globals) loads
    by bytes, never by a value cast into the integer storage."""
    from surogate_hf.nn import LINEAR_CLASSES

    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    src = LINEAR_CLASSES[fmt].from_linear(lin)
    logical = {n: v.clone() for n, v in S.named_slots(src).items()}
    logical["bias"] = src.bias.detach().clone()
    dst = LINEAR_CLASSES[fmt](128, 64, bias=True, device="cpu", dtype=torch.bfloat16)
    dst.load_state_dict(logical)
    for n, v in S.named_slots(dst).items():
        assert v.dtype == logical[n].dtype and torch.equal(v.reshape(-1).view(torch.uint8), logical[n].reshape(-1).view(torch.uint8)), n
    assert all(S.is_storage_form(dst, n) for n in S.slot_specs(dst))
    dst.load_state_dict(src.state_dict())  # and the storage form, as saved by FSDP2 / DCP
    assert torch.equal(dst(lin.weight.new_ones(2, 128)), src(lin.weight.new_ones(2, 128)))


def test_set_slot_rejects_a_wrong_dtype_or_shape_naming_the_slot():
    from surogate_hf.nn import LINEAR_CLASSES

    m = LINEAR_CLASSES["fp8"](128, 64, bias=False, device="cpu")
    with pytest.raises(TypeError, match="weight_scale_inv: got dtype torch.bfloat16"):
        S.set_slot(m, "weight_scale_inv", torch.ones(1, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight_scale_inv: got shape \[2, 1\], expected \[1, 1\]"):
        S.set_slot(m, "weight_scale_inv", torch.ones(2, 1))
