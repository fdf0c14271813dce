"""Multi-process CPU checks on gloo (2 ranks, `torch.distributed.run`): FSDP2 shards the packed base, trains
like one process, keeps the packed bytes intact under a bf16 MixedPrecisionPolicy, round-trips SHARDED and
FULL state dicts bit-exact, and goes through accelerate's FSDP2 preparation with cpu_ram_efficient_loading;
DDP broadcasts no packed bytes per step. One launch runs every case
(surogate_hf/testing/dist_worker.py says what each rank does); the tests below read its results.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from surogate_hf.testing.models import save_tiny_model

WORLD = 2
# (name, model kind, format at load (None: a pre-quantized checkpoint loaded as stored), LoRA targets)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
CASES = [
    ("llama_fp8", "llama", "fp8", "all-linear"),
    ("llama_nvfp4", "llama", "nvfp4", "all-linear"),
    ("llama_mxfp4", "llama", "mxfp4", "all-linear"),
    ("llama_nf4", "llama", "nf4", "all-linear"),
    ("qwen3_moe_nvfp4", "qwen3_moe", "nvfp4", ATTN),  # fused experts: [E, ...] slots shard by expert
    ("gpt_oss_mxfp4", "gpt_oss", "mxfp4", ATTN),
    ("llama_prequantized_nf4", "llama", None, "all-linear"),  # bitsandbytes layout, carried QuantState slot
]


def _write_case(root, name, kind, fmt, targets):
    d = root / name
    if fmt is None:  # quantize once, save in the standard layout, load that as a pre-quantized checkpoint
        from transformers import AutoModelForCausalLM

        from surogate_hf import SurogateConfig

        dense = save_tiny_model(kind, root / (name + "_dense"), num_hidden_layers=2)
        q = AutoModelForCausalLM.from_pretrained(dense, quantization_config=SurogateConfig(format=name.rsplit("_", 1)[1]))
        q.save_pretrained(d)
    else:
        save_tiny_model(kind, d, num_hidden_layers=2)
    with open(d / "case.json", "w") as f:
        json.dump({"name": name, "format": fmt, "lora_targets": targets}, f)
    return str(d)


def _native_crashes(root) -> str:
    """The Python stacks faulthandler wrote for each rank that died of a fatal signal in native code (dist_worker
    enables it per rank); empty when none did."""
    dumps = [(f.name, f.read_text()) for f in sorted(root.glob("fault_rank*.txt"))]
    return "\n".join(f"--- {name}\n{text}" for name, text in dumps if text.strip())


def _launch(root, dirs, extra_env=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "surogate_hf.testing.dist_worker", str(root), *dirs]
    # A rank that dies of a signal (CI once saw rank 0 SIGSEGV inside a gloo collective; 26 local launches, 6 of them
    # beside two CPU-bound processes, never did) gets one relaunch, reported as a warning with its stacks; a second
    # failure, or any Python error, fails.
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        crashes = _native_crashes(root)
        if proc.returncode == 0:
            break
        if attempt == 1 and crashes:
            warnings.warn(f"distributed worker: a rank died of a signal in native code (rc {proc.returncode}); "
                          f"relaunched once. Its stacks:\n{crashes[-6000:]}")
            continue
        pytest.fail(f"distributed worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
                    f"\n{crashes[-6000:]}")
    with open(root / "results.json") as f:
        out = {r["name"]: r for r in json.load(f)}
    with open(root / "results_rank1.json") as f:
        for r in json.load(f):
            out[r["name"]]["rank1_fsdp"] = r["fsdp"]
    for name, r in out.items():
        f = r["fsdp"]
        print(f"[{name}] packed base per rank {f['packed_local_bytes']} / {f['packed_total_bytes']} B "
              f"({f['packed_local_bytes'] / f['packed_total_bytes']:.3f}); DDP broadcast/step {r['ddp']['broadcast_bytes_per_step']} B")
    return out


def test_a_rank_that_dies_of_a_signal_is_relaunched_once_with_its_stacks(tmp_path):
    """_launch's one relaunch: rank 0 segfaults in the first launch (the worker's SUROGATE_DIST_SEGFAULT_ONCE switch),
    the second passes, and the warning carries the dead rank's Python stacks; without the switch nothing is dumped."""
    marker = tmp_path / "crashed"
    with pytest.warns(UserWarning, match="died of a signal") as record:
        assert _launch(tmp_path, [], {"SUROGATE_DIST_SEGFAULT_ONCE": str(marker)}) == {}
    assert marker.exists()
    message = str(next(r.message for r in record if "died of a signal" in str(r.message)))
    assert "fault_rank0.txt" in message and "Segmentation fault" in message and "dist_worker.py" in message, message
    assert _native_crashes(tmp_path) == ""  # the relaunch truncated the dump: a clean run leaves none


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return _launch(root, [_write_case(root, *c) for c in CASES])


NAMES = [c[0] for c in CASES]


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_shards_the_packed_base(results, name):
    r = results[name]
    for f in (r["fsdp"], r["rank1_fsdp"]):
        assert f["packed_total_bytes"] > 0
        # dim-0 shards of every slot: ~1/world each (uneven rows go to the first rank)
        assert f["packed_local_bytes"] <= 0.55 * f["packed_total_bytes"], f
        # the per-rank figure computed from slot shapes alone (docs/multigpu.md's table) is what FSDP2 holds
        assert f["predicted_local_bytes"] == f["packed_local_bytes"], f
    assert r["fsdp"]["packed_local_bytes"] + r["rank1_fsdp"]["packed_local_bytes"] == r["fsdp"]["packed_total_bytes"]


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_sharding_releases_the_registered_graph_operands(results, name):
    """Each quantized linear registers its decode operands (views of its whole slots) for compiled graphs; sharding
    replaces its Parameters, and the registrations go with them: no unsharded copy stays alive."""
    f = results[name]["fsdp"]
    assert f["registered_before_sharding"] > 0 and f["registered_after_sharding"] == 0, f


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_and_ddp_qlora_step_match_one_process(results, name):
    r = results[name]
    assert r["fsdp"]["trainable"] > 0
    for mode in ("fsdp", "ddp"):
        # the same SGD step on the whole batch in one process; only the gradient reduction order differs
        assert r[mode]["loss_rel"] < 1e-5, (mode, r[mode])
        assert r[mode]["param_max_rel"] < 1e-5, (mode, r[mode])


@pytest.mark.parametrize("name", NAMES)
def test_bf16_mixed_precision_policy_leaves_packed_bytes_intact(results, name):
    mp = results[name]["mp"]
    assert mp["checked_modules"] == mp["modules"] > 0 and not mp["mismatched"], mp


@pytest.mark.parametrize("name", NAMES)
def test_full_and_sharded_state_dicts_round_trip_bit_exact(results, name):
    full, shard = results[name]["full"], results[name]["shard"]
    assert full["same_keys_as_unsharded"] and not full["roundtrip_mismatched"] and not full["frozen_mismatched"], full
    assert shard["mismatched_all_ranks"] == 0, shard


@pytest.mark.parametrize("name", NAMES)
def test_accelerate_fsdp2_prepare_with_cpu_ram_efficient_loading(results, name):
    a, total = results[name]["accel"], results[name]["fsdp"]["packed_total_bytes"]
    assert a["packed_local_bytes"] <= 0.55 * total, a
    assert a["checked_modules"] == results[name]["mp"]["modules"] and not a["mismatched"], a
    assert a["loss_rel"] < 1e-5 and a["param_max_rel"] < 1e-5, a


@pytest.mark.parametrize("name", NAMES)
def test_ddp_broadcasts_no_packed_bytes(results, name):
    d = results[name]["ddp"]
    assert d["broadcast_bytes_per_step"] == d["buffer_bytes"]
    assert d["broadcast_bytes_per_step"] < d["packed_total_bytes"] / 1000, d



@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_example_qlora_multigpu_runs_ddp_on_two_cpu_ranks(tmp_path, loop):
    """examples/qlora_multigpu.py under torchrun on CPU: accelerate / the Trainer wrap it in DDP over gloo."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           os.path.join(root, "examples", "qlora_multigpu.py"), "--cpu", "--loop", loop, "--steps", "3", "--batch", "4",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    if proc.returncode != 0:
        pytest.fail(f"example failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    for rank in range(WORLD):
        assert f"[rank {rank}] loaded: packed base held here" in proc.stdout
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def _two_gpus():
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
    except Exception:  # noqa: BLE001
        return False


def test_shard_model_refuses_a_torch_whose_fully_shard_cannot_take_integer_params(monkeypatch):
    """torch 2.11's fully_shard raises deep inside on the packed base (pytorch#177844, seen on the GPU machine): the
    error must name the cause before anything is sharded."""
    import surogate_hf.distributed as D
    from surogate_hf.nn.convert import replace_with_quantized_modules
    from surogate_hf.testing.models import build_tiny_model

    model = build_tiny_model("llama", num_hidden_layers=2)
    replace_with_quantized_modules(model, "fp8")
    monkeypatch.setattr(D, "fully_shard_takes_integer_params", lambda: False)
    with pytest.raises(RuntimeError, match=r"177844.*Upgrade torch"):
        D.shard_model(model)
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())  # nothing half-sharded


def test_fully_shard_probe_matches_this_torch():
    """The probe reads fully_shard's source; on the torch CI installs (2.13) the fix is present."""
    from surogate_hf.distributed import fully_shard_takes_integer_params

    assert fully_shard_takes_integer_params() is True


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason=f"needs {WORLD} CUDA GPUs")
def test_same_checks_on_gpus_over_nccl(tmp_path):
    """The gloo checks on one GPU per rank (NCCL, the CUDA kernels and their cached GEMM plans under FSDP2's
    unshard / reshard). The single-process reference runs the same kernels on a batch twice as large, so the
    step matches to GEMM rounding rather than to the reduction order."""
    from surogate_hf.distributed import fully_shard_takes_integer_params

    if not fully_shard_takes_integer_params():
        pytest.skip(f"torch {torch.__version__}: fully_shard cannot shard integer Parameters (pytorch#177844)")
    out = _launch(tmp_path, [_write_case(tmp_path, *c) for c in CASES], {"SUROGATE_DIST_DEVICE": "cuda"})
    for name, r in out.items():
        for f in (r["fsdp"], r["rank1_fsdp"]):
            assert f["packed_local_bytes"] == f["predicted_local_bytes"] <= 0.55 * f["packed_total_bytes"], (name, f)
        assert not r["mp"]["mismatched"] and r["mp"]["checked_modules"] == r["mp"]["modules"], (name, r["mp"])
        assert not r["full"]["roundtrip_mismatched"] and not r["full"]["frozen_mismatched"], (name, r["full"])
        assert r["shard"]["mismatched_all_ranks"] == 0, (name, r["shard"])
        assert not r["accel"]["mismatched"], (name, r["accel"])
        for mode in ("fsdp", "ddp", "accel"):
            assert r[mode]["loss_rel"] < 1e-3 and r[mode]["param_max_rel"] < 1e-2, (name, mode, r[mode])
        assert r["ddp"]["broadcast_bytes_per_step"] < r["ddp"]["packed_total_bytes"] / 1000, (name, r["ddp"])
