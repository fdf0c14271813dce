"""`surogate-hf sft`: the embedded default runs offline and writes adapter + metrics.json + loss_curve.png; bad
configs stop with a message naming the problem before anything is loaded."""

import json
import subprocess
import sys

import pytest
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from surogate_hf import SurogateConfig, __version__
from surogate_hf.cli import ConfigError, check_config, default_config_text, load_config, main
from surogate_hf.integrations.peft import SurogateLoraLinear


def test_default_sft_runs_offline_and_writes_artifacts(tmp_path, capsys):
    out = tmp_path / "run"
    data = "[{type: synthetic, task: reverse, alphabet: 16, min_len: 4, max_len: 8, samples: 1200, eval_samples: 128}]"
    rc = main(["sft", "--set", f"output_dir={out}", "--set", "max_steps=30", "--set", f"datasets={data}"])
    assert rc == 0
    assert "exact match" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 30 and m["qlora_format"] == "fp8" and m["lora_dtype"] == ["float32"]
    before, after = m["task_metrics_before"]["reverse[0]"], m["task_metrics_after"]["reverse[0]"]
    print(f"cli: loss {m['train_loss_first']:.3f} -> {m['train_loss_last']:.3f}, token accuracy "
          f"{before['token_accuracy']:.3f} -> {after['token_accuracy']:.3f}, {m['total_seconds']}s")
    assert m["train_loss_last"] < m["train_loss_first"]
    assert after["token_accuracy"] > before["token_accuracy"] + 0.05
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter goes back onto the fp8 base it was trained on
    base = AutoModelForCausalLM.from_pretrained(out / "base_model", quantization_config=SurogateConfig(format="fp8"))
    model = PeftModel.from_pretrained(base, out / "adapter")
    assert any(isinstance(mod, SurogateLoraLinear) for mod in model.modules())


def test_embedded_default_config_is_valid_and_packaged():
    cfg = check_config(yaml.safe_load(default_config_text()))
    assert cfg["model"] == "builtin:tiny-llama" and cfg["qlora_fp8"] and cfg["datasets"][0]["type"] == "synthetic"


def _err(tmp_path, capsys, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert main(["sft", str(path), "--set", f"output_dir={tmp_path / 'never'}"]) == 2
    assert not (tmp_path / "never").exists()  # stopped before anything was created or loaded
    return capsys.readouterr().err


BASE = "model: builtin:tiny-llama\ndatasets: [{type: synthetic}]\n"


def test_unknown_keys_are_named(tmp_path, capsys):
    err = _err(tmp_path, capsys, BASE + "lora_rnak: 8\nfoo: 1\noffload_master: true\n")
    assert "lora_rnak (did you mean lora_rank?)" in err and "foo" in err
    assert "not supported by surogate-hf sft: offload_master" in err


def test_two_qlora_formats(tmp_path, capsys):
    err = _err(tmp_path, capsys, BASE + "qlora_fp8: true\nqlora_bnb: true\n")
    assert "qlora_fp8 and qlora_bnb are set together" in err


def test_prequantized_model_with_a_qlora_flag_stops_before_loading(tmp_path, capsys):
    ckpt = tmp_path / "fp8-ckpt"  # a config.json only: loading any weights would fail, so none are loaded
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    err = _err(tmp_path, capsys, f"model: {ckpt}\nqlora_fp4: true\ndatasets: [{{type: text, path: x.jsonl}}]\n")
    assert "pre-quantized (quant_method: fp8)" in err and "drop qlora_fp4" in err


@pytest.mark.parametrize(
    "text,needle",
    [
        (BASE + "qlora_fp8: true\nlora: false\n", "needs lora: true"),
        (BASE + "lora_rank: many\n", "lora_rank: must be an integer"),
        (BASE + "sample_packing: true\n", "sample_packing: true is not supported"),
        (BASE + "qlora_bnb: true\nqlora_bnb_block_size: 256\n", "qlora_bnb_block_size: 256"),
        (BASE + "recipe: fp9\n", "recipe:"),
        (BASE + "qlora_fp4: true\nqlora_block_size: 64\n", "qlora_block_size: 64 only applies with qlora_fp8: true"),
        (BASE + "qlora_fp8: true\nqlora_four_over_six: false\n", "qlora_four_over_six: False only applies with qlora_fp4"),
        (BASE + "qlora_bnb_double_quant: false\n", "qlora_bnb_double_quant: False only applies with qlora_bnb"),
        ("model: builtin:tiny-llama\ndatasets: [{type: text, path: a.jsonl}]\n", "only trains on type: synthetic"),
        ("model: builtin:tiny-llama\ndatasets: [{type: synthetic, task: unscramble}]\n", "task must be one of"),
        ("datasets: [{type: synthetic}]\n", "model is required"),
        (BASE + "qlora_init: activation_aware\n", "qlora_init: activation_aware compensates the quantization error"),
        (BASE + "qlora_bnb: true\nqlora_init: loftq\nqlora_init_windows: 4\n",
         "qlora_init_windows: 4 only applies with qlora_init: activation_aware"),
        (BASE + "qlora_bnb: true\nqlora_init: loftq\nqlora_init_iters: 7\n", "qlora_init_iters: 7 is above 5"),
        (BASE + "qlora_init_iters: 2\n", "qlora_init_iters: 2 only applies with qlora_init: loftq or activation_aware"),
    ],
)
def test_bad_values_and_combinations(tmp_path, capsys, text, needle):
    assert needle in _err(tmp_path, capsys, text)


def test_overrides_and_print_config(capsys):
    assert main(["sft", "--set", "lora_rank=4", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora_rank"] == 4 and printed["qlora_fp8"] is True
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["lora_rank"])


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "surogate_hf.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == __version__


class _ByteTokenizer:
    """A stand-in for an HF tokenizer (no files needed): bytes as ids, 1 = bos, 2 = eos."""

    pad_token_id, eos_token_id = 0, 2

    def __call__(self, text, add_special_tokens=True, truncation=False, max_length=None):
        ids = ([1] if add_special_tokens else []) + [3 + b for b in text.encode()]
        return {"input_ids": ids[:max_length] if truncation else ids}


def test_instruction_and_text_datasets_from_local_files(tmp_path):
    from surogate_hf.cli import build_data

    inst = tmp_path / "inst.jsonl"
    inst.write_text("\n".join(json.dumps({"q": f"say {i}", "a": str(i)}) for i in range(20)))
    text = tmp_path / "text.json"
    text.write_text(json.dumps([{"body": "x" * 50}] * 10))
    cfg = check_config({
        "model": str(tmp_path), "sequence_len": 16, "validation_split_ratio": 0.25,
        "datasets": [{"type": "instruction", "path": str(inst), "instruction_field": "q", "output_field": "a"},
                     {"type": "text", "path": str(text), "text_field": "body", "samples": 4}],
    })
    train, evals, tasks = build_data(cfg, _ByteTokenizer())
    assert len(train) + len(evals) == 24 and len(evals) == 5 + 1 and tasks == {}
    items = train.items + evals.items
    inst_items = [it for it in items if -100 in it["labels"]]
    assert len(inst_items) == 20
    for it in inst_items:  # loss on the answer + eos only
        n_prompt = it["labels"].count(-100)
        assert it["labels"][n_prompt:] == it["input_ids"][n_prompt:] and it["input_ids"][-1] == 2
    assert all(len(it["input_ids"]) == 16 for it in items if -100 not in it["labels"])  # truncated text


def test_missing_cli_extra_is_named(monkeypatch, capsys, tmp_path):
    from surogate_hf.cli.run import plot_loss

    monkeypatch.setitem(sys.modules, "yaml", None)  # as if pyyaml were not installed
    assert main(["sft", "--print-config"]) == 2
    assert "pip install 'surogate_hf[cli]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"loss-curve plot needs the 'matplotlib' package: pip install 'surogate_hf\[cli\]'"):
        plot_loss([], str(tmp_path / "x.png"), "t")


def test_importing_the_cli_needs_no_matplotlib():
    # (pyyaml cannot be checked the same way: huggingface_hub, under transformers, imports it too)
    code = ("import sys\nsys.modules['matplotlib'] = None\n"
            "import surogate_hf.cli, surogate_hf.cli.run, surogate_hf.cli.data\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_recipe_skip_layers_unset_zero_and_set():
    """skip_quant_*_layers left out take the recipe's default (nvfp4: its bf16 ends); an explicit 0 is passed on
    (every block in FP4) and the QLoRA quantizer reads unset as 0."""
    from surogate_hf.cli.run import surogate_config
    from surogate_hf.cli.schema import recipe_config

    base = yaml.safe_load(default_config_text())
    unset = check_config({**base, "recipe": "nvfp4"})
    assert unset["skip_quant_last_layers"] is None
    rc = recipe_config(unset)
    assert (rc.skip_quant_first_layers, rc.skip_quant_last_layers) == (None, None)
    assert rc.resolved_skip_layers(18) == (1, 2)
    zero = recipe_config(check_config({**base, "recipe": "nvfp4", "skip_quant_last_layers": 0}))
    assert zero.resolved_skip_layers(18) == (1, 0)
    qc = surogate_config(check_config({**base}))
    assert qc is None or (qc.skip_quant_first_layers, qc.skip_quant_last_layers) == (0, 0)


def test_activation_aware_qlora_init_runs(tmp_path, monkeypatch):
    """qlora_init: activation_aware fits the adapters on the first training sequences before training (nf4 base):
    every layer's output error on those sequences ends below the plain base's."""
    from surogate_hf.integrations import loftq

    seen = []
    real = loftq.loftq_init

    def spy(model, weights, **kw):
        seen.append((kw, real(model, weights, **kw)))
        return seen[-1][1]

    monkeypatch.setattr(loftq, "loftq_init", spy)
    out = tmp_path / "run"
    data = "[{type: synthetic, task: reverse, alphabet: 16, min_len: 4, max_len: 8, samples: 200, eval_samples: 16}]"
    rc = main(["sft", "--set", f"output_dir={out}", "--set", "max_steps=3", "--set", f"datasets={data}",
               "--set", "qlora_fp8=false", "--set", "qlora_bnb=true", "--set", "optimizer=adamw",
               "--set", "qlora_init=activation_aware", "--set", "qlora_init_windows=4"])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["qlora_format"] == "nf4" and m["qlora_init"] == "activation_aware" and m["steps"] == 3
    (kw, errors), = seen
    assert kw["iters"] == 1 and len(kw["calibration"]) == 4
    assert errors and all(e["loftq"] < e["plain"] for e in errors.values())


def test_compile_keys_reach_the_trainer(tmp_path, capsys, monkeypatch):
    """torch_compile: the Trainer's torch_compile (the whole model); use_cuda_graphs (Surogate's key): the same with
    torch_compile_mode reduce-overhead, refused with a config error on a machine without CUDA (torch.compile would
    quietly skip the graphs there) before anything is created."""
    from surogate_hf.cli.run import training_arguments

    for keys, want in (({}, (False, None)), ({"torch_compile": True}, (True, None)),
                       ({"use_cuda_graphs": True}, (True, "reduce-overhead"))):
        cfg = check_config({"model": "builtin:tiny-llama", "datasets": [{"type": "synthetic"}],
                            "output_dir": str(tmp_path / "out"), **keys})
        args = training_arguments(cfg, cuda=False, has_eval=False)
        assert (args.torch_compile, args.torch_compile_mode) == want, keys
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    err = _err(tmp_path, capsys, BASE + "use_cuda_graphs: true\n")
    assert "use_cuda_graphs: true needs a CUDA device" in err
