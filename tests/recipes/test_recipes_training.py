"""Recipes end to end on a tiny Llama (CPU, exact emulation): loss goes down, fp8-hybrid tracks bf16,
and each entry point (apply_recipe + Accelerator, the Trainer callback with checkpoint resume,
`accelerate launch` with a config file) selects the recipe. The long curves are
examples/recipe_loss_curves.py."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import surogate_hf.recipes as R
from surogate_hf.integrations.accelerate import check_accelerator, prepare
from surogate_hf.integrations.trainer import SurogateRecipeCallback
from surogate_hf.testing.recipes import TokenDataset, tiny_llama, token_batch


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def train_loop(model, steps, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for s in range(steps):
        ids = token_batch(s)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def mean(xs):
    return sum(xs) / len(xs)


# bf16 / fp8-hybrid: long enough for the fp8 gap to mean something; nvfp4 (slow emulation): loss drop only
STEPS = {"bf16": 30, "fp8-hybrid": 30, "nvfp4": 20}


@pytest.fixture(scope="module")
def curves():
    return {r: train_loop(R.apply_recipe(tiny_llama(), r), n) for r, n in STEPS.items()}


@pytest.mark.parametrize("recipe", ["bf16", "fp8-hybrid", "nvfp4"])
def test_tiny_llama_loss_drops(curves, recipe):
    c = curves[recipe]
    start, end = mean(c[:5]), mean(c[-10:])
    assert end < start - 1.0, f"{recipe}: loss {start:.3f} -> {end:.3f}"


def test_fp8_hybrid_tracks_bf16(curves):
    gap = mean(curves["fp8-hybrid"][-10:]) - mean(curves["bf16"][-10:])
    assert abs(gap) < 0.05, f"fp8-hybrid - bf16 final loss gap {gap:+.4f}"
    n = STEPS["nvfp4"]
    gap4 = mean(curves["nvfp4"][n - 5 : n]) - mean(curves["bf16"][n - 5 : n])
    assert abs(gap4) < 0.25, f"nvfp4 - bf16 loss gap at step {n} {gap4:+.4f}"


def test_conversion_scope():
    m = R.apply_recipe(tiny_llama(layers=4), "fp8-hybrid", skip_quant_first_layers=1, skip_quant_last_layers=1)
    kinds = {n: type(mod).__name__ for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    assert kinds["lm_head"] == "Linear"
    for i in range(4):
        want = "RecipeLinear" if i in (1, 2) else "Linear"
        assert kinds[f"model.layers.{i}.self_attn.q_proj"] == want
        assert kinds[f"model.layers.{i}.mlp.down_proj"] == want
    assert isinstance(m.model.embed_tokens, nn.Embedding) and m.model.norm.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="already applied"):
        R.apply_recipe(m, "bf16")


def test_master_fp32_model_bf16():
    m = R.apply_recipe(tiny_llama(), "fp8-hybrid", model_dtype="bf16", master_dtype="fp32")
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    ids = token_batch(0)
    hidden = {}
    m.model.layers[0].register_forward_hook(lambda mod, i, o: hidden.setdefault("h", o[0] if isinstance(o, tuple) else o))
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    assert hidden["h"].dtype == torch.bfloat16  # activations in model_dtype
    assert m.model.layers[0].self_attn.q_proj.weight.grad.dtype == torch.float32
    assert m.lm_head.weight.grad is not None


def test_accelerator_entry_point():
    from accelerate import Accelerator

    model = tiny_llama()
    acc = Accelerator(mixed_precision="no", cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = prepare(acc, model, opt, recipe="fp8-hybrid", amax_history_len=16)
    assert isinstance(acc.unwrap_model(model).model.layers[0].mlp.up_proj, R.RecipeLinear)
    for s in range(3):
        ids = token_batch(s)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    hist = acc.unwrap_model(model).model.layers[0].mlp.up_proj.fp8_history()
    assert (hist[:, :3] > 0).all() and (hist[:, 3:] == 0).all()  # one push per optimizer step

    class FakeAcc:
        mixed_precision = "fp8"

    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        check_accelerator(FakeAcc())


def _trainer(out, max_steps, recipe, **args_kw):
    kw = dict(save_strategy="steps", save_steps=2)
    kw.update(args_kw)
    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=3e-3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, lr_scheduler_type="constant",
        disable_tqdm=True, **kw,
    )
    cb = SurogateRecipeCallback(recipe, amax_history_len=8) if recipe == "fp8-hybrid" else SurogateRecipeCallback(recipe)
    return Trainer(model=tiny_llama(layers=1), args=args, train_dataset=TokenDataset(), callbacks=[cb])


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "nvfp4"])
def test_trainer_resume_is_bit_identical(tmp_path, recipe):
    full = _trainer(tmp_path / "full", 4, recipe)
    assert isinstance(full.model.model.layers[0].self_attn.o_proj, R.RecipeLinear)
    full.train()
    part = _trainer(tmp_path / "part", 4, recipe)
    part.add_callback(_StopAt(2))  # an interrupted run: same max_steps (the nvfp4 precision switch keys on it)
    part.train()
    ckpt = tmp_path / "part" / "checkpoint-2"
    assert ckpt.is_dir()
    resumed = _trainer(tmp_path / "part", 4, recipe)
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    state = R.recipe_state(full.model)
    assert state, "recipe buffers are in the state dict"
    if recipe == "fp8-hybrid":
        assert set(state) == {"surogate_fp8_state.amax_history", "surogate_fp8_state.scale"}
        assert "surogate_fp8_state.x_row" in a
        assert (full.model.model.layers[0].mlp.down_proj.fp8_history()[:, :4] > 0).all()
    else:
        assert state["model.layers.0.mlp.down_proj.fp4_sr_step"].item() == 4
        # the default precision switch (30% of 4 steps: 2 and 3) ran the last steps with the bf16 forward, in both runs;
        # the resumed run switched at its first step
        for m in (full.model, resumed.model):
            assert m.model.layers[0].mlp.down_proj.fp4_high_precision == "forward"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "nvfp4"])
def test_trainer_torch_compile_trains_like_eager(tmp_path, recipe):
    """The Trainer's own compile switch (TrainingArguments(torch_compile=True), inductor) with the recipe callback:
    the compiled model trains, with no recompile storm, to the eager run's losses and recipe state. The Trainer
    scales the compiled loss in place (compute_loss: `loss *= ...`), which fails if the loss comes back as a view."""
    from torch._dynamo.utils import counters

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        t = _trainer(tmp_path / f"c{compiled}", 3, recipe, torch_compile=compiled, save_strategy="no")
        out = t.train()
        if recipe == "fp8-hybrid":
            # each linear's (x, W, dy) histories: eager shares one x row among a norm's consumers (the FusedRMSNorm
            # hand-off links them in eager steps), a model compiled from the start keeps a row per linear, same values
            state = torch.stack([m.fp8_history() for m in t.model.modules() if isinstance(m, R.RecipeLinear)])
        else:  # the stochastic-rounding steps, advanced in the graph
            state = torch.stack([m.fp4_sr_step for m in t.model.modules() if isinstance(m, R.RecipeLinear)])
        runs.append((out.training_loss, state))
        if compiled:
            assert counters["stats"]["unique_graphs"] >= 1
            assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 2, dict(counters["recompiles"])
    torch._dynamo.reset()
    # inductor rounds the fused fp32 glue (norms, RoPE) differently from eager; on the FP4 grid that moves a few codes
    # (measured: 1.3e-4 of the mean loss after 3 steps for nvfp4)
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-4 if recipe == "fp8-hybrid" else 1e-3)
    if recipe == "fp8-hybrid":
        torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=0)
        assert (runs[1][1][:, :, :3] > 0).all()
    else:
        assert runs[1][1].tolist() == runs[0][1].tolist() == [3] * len(runs[0][1])


@pytest.mark.parametrize("regional", [False, True])
def test_nvfp4_compiled_with_checkpointing_draws_like_eager(regional):
    """nvfp4 under torch.compile(fullgraph=True), whole model or per decoder layer, with activation checkpointing: a
    recompute (inside the compiled backward, or a compiled layer re-run by the checkpoint) reuses its forward's
    stochastic-rounding step (surogate::take_step), so the gradients equal eager's without checkpointing bit for
    bit, and each counter advances once per step."""
    kw = {"skip_quant_first_layers": 0, "skip_quant_last_layers": 0}
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        m = R.apply_recipe(tiny_llama(layers=2), "nvfp4", **kw)
        run = m
        if compiled:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.train()
            if regional:
                for layer in m.model.layers:
                    layer.compile(fullgraph=True, backend="aot_eager")
            else:
                run = torch.compile(m, fullgraph=True, backend="aot_eager")
        for step in range(2):
            ids = token_batch(step, b=2)
            m.zero_grad()
            run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        runs.append(({n: p.grad.clone() for n, p in m.named_parameters()}, R.recipe_state(m)))
    torch._dynamo.reset()
    (g0, s0), (g1, s1) = runs
    assert s0.keys() == s1.keys() and all(int(v) == 2 for v in s1.values()), s1
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0, msg=k)


def test_accelerate_launch_with_config_file(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: 'NO'
        mixed_precision: 'no'
        num_machines: 1
        num_processes: 1
        use_cpu: true
        """))
    # train.py knows nothing of recipes beyond the callback: the recipe comes from the environment
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import json, sys, torch
        from surogate_hf.testing.recipes import tiny_llama, TokenDataset
        from transformers import Trainer, TrainerCallback, TrainingArguments
        from surogate_hf.integrations.trainer import SurogateRecipeCallback
        args = TrainingArguments(output_dir={str(tmp_path / "out")!r}, max_steps=2, per_device_train_batch_size=4,
                                 report_to=[], save_strategy="no", disable_tqdm=True)
        t = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(8), callbacks=[SurogateRecipeCallback()])
        t.train()
        lin = t.model.model.layers[0].self_attn.q_proj
        json.dump({{"recipe": t.model.surogate_recipe.recipe, "margin": t.model.surogate_recipe.margin,
                   "module": type(lin).__name__, "pushed": int((lin.fp8_history() > 0).sum())}},
                  open({str(tmp_path / "result.json")!r}, "w"))
        """))
    env = dict(os.environ, SUROGATE_RECIPE="fp8-hybrid", SUROGATE_RECIPE_KNOBS='{"margin": 1}',
               PYTHONPATH=str(Path(__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    p = subprocess.run([*launcher, "--config_file", str(cfg), str(script)], env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    # 2 steps x (x, w, dy) pushed into the history
    assert res == {"recipe": "fp8-hybrid", "margin": 1, "module": "RecipeLinear", "pushed": 6}


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "nvfp4"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_replays_the_forward(recipe, reentrant):
    """A recompute must cast like the original forward (same scale, same SR step, no extra history):
    gradients and recipe state equal those of a run without checkpointing."""
    ids = token_batch(0, b=2)
    runs = []
    for ckpt in (False, True):
        m = R.apply_recipe(tiny_llama(layers=1), recipe)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            m.train()
        for _ in range(2):  # the second step casts with scales from the first
            m.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            R.recipe_step(m)
        runs.append(({n: p.grad.clone() for n, p in m.named_parameters()}, R.recipe_state(m)))
    (g0, s0), (g1, s1) = runs
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k], rtol=0, atol=0, msg=k)


def test_eval_forward_leaves_recipe_state_alone():
    m = R.apply_recipe(tiny_llama(), "fp8-hybrid")
    ids = token_batch(0)
    m(input_ids=ids, labels=ids).loss.backward()
    before = {k: v.clone() for k, v in R.recipe_state(m).items()}
    with torch.no_grad():
        m(input_ids=ids)
    assert all(torch.equal(before[k], v) for k, v in R.recipe_state(m).items())


def _peft_over_fp8_bases():
    peft = pytest.importorskip("peft")
    from surogate_hf.nn.linear import FP8Linear

    model = tiny_llama()
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            setattr(layer.self_attn, name, FP8Linear.from_linear(getattr(layer.self_attn, name)))
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def test_lora_adapters_keep_their_dtype_under_a_recipe_by_default():
    pm = _peft_over_fp8_bases()
    R.apply_recipe(pm, "fp8-hybrid", lora_dtype="fp32")
    attn = pm.base_model.model.model.layers[0].self_attn
    a, b = attn.q_proj.lora_A["default"], attn.q_proj.lora_B["default"]
    assert type(a) is nn.Linear and type(b) is nn.Linear and a.weight.dtype == torch.float32
    # a small 128x128 fp8 base: the W8A8 op on its stored blocks (its own linear is weight-only)
    assert attn.q_proj.get_base_layer().recipe_gemm.kind == "fp8_stored"
    assert isinstance(attn.k_proj, R.RecipeLinear)
    # rows of the flat state: the dense linears only (2 layers x 5 dense x 3 roles; no adapters, no fp8 bases)
    assert pm.surogate_fp8_state.amax_history.shape[0] == 2 * 5 * 3
    ids = token_batch(0)
    pm(input_ids=ids, labels=ids).loss.backward()
    R.recipe_step(pm)
    assert a.weight.grad.abs().sum() > 0 or b.weight.grad.abs().sum() > 0


def test_peft_lora_over_quantized_base_gets_recipe_on_adapters():
    pm = _peft_over_fp8_bases()
    R.apply_recipe(pm, "fp8-hybrid", lora_dtype="fp32", quantize_lora_adapters=True)
    attn = pm.base_model.model.model.layers[0].self_attn
    assert attn.q_proj.get_base_layer().quant_format == "fp8"  # the quantized base is untouched
    assert isinstance(attn.q_proj.lora_A["default"], R.RecipeLinear)
    assert isinstance(attn.q_proj.lora_B["default"], R.RecipeLinear)
    assert attn.q_proj.lora_A["default"].weight.dtype == torch.float32  # lora_dtype masters
    ids = token_batch(0)
    pm(input_ids=ids, labels=ids).loss.backward()
    R.recipe_step(pm)
    a, b = attn.q_proj.lora_A["default"], attn.q_proj.lora_B["default"]
    assert (a.fp8_history()[:2, 0] > 0).all()  # x, W of lora_A (its dy is 0: B starts at zero)
    assert b.weight.grad.abs().sum() > 0 and (b.fp8_history()[[0, 2], 0] > 0).all()  # W of B is 0
    assert isinstance(attn.k_proj, R.RecipeLinear) and not attn.k_proj.weight.requires_grad
    assert attn.k_proj.weight.grad is None  # frozen dense base: forward + dgrad only


def test_nvfp4_lora_rank_must_fit_blocks():
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="multiples of 16.*lora_A"):
        R.apply_recipe(pm, "nvfp4", quantize_lora_adapters=True)
    R.apply_recipe(pm, "nvfp4")  # adapters in their own dtype: any rank


def test_launcher_builds_env_from_recipe_yaml(tmp_path):
    from surogate_hf.integrations.accelerate import build_launch
    from surogate_hf.recipes import RecipeConfig

    y = tmp_path / "recipe.yaml"
    y.write_text("recipe: nvfp4\nskip_quant_last_layers: 1\nno_fp4_stochastic_rounding: true\n")
    env, cmd = build_launch(["--recipe_config", str(y), "--config_file", "cfg.yaml", "train.py", "--lr", "1"])
    assert cmd[-5:] == ["--config_file", "cfg.yaml", "train.py", "--lr", "1"]
    cfg = RecipeConfig.from_env(env)
    assert cfg.recipe == "nvfp4" and cfg.skip_quant_last_layers == 1 and cfg.no_fp4_stochastic_rounding
    with pytest.raises(ValueError, match="margin"):
        build_launch(["--recipe=nvfp4", '--recipe_knobs={"margin": 1}', "train.py"])


def test_callback_env_noop_and_model_init_guard(monkeypatch):
    monkeypatch.delenv("SUROGATE_RECIPE", raising=False)
    monkeypatch.delenv("SUROGATE_RECIPE_KNOBS", raising=False)
    m = tiny_llama(layers=1)
    cb = SurogateRecipeCallback()
    assert cb.config is None
    cb.on_init_end(None, None, None, model=m)  # no recipe in the environment: ordinary training
    assert getattr(m, "surogate_recipe", None) is None
    cb = SurogateRecipeCallback("bf16")
    with pytest.raises(RuntimeError, match="model_init"):
        cb.on_train_begin(None, None, None, model=m)

    class Args:
        fp16 = True

    with pytest.raises(ValueError, match="fp16"):
        cb.on_init_end(Args(), None, None, model=m)


def test_recipe_travels_with_the_model(tmp_path, monkeypatch):
    """apply_recipe records the recipe in model.config, so save_pretrained writes it into config.json; a reloaded
    model finds it (apply_recipe(model), the callback without arguments); an explicit recipe always wins; nothing
    is read from the environment but the launcher's variables, through recipe_from_launcher."""
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("SUROGATE_RECIPE", raising=False)
    monkeypatch.delenv("SUROGATE_RECIPE_KNOBS", raising=False)
    m = R.apply_recipe(tiny_llama(layers=1), "fp8-hybrid", margin=1)
    assert m.config.surogate_recipe == {"recipe": "fp8-hybrid", "margin": 1, "model_dtype": "fp32"}
    m.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["surogate_recipe"]["margin"] == 1

    def reload():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the recipe state keys: the state is rebuilt by apply_recipe
            return AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")

    again = R.apply_recipe(reload())
    assert again.surogate_recipe == m.surogate_recipe
    assert isinstance(again.model.layers[0].mlp.up_proj, R.RecipeLinear)
    explicit = R.apply_recipe(reload(), "bf16")
    assert explicit.surogate_recipe.recipe == "bf16" and explicit.config.surogate_recipe["recipe"] == "bf16"
    cb_model = reload()
    SurogateRecipeCallback().on_init_end(type("Args", (), {"fp16": False})(), None, None, model=cb_model)
    assert cb_model.surogate_recipe.recipe == "fp8-hybrid" and cb_model.surogate_recipe.margin == 1
    monkeypatch.setenv("SUROGATE_RECIPE", "nvfp4")  # the launcher's choice is explicit too: it beats the record
    launched = R.apply_recipe(reload())
    assert launched.surogate_recipe.recipe == "nvfp4"
    monkeypatch.delenv("SUROGATE_RECIPE")
    with pytest.raises(ValueError, match="no recipe"):
        R.apply_recipe(tiny_llama(layers=1))
    with pytest.raises(ValueError, match="without a recipe"):
        SurogateRecipeCallback(margin=1)


@pytest.mark.parametrize("knobs", [
    dict(modules_to_not_convert=["self_attn", "lm_head"]),
    dict(modules_to_not_convert=["lm_head", r".*\.up_proj"], skip_quant_first_layers=1),
    dict(modules_to_not_convert=["lm_head"], skip_quant_last_layers=1, module_filter_fn=lambda m, fqn: "k_proj" not in fqn),
])
def test_quantizer_and_recipe_select_the_same_modules(knobs):
    """One module selection (nn.convert.module_plan): the same knobs convert the same linears whether they quantize
    a base (SurogateConfig's quantizer) or apply a recipe."""
    from surogate_hf.nn.convert import replace_with_quantized_modules

    knobs = dict(knobs)
    filt = knobs.pop("module_filter_fn", None)
    q = tiny_llama(layers=3)
    report = replace_with_quantized_modules(
        q, "fp8", skip=knobs["modules_to_not_convert"], skip_first_layers=knobs.get("skip_quant_first_layers", 0),
        skip_last_layers=knobs.get("skip_quant_last_layers", 0), module_filter=filt)
    r = R.apply_recipe(tiny_llama(layers=3), "fp8-hybrid", module_filter_fn=filt, **knobs)
    converted = sorted(n for n, m in r.named_modules() if isinstance(m, R.RecipeLinear) and m.quantize)
    assert converted and converted == sorted(report.quantized)
