"""RecipeConfig: presets, the fallback chain, the environment round trip, and bad knobs named in errors."""

import json
import warnings

import pytest
import torch

from surogate_hf.recipes import RecipeConfig, as_recipe_config
from surogate_hf.recipes.config import check_device


def test_presets_and_forced_formats():
    assert RecipeConfig.from_recipe_name("fp8-hybrid").resolved_matmul_dtype() == "e4m3"
    assert RecipeConfig.from_recipe_name("fp8_hybrid").resolved_gradient_dtype() == "e5m2"
    nv = RecipeConfig.from_recipe_name("nvfp4")
    assert (nv.resolved_matmul_dtype(), nv.resolved_gradient_dtype()) == ("e2m1", "e2m1")
    assert nv.four_over_six and not nv.no_fp4_stochastic_rounding and nv.fp4_rht
    fp8 = RecipeConfig.from_recipe_name("fp8-hybrid", fp8_amax_history=16, amax_compute_algo="MOST_RECENT")
    assert (fp8.amax_history_len, fp8.amax_compute_algo, fp8.margin) == (16, "most_recent", 0)
    assert RecipeConfig().amax_history_len == 1024


def test_fallback_chain():
    c = RecipeConfig(model_dtype="bf16")
    assert (c.resolved_matmul_dtype(), c.resolved_gradient_dtype(), c.resolved_master_dtype()) == ("bf16",) * 3
    c = RecipeConfig(model_dtype="bf16", matmul_dtype="fp32")
    assert c.resolved_gradient_dtype() == "fp32"
    c = RecipeConfig(model_dtype=torch.bfloat16, matmul_dtype="e4m3")
    assert c.resolved_gradient_dtype() == "e5m2" and c.uses_fp8()
    c = RecipeConfig(model_dtype="bf16", matmul_dtype="e4m3", gradient_dtype="bf16")
    assert c.resolved_gradient_dtype() == "bf16"
    assert RecipeConfig(model_dtype="bf16", master_dtype="fp32").resolved_master_dtype() == "fp32"


@pytest.mark.parametrize(
    "kwargs, knob",
    [
        (dict(recipe="bf16", gradient_dtype="e4m3"), "gradient_dtype"),
        (dict(recipe="bf16", matmul_dtype="e5m2"), "matmul_dtype"),
        (dict(recipe="bf16", matmul_dtype="e2m1"), "matmul_dtype"),
        (dict(recipe="bf16", matmul_dtype="fp16"), "matmul_dtype"),
        (dict(recipe="bf16", gradient_dtype="e5m2"), "gradient_dtype"),
        (dict(recipe="bf16", matmul_dtype="bf16", gradient_dtype="e5m2"), "gradient_dtype"),
        (dict(recipe="fp8-hybrid", matmul_dtype="bf16"), "matmul_dtype"),
        (dict(recipe="fp8-hybrid", gradient_dtype="bf16"), "gradient_dtype"),
        (dict(recipe="nvfp4", gradient_dtype="e5m2"), "gradient_dtype"),
        (dict(recipe="bf16", model_dtype="fp16"), "model_dtype"),
        (dict(recipe="bf16", master_dtype="e4m3"), "master_dtype"),
        (dict(recipe="bf16", model_dtype="fp32", master_dtype="bf16"), "master_dtype"),
        (dict(recipe="bf16", lora_dtype="e4m3"), "lora_dtype"),
        (dict(recipe="fp8-hybrid", amax_history_len=0), "amax_history_len"),
        (dict(recipe="fp8-hybrid", amax_compute_algo="mean"), "amax_compute_algo"),
        (dict(recipe="fp8-hybrid", margin=-1), "margin"),
        (dict(recipe="nvfp4", four_over_six_rule="l3"), "four_over_six_rule"),
        (dict(recipe="nvfp4", fp4_weight_blocks="3d"), "fp4_weight_blocks"),
        (dict(recipe="nvfp4", skip_quant_first_layers=-1), "skip_quant_first_layers"),
        (dict(recipe="fp4"), "recipe"),
        (dict(recipe="fp8-hybrid", quantize_lora_adapters="yes"), "quantize_lora_adapters"),
    ],
)
def test_bad_knobs_name_the_knob(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        RecipeConfig(**kwargs)


@pytest.mark.parametrize(
    "recipe, knobs, knob",
    [
        ("fp8-hybrid", dict(no_fp4_stochastic_rounding=True), "no_fp4_stochastic_rounding"),
        ("bf16", dict(four_over_six=False), "four_over_six"),
        ("fp8-hybrid", dict(fp4_weight_blocks="2d"), "fp4_weight_blocks"),
        ("nvfp4", dict(margin=1), "margin"),
        ("nvfp4", dict(fp8_amax_history=4), "fp8_amax_history"),
        ("bf16", dict(amax_histroy_len=4), "amax_histroy_len"),
    ],
)
def test_knobs_of_another_recipe_or_unknown(recipe, knobs, knob):
    with pytest.raises(ValueError, match=knob):
        RecipeConfig.from_recipe_name(recipe, **knobs)


def test_env_round_trip():
    c = RecipeConfig.from_recipe_name("nvfp4", no_fp4_stochastic_rounding=True, skip_quant_last_layers=1,
                                      modules_to_not_convert=["lm_head", "router"], quantize_lora_adapters=True)
    env = c.to_env()
    assert RecipeConfig.from_env(env) == c
    assert RecipeConfig.from_env({}) is None
    with pytest.raises(ValueError, match="SUROGATE_RECIPE_KNOBS"):
        RecipeConfig.from_env({"SUROGATE_RECIPE": "bf16", "SUROGATE_RECIPE_KNOBS": "margin=1"})
    with pytest.raises(ValueError, match="SUROGATE_RECIPE"):
        RecipeConfig.from_env({"SUROGATE_RECIPE_KNOBS": "{}"})


def test_only_the_launcher_call_reads_the_environment(monkeypatch):
    from surogate_hf.recipes import recipe_from_launcher

    monkeypatch.setenv("SUROGATE_RECIPE", "fp8-hybrid")
    monkeypatch.setenv("SUROGATE_RECIPE_KNOBS", '{"margin": 2}')
    with pytest.raises(ValueError, match="no recipe given"):
        as_recipe_config(None)  # a public API's recipe=None no longer means "read the environment"
    c = recipe_from_launcher()
    assert c.recipe == "fp8-hybrid" and c.margin == 2
    monkeypatch.delenv("SUROGATE_RECIPE")
    monkeypatch.delenv("SUROGATE_RECIPE_KNOBS")
    assert recipe_from_launcher() is None


def test_dict_round_trip():
    c = RecipeConfig.from_recipe_name("fp8-hybrid", margin=1, modules_to_not_convert=["lm_head", "gate"], model_dtype="bf16")
    d = c.to_dict()
    assert d == {"recipe": "fp8-hybrid", "margin": 1, "modules_to_not_convert": ["lm_head", "gate"], "model_dtype": "bf16"}
    assert RecipeConfig.from_dict(json.loads(json.dumps(d))) == c


def test_fp8_below_sm89_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match="fp8-hybrid.*SM89"):
        check_device(RecipeConfig(recipe="fp8-hybrid"), "cuda:0")
    with pytest.raises(RuntimeError, match="matmul_dtype='e4m3'"):
        check_device(RecipeConfig(matmul_dtype="e4m3"), "cuda:0")
    check_device(RecipeConfig(recipe="bf16"), "cuda:0")  # bf16 runs anywhere
    check_device(RecipeConfig(recipe="fp8-hybrid"), "cpu")  # CPU: exact emulation


@pytest.mark.parametrize(
    "knobs, n_layers, message",
    [
        (dict(skip_quant_first_layers=5), 2, r"skip_quant_first_layers \(5\) \+ skip_quant_last_layers \(0\) exceed the model's 2"),
        (dict(skip_quant_last_layers=3), 2, r"skip_quant_first_layers \(0\) \+ skip_quant_last_layers \(3\) exceed"),
        (dict(skip_quant_first_layers=2, skip_quant_last_layers=1), 2, r"exceed the model's 2 decoder layers"),
        (dict(skip_quant_first_layers=1), 0, r"skip_quant_first_layers=1 .*no decoder layer list"),
    ],
)
def test_skip_layers_beyond_the_model_are_an_error(knobs, n_layers, message):
    from surogate_hf.recipes.config import check_skip_layers

    with pytest.raises(ValueError, match=message):
        check_skip_layers(RecipeConfig.from_recipe_name("fp8-hybrid", **knobs), n_layers)


def test_skip_layers_within_the_model_are_accepted():
    from surogate_hf.recipes.config import check_skip_layers

    for knobs in (dict(), dict(skip_quant_first_layers=1, skip_quant_last_layers=1), dict(skip_quant_last_layers=2)):
        check_skip_layers(RecipeConfig.from_recipe_name("bf16", **knobs), 2)
    check_skip_layers(RecipeConfig(), 0)  # no knob, no layer list: nothing to check


def test_apply_recipe_refuses_skipping_more_layers_than_the_model_has():
    from surogate_hf.recipes import apply_recipe

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

    with pytest.raises(ValueError, match=r"skip_quant_first_layers \(5\) .* exceed the model's 2 decoder layers"):
        apply_recipe(TwoLayers(), "fp8-hybrid", skip_quant_first_layers=5)


@pytest.mark.parametrize("n_layers, want", [(62, (2, 8)), (28, (1, 4)), (18, (1, 2)), (4, (0, 1)), (2, (0, 0))])
def test_nvfp4_keeps_the_ends_in_model_dtype_by_default(n_layers, want):
    """NVIDIA's NVFP4 recipe keeps ~16% of the layers in BF16, the first few and most at the end: nvfp4's default
    (knobs left None); an explicit value, 0 included, wins; the other recipes keep none by default."""
    assert RecipeConfig(recipe="nvfp4").resolved_skip_layers(n_layers) == want
    assert RecipeConfig(recipe="nvfp4", skip_quant_first_layers=0, skip_quant_last_layers=0).resolved_skip_layers(
        n_layers) == (0, 0)
    assert RecipeConfig(recipe="nvfp4", skip_quant_last_layers=3).resolved_skip_layers(n_layers) == (want[0], 3)
    assert RecipeConfig(recipe="fp8-hybrid").resolved_skip_layers(n_layers) == (0, 0)
    assert "skip_quant_last_layers" not in RecipeConfig(recipe="nvfp4").to_dict()
    assert RecipeConfig.from_dict(RecipeConfig(recipe="nvfp4", skip_quant_last_layers=0).to_dict()).skip_quant_last_layers == 0


def test_nvfp4_default_on_an_18_layer_model():
    import surogate_hf.recipes as R
    from surogate_hf.testing.recipes import tiny_llama

    m = R.apply_recipe(tiny_llama(layers=18), "nvfp4")
    converted = [i for i, layer in enumerate(m.model.layers) if isinstance(layer.mlp.down_proj, R.RecipeLinear)]
    assert converted == list(range(1, 16)), converted  # layer 0 and layers 16, 17 stay in model dtype


def test_fp8_skip_small_linears_leaves_the_small_projections_in_model_dtype():
    """On SmolLM2-135M's dims (hidden 576, k/v 192, MLP 1536) only down_proj (1536 -> 576) is large enough for FP8 to
    pay by torchao's tensorwise thresholds; off by default; an FP8-only knob."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import surogate_hf.recipes as R

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=64, max_position_embeddings=64)
    kinds = {}
    for skip in (False, True):
        torch.manual_seed(0)
        m = R.apply_recipe(LlamaForCausalLM(cfg), "fp8-hybrid", fp8_skip_small_linears=skip)
        layer = m.model.layers[1]
        mods = {**{n: getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{n: getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}}
        kinds[skip] = sorted(n for n, mod in mods.items() if isinstance(mod, R.RecipeLinear))
    assert kinds[False] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert kinds[True] == ["down_proj"]
    with pytest.raises(ValueError, match="fp8_skip_small_linears"):
        RecipeConfig.from_recipe_name("nvfp4", fp8_skip_small_linears=True)


def test_mostly_small_fp8_linears_warn_with_the_knob_to_use():
    """A real model whose FP8 linears are mostly below the thresholds gets one warning naming fp8_skip_small_linears;
    a model with large linears, a toy model, and the knob itself do not."""
    from surogate_hf.recipes.linear import small_fp8_linears_advice

    smollm2 = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    assert "fp8_skip_small_linears=True" in small_fp8_linears_advice(smollm2)
    assert small_fp8_linears_advice([(2048, 2048), (2048, 1024), (2048, 6144), (6144, 2048)]) is None  # Qwen3-1.7B
    assert small_fp8_linears_advice([(64, 64), (64, 128)]) is None  # a toy model: no advice
    assert small_fp8_linears_advice([]) is None

    from transformers import LlamaConfig, LlamaForCausalLM

    import surogate_hf.recipes as R

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=64, max_position_embeddings=64)
    with pytest.warns(RuntimeWarning, match="fp8_skip_small_linears=True"):
        R.apply_recipe(LlamaForCausalLM(cfg), "fp8-hybrid")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fp8_skip_small_linears=True")
        R.apply_recipe(LlamaForCausalLM(cfg), "fp8-hybrid", fp8_skip_small_linears=True)
