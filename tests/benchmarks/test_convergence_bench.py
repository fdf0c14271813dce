"""benchmarks/convergence.py and its assets: the GGUF decoders are bit-exact to gguf-py's, llama.cpp's q/k row
permutation is undone as transformers undoes it, both asset sets' caches load (norms, layer split, model class),
the tiny CPU run trains every kind of setup end to end and writes its table, curves and plot, bad input is named."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import convergence  # noqa: E402
import convergence_assets as assets  # noqa: E402


@pytest.mark.parametrize("ggml_type", [assets.Q4_1, assets.Q8_0, assets.Q5_0, assets.Q4_K, assets.Q6_K])
def test_gguf_decoders_match_gguf_py(ggml_type):
    gguf = pytest.importorskip("gguf")
    elems, nbytes = assets._BLOCK[ggml_type]
    rng = np.random.default_rng(ggml_type)
    rows, cols = 6, 2 * 256
    raw = rng.integers(0, 256, size=(rows, cols // elems * nbytes), dtype=np.uint8)
    # finite fp16 block scales: clear the exponent's top bit of every fp16 field (random bytes may be inf/NaN)
    fp16_at = {assets.Q4_1: [0, 2], assets.Q8_0: [0], assets.Q5_0: [0], assets.Q4_K: [0, 2], assets.Q6_K: [208]}[ggml_type]
    blocks = raw.reshape(-1, nbytes)
    for off in fp16_at:
        blocks[:, off + 1] &= 0x3F
    mine = assets.dequantize_gguf(raw, ggml_type, (rows, cols))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(rows, cols)
    assert np.array_equal(mine, ref)


def test_gguf_names_map_to_gemma3():
    assert assets.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert assets.hf_name("blk.17.ffn_norm.weight") == "model.layers.17.pre_feedforward_layernorm.weight"
    assert assets.hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match="GGML type 2"):
        assets.dequantize_gguf(np.zeros(18, np.uint8), 2, (32,))


def test_gguf_names_map_to_llama():
    """llama's ffn_norm is the norm before the MLP (post_attention_layernorm), Gemma's is pre_feedforward_layernorm."""
    assert assets.hf_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert assets.hf_name("output_norm.weight", "llama") == "model.norm.weight"
    assert assets.hf_name("blk.0.attn_norm.weight", "llama") == "model.layers.0.input_layernorm.weight"
    assert assets.hf_name("blk.29.ffn_norm.weight", "llama") == "model.layers.29.post_attention_layernorm.weight"
    assert assets.hf_name("blk.7.attn_k.weight", "llama") == "model.layers.7.self_attn.k_proj.weight"
    assert assets.hf_name("blk.7.ffn_down.weight", "llama") == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(KeyError):  # llama has no q/k norms, no post-attention / post-ffw norms
        assets.hf_name("blk.0.attn_q_norm.weight", "llama")


def _llama_cpp_permute(weights, n_head, n_head_kv):
    # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute (MIT): what the GGUF's attn_q / attn_k rows went through
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@pytest.mark.parametrize("which", ["q", "k"])
def test_qk_unpermute_inverts_llama_cpp_and_matches_transformers(which):
    """SmolLM2-135M's shapes: q 576 rows over 9 heads, k 192 rows over 3 kv heads; on fp32 rows and on raw Q4_1
    block rows (a row of 576 elements is 18 whole blocks, so permuting the blocks = permuting the decoded rows)."""
    heads, kv = 9, 3
    n_head = heads if which == "q" else kv
    w = np.random.default_rng(0).standard_normal((n_head * 64, 576)).astype(np.float32)
    permuted = _llama_cpp_permute(w, heads, heads if which == "q" else kv)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(assets.unpermute_qk_rows(permuted, n_head), w)
    ggml = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = ggml.LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv})
    name = f"blk.0.attn_{which}.weight"
    assert np.array_equal(proc.process(permuted, name).weights, assets.unpermute_qk_rows(permuted, n_head))
    gguf = pytest.importorskip("gguf")
    raw = gguf.quants.quantize(permuted, gguf.GGMLQuantizationType.Q4_1)  # [rows, 18 * 20 bytes]
    assert raw.shape == (n_head * 64, 18 * 20)
    decoded_then_unpermuted = assets.unpermute_qk_rows(assets.dequantize_gguf(raw, assets.Q4_1, w.shape), n_head)
    unpermuted_then_decoded = assets.dequantize_gguf(assets.unpermute_qk_rows(raw, n_head), assets.Q4_1, w.shape)
    assert np.array_equal(decoded_then_unpermuted, unpermuted_then_decoded)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=64,
               intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
               max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms that are not all ones: a wrong -1 shows
    return cfg, model


def _write_cache(root: Path, cfg: dict, model, cache: dict | None, part1_layers: int) -> Path:
    """A cache as prepare writes it, every tensor stored as GGML F32 (type 0)."""
    from safetensors.numpy import save_file

    (root / "part1").mkdir(parents=True)
    (root / "part2").mkdir()
    config = {**cfg, "source": "test"} | ({"cache": cache} if cache is not None else {})
    (root / "part1" / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg["vocab_size"], 4096).astype(np.uint16)
    np.savez(root / "part1" / "tokens.npz", train=ids[:3072], val=ids[3072:], vocab=np.arange(cfg["vocab_size"]))
    groups: dict = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = p.float().numpy()
        if cache is None and name.endswith("norm.weight"):
            w = w + 1.0  # a legacy (Gemma) cache stores norms as 1 + w
        key = int(name.split(".")[2]) if name.startswith("model.layers.") else "base"
        groups.setdefault(key, ({}, {}))
        groups[key][0][name] = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0] if w.ndim > 1 else 1, -1)
        groups[key][1][name] = json.dumps({"type": assets.F32, "shape": list(w.shape)})
    for key, (tensors, meta) in groups.items():
        path = root / "part1" / "base.safetensors" if key == "base" else (
            root / ("part1" if key < part1_layers else "part2") / f"layer_{key:02d}.safetensors")
        save_file(tensors, str(path), metadata=meta)
    return root


def test_llama_cache_loads_and_writes_a_llama_checkpoint(tmp_path):
    """load_real follows the cache block (plain norms, the part1/part2 split), write_checkpoint builds the model
    class of config["model_type"]: the checkpoint's logits are the original model's (bf16 aside)."""
    from transformers import AutoModelForCausalLM

    cfg, model = _tiny_llama()
    cache = {"asset_set": "smollm2-kjv", "part1_layers": 1, "norm_minus_one": False,
             "model_name": "tiny llama", "corpus_name": "random ids"}
    root = _write_cache(tmp_path / "cache", cfg, model, cache, part1_layers=1)
    assert assets.cache_info(root)["part1_layers"] == 1
    config, state, train, val = assets.load_real(root)
    assert "cache" not in config and config["num_hidden_layers"] == 2 and len(train) == 3072 and len(val) == 1024
    ref = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)  # norms not shifted
    ckpt = convergence.write_checkpoint(config, state, tmp_path / "ckpt", seed=0)
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = train[:32][None]
    with torch.no_grad():
        want = model.to(torch.bfloat16).float()(input_ids=ids).logits
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-4)
    # layers >= part1_layers live in part2: without it only --layers 1 loads
    (root / "part2" / "layer_01.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="--layers 1"):
        assets.load_real(root)
    assert assets.load_real(root, 1)[0]["num_hidden_layers"] == 1


def test_legacy_cache_without_cache_block_loads_as_gemma(tmp_path):
    """A config.json without "cache" (every Gemma cache prepared before the held-out set) keeps Gemma's values:
    norms stored as 1 + w get the 1 taken off, layers 0..6 in part1."""
    cfg, model = _tiny_llama()  # the layout is what counts here, not the architecture
    root = _write_cache(tmp_path / "legacy", cfg, model, None, part1_layers=7)
    assert assets.cache_info(root) == assets.LEGACY_CACHE
    _, state, _, _ = assets.load_real(root)
    ref = model.state_dict()
    for k in state:
        assert torch.allclose(state[k], ref[k]), k  # 1 + w - 1: within an fp32 rounding of w


def test_run_on_a_llama_cache_and_a_set_mismatch_is_named(tmp_path):
    cfg, model = _tiny_llama()
    cache = {"asset_set": "smollm2-kjv", "part1_layers": 1, "norm_minus_one": False,
             "model_name": "tiny llama", "corpus_name": "random ids"}
    root = _write_cache(tmp_path / "cache", cfg, model, cache, part1_layers=1)
    argv = ["--assets", str(root), "--steps", "1", "--eval-every", "1", "--batch", "2", "--seq-len", "16",
            "--val-seqs", "2", "--setups", "lora-bf16", "--device", "cpu", "--out", str(tmp_path / "run")]
    results = convergence.main(argv + ["--asset-set", "smollm2-kjv"])
    assert "error" not in results["lora-bf16"] and results["lora-bf16"]["step"] == [0, 1]
    meta = json.loads((tmp_path / "run.json").read_text())["meta"]
    assert meta["source"] == "tiny llama (2 layers, vocab cut to 64), random ids" and meta["asset_set"] == "smollm2-kjv"
    with pytest.raises(SystemExit, match="holds the asset set 'smollm2-kjv'"):
        convergence.main(argv + ["--asset-set", "gemma3-shakespeare"])


def test_missing_cache_and_bad_setups_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prepare"):
        assets.load_real(tmp_path)
    if not (assets.HELDOUT_DIR / "part1" / "config.json").exists():
        with pytest.raises(FileNotFoundError, match="--prepare --asset-set smollm2-kjv"):
            assets.load_real(assets.HELDOUT_DIR)
    with pytest.raises(SystemExit, match="matches no setup"):
        convergence.select_setups("qlora-int3")
    assert convergence.select_setups("qlora-nf4*") == ["qlora-nf4", "qlora-nf4+loftq", "qlora-nf4+aa", "qlora-nf4+gptq",
                                                       "qlora-nf4-absmax", "qlora-nf4+fp8-hybrid"]


def test_tiny_run_trains_each_kind_of_setup(tmp_path):
    out = tmp_path / "conv"
    results = convergence.main(
        ["--tiny", "--steps", "2", "--eval-every", "1", "--setups", "qlora-nf4+loftq,qlora-mxfp4+aa,qlora-nvfp4+gptq,qlora-nf4-absmax,full-fp8-hybrid", "--out", str(out), "--device", "cpu"]
    )
    # the references are added and trained in the same run
    assert list(results) == ["lora-bf16", "full-bf16", "qlora-nf4+loftq", "qlora-mxfp4+aa", "qlora-nvfp4+gptq",
                             "qlora-nf4-absmax", "full-fp8-hybrid"]
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["step"] == [0, 1, 2] and len(r["val"]) == 3 and all(np.isfinite(r["val"]))
        assert r["reference"] == ("full-bf16" if name.startswith("full") else "lora-bf16")
    assert results["lora-bf16"]["gap_pct"] == 0.0
    f = results["full-fp8-hybrid"]  # a low-precision recipe's weights are also scored under a plain bf16 forward
    assert np.isfinite(f["final_bf16_forward"]) and "final_bf16_forward" not in results["full-bf16"]
    assert f["gap_bf16_forward_pct"] == pytest.approx(100 * (f["final_bf16_forward"] / results["full-bf16"]["final"] - 1))
    q = results["qlora-nf4+loftq"]
    assert q["gap_pct"] == pytest.approx(100 * (q["final"] / results["lora-bf16"]["final"] - 1))
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["results"]["full-fp8-hybrid"]["final"] == results["full-fp8-hybrid"]["final"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    # fixed data order and seeds: the same setup trained twice gives the same curve
    again = convergence.main(["--tiny", "--steps", "2", "--eval-every", "1", "--setups", "lora-bf16", "--out", str(tmp_path / "b"), "--device", "cpu"])
    assert again["lora-bf16"]["val"] == results["lora-bf16"]["val"]


def test_precision_switch_setup_switches_for_its_tail(tmp_path):
    results = convergence.main(["--tiny", "--steps", "5", "--eval-every", "5", "--setups",
                                "full-nvfp4-notail,full-nvfp4,full-nvfp4-tail10", "--out", str(tmp_path / "sw"),
                                "--device", "cpu"])
    # the default (the last 30% of 5 steps: steps 3 and 4) and a tail of 10% (at least one step: step 4)
    assert results["full-nvfp4"]["precision_switch_step"] == 3
    assert results["full-nvfp4-tail10"]["precision_switch_step"] == 4
    assert "precision_switch_step" not in results["full-nvfp4-notail"]
    # the same 3 FP4 steps, then steps with a bf16 forward: the runs part only there
    a, b = results["full-nvfp4-notail"]["train"], results["full-nvfp4"]["train"]
    assert a[:3] == b[:3] and a[3] != b[3]


def test_bf16_forward_evaluation_takes_the_trained_weights(tmp_path):
    """evaluate_in_bf16 scores a recipe model's own weights: a bf16-recipe model (fp32 masters, bf16 compute) scores as
    under its own forward, and after its weights move, the bf16 forward sees the move."""
    from types import SimpleNamespace

    config, state, _, val_ids = convergence.tiny_assets(0)
    ckpt = convergence.write_checkpoint(config, state, tmp_path, 0)
    vals = convergence.val_batches(val_ids, 32, 2, 4)
    model, params, _ = convergence.build("full-bf16", ckpt, SimpleNamespace(lr_full=2e-5, seed=0, rank=16), "cpu")
    own = convergence.evaluate(model, vals, "cpu")
    assert convergence.evaluate_in_bf16(model, ckpt, vals, "cpu") == pytest.approx(own, rel=2e-3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    moved = convergence.evaluate(model, vals, "cpu")
    assert abs(moved - own) > 1e-2
    assert convergence.evaluate_in_bf16(model, ckpt, vals, "cpu") == pytest.approx(moved, rel=2e-3)


def test_jobs_train_setups_in_parallel_processes_with_the_same_numbers(tmp_path):
    """--jobs 2 trains the setups in two spawned processes: the same curves as one process, in setup order."""
    argv = ["--tiny", "--steps", "2", "--eval-every", "1", "--setups", "lora-bf16,qlora-fp8", "--device", "cpu"]
    one = convergence.main(argv + ["--out", str(tmp_path / "one")])
    two = convergence.main(argv + ["--out", str(tmp_path / "two"), "--jobs", "2"])
    assert list(two) == list(one) == ["lora-bf16", "qlora-fp8"]
    for name in one:
        assert "error" not in two[name], two[name]
        assert two[name]["val"] == one[name]["val"], name
    assert json.loads((tmp_path / "two").with_suffix(".json").read_text())["meta"]["jobs"] == 2
    with pytest.raises(SystemExit, match="--jobs"):
        convergence.main(argv + ["--jobs", "0"])
