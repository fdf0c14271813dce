"""benchmarks/convergence.py and its assets: the GGUF decoders are bit-exact to gguf-py's, the tiny CPU run
trains every kind of setup end to end and writes its table, curves and plot, bad input is named."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_missing_cache_and_bad_setups_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prepare"):
        assets.load_real(tmp_path)
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
    q = results["qlora-nf4+loftq"]
    assert q["gap_pct"] == pytest.approx(100 * (q["final"] / results["lora-bf16"]["final"] - 1))
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["results"]["full-fp8-hybrid"]["final"] == results["full-fp8-hybrid"]["final"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    # fixed data order and seeds: the same setup trained twice gives the same curve
    again = convergence.main(["--tiny", "--steps", "2", "--eval-every", "1", "--setups", "lora-bf16", "--out", str(tmp_path / "b"), "--device", "cpu"])
    assert again["lora-bf16"]["val"] == results["lora-bf16"]["val"]


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
