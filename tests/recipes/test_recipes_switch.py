"""The nvfp4 recipe's precision switch (recipes.switch): which GEMMs move to model_dtype, that the others stay the
recipe's bit for bit, and who schedules it (the Trainer callback, schedule_precision, torch.compile)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import surogate_hf.recipes as R
from surogate_hf.integrations.trainer import SurogateRecipeCallback
from surogate_hf.nn import linear as L
from surogate_hf.recipes.switch import switch_step
from surogate_hf.testing.recipes import TokenDataset, tiny_llama


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _layer(**knobs):
    """One nvfp4 RecipeLinear (fp32 master, bf16 compute, with a bias) inside a model-like container."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": lin})])})
    R.apply_recipe(model, "nvfp4", model_dtype="bf16", master_dtype="fp32", **knobs)
    layer = model["layers"][0]["proj"]
    assert isinstance(layer, R.RecipeLinear) and layer.engine.name == "nvfp4"
    return model, layer


def _step(layer, x, dy):
    """Forward + backward at SR step 0 (the layer's counter reset): (y, dx, dW, db)."""
    with torch.no_grad():
        layer.fp4_sr_step.zero_()
    layer.weight.grad = layer.bias.grad = None
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 24, 64, generator=g).bfloat16(), torch.randn(2, 24, 48, generator=g).bfloat16()


@pytest.mark.parametrize("blocks", ["1d", "2d"])
def test_forward_switch_moves_the_forward_only(blocks):
    model, layer = _layer(fp4_weight_blocks=blocks)
    x, dy = _inputs()
    fp4 = _step(layer, x, dy)
    assert R.switch_to_high_precision(model) == 1
    assert "forward GEMMs switched" in repr(layer)
    y, dx, dw, db = _step(layer, x, dy)
    w = layer.weight.detach().bfloat16()
    assert torch.equal(y, Fn.linear(x, w, layer.bias.detach().bfloat16()))
    assert not torch.equal(y, fp4[0])
    # dgrad and wgrad: the recipe's FP4 GEMMs (stochastic rounding, RHT), the same draws as before the switch
    for a, b in zip((dx, dw, db), fp4[1:]):
        assert torch.equal(a, b)
    R.switch_to_high_precision(model, None)  # back to FP4: the recipe's own numbers again
    for a, b in zip(_step(layer, x, dy), fp4):
        assert torch.equal(a, b)


def test_all_switch_computes_as_the_bf16_recipe():
    model, layer = _layer()
    x, dy = _inputs()
    R.switch_to_high_precision(model, "all")
    got = _step(layer, x, dy)
    torch.manual_seed(0)
    ref_model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(64, 48)})])})
    R.apply_recipe(ref_model, "bf16", model_dtype="bf16", master_dtype="fp32")
    ref = ref_model["layers"][0]["proj"]
    ref.weight.grad = ref.bias.grad = None
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    for a, b in zip(got, (ref(x).detach(), xr.grad, ref.weight.grad, ref.bias.grad)):
        assert torch.equal(a, b)
    assert layer.fp4_sr_step.item() == 0  # no FP4 draw while switched


def test_switch_refuses_what_it_cannot_do():
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(64, 48)})])})
    R.apply_recipe(model, "fp8-hybrid")
    with pytest.raises(ValueError, match="no nvfp4 recipe GEMM"):
        R.switch_to_high_precision(model)
    nv, _ = _layer()
    with pytest.raises(ValueError, match=r"passes='backward' is unknown"):
        R.switch_to_high_precision(nv, "backward")


def test_the_default_switches_the_forward_for_the_last_30_percent():
    assert R.RecipeConfig(recipe="nvfp4").resolved_high_precision_tail() == 0.3
    assert R.RecipeConfig(recipe="nvfp4").fp4_high_precision_passes == "forward"
    assert R.RecipeConfig(recipe="fp8-hybrid").resolved_high_precision_tail() == 0.0
    assert R.RecipeConfig(recipe="nvfp4", fp4_high_precision_tail=0).resolved_high_precision_tail() == 0.0
    model, layer = _layer()
    assert [R.schedule_precision(model, s, 10) for s in range(10)] == [False] * 7 + [True] * 3


def _one_step(model, schedule: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # (a fused optimizer: the global hook sees it)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            if schedule:
                R.schedule_precision(model, step, 10)
            model["layers"][0]["proj"](torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen if "fp4_high_precision_tail" in str(w.message)]


def test_an_unscheduled_switch_warns_at_the_first_step():
    model, _ = _layer()
    got = _one_step(model, schedule=False)
    assert len(got) == 1 and "call surogate_hf.recipes.schedule_precision(model, step, total_steps)" in got[0]
    scheduled, _ = _layer()
    assert _one_step(scheduled, schedule=True) == []
    plain, _ = _layer(fp4_high_precision_tail=0)
    assert _one_step(plain, schedule=False) == []


def test_the_first_step_warning_keeps_models_apart():
    """Two models, one optimizer each: only the unscheduled model's step warns, and only once."""
    unscheduled, _ = _layer()
    scheduled, _ = _layer()
    assert _one_step(scheduled, schedule=True) == []
    assert len(_one_step(unscheduled, schedule=False)) == 1


def test_schedule_on_a_model_with_every_layer_kept_in_model_dtype():
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(64, 48)})])})
    R.apply_recipe(model, "nvfp4", modules_to_not_convert=["proj"])
    assert R.schedule_precision(model, 9, 10)  # the tail began; no nvfp4 layer to switch, and no error mid-run
    with pytest.raises(ValueError, match="no nvfp4 recipe GEMM"):
        R.switch_to_high_precision(model)  # an explicit call says so


def test_schedule_precision_looks_through_wrappers():
    model, layer = _layer(fp4_high_precision_tail=0.5)
    wrapper = nn.Module()
    wrapper.module = model  # what DDP / FSDP / accelerate hand the training loop
    compiled = torch.compile(wrapper, backend="eager")  # torch.compile's OptimizedModule: `_orig_mod`
    assert R.schedule_precision(compiled, 1, 2) and layer.fp4_high_precision == "forward"


def test_config_knobs_are_validated():
    with pytest.raises(ValueError, match=r"fp4_high_precision_tail must be a fraction of the run in \[0, 1\)"):
        R.RecipeConfig(recipe="nvfp4", fp4_high_precision_tail=1.0)
    with pytest.raises(ValueError, match="fp4_high_precision_tail only applies to recipe='nvfp4'"):
        R.RecipeConfig(recipe="fp8-hybrid", fp4_high_precision_tail=0.2)
    with pytest.raises(ValueError, match="only applies to recipe='nvfp4'"):
        R.RecipeConfig.from_recipe_name("bf16", fp4_high_precision_passes="all")
    with pytest.raises(ValueError, match="fp4_high_precision_passes='fprop' is unknown"):
        R.RecipeConfig(recipe="nvfp4", fp4_high_precision_passes="fprop")
    cfg = R.RecipeConfig.from_recipe_name("nvfp4", fp4_high_precision_tail=0.2, fp4_high_precision_passes="all")
    assert R.RecipeConfig.from_dict(cfg.to_dict()) == cfg  # travels with the checkpoint's config like every knob


def test_schedule_precision_switches_for_the_tail():
    assert [switch_step(200, t) for t in (0.0, 0.1, 0.2, 0.25)] == [200, 180, 160, 150]
    assert switch_step(7, 0.2) == 5  # ceil: at least the asked share
    model, layer = _layer(fp4_high_precision_tail=0.25, fp4_high_precision_passes="all")
    switched = [R.schedule_precision(model, s, 8) for s in range(8)]
    assert switched == [False] * 6 + [True] * 2
    assert layer.fp4_high_precision == "all"
    resumed, layer2 = _layer(fp4_high_precision_tail=0.25)
    assert R.schedule_precision(resumed, 7, 8) and layer2.fp4_high_precision == "forward"  # a resume past the switch
    plain, _ = _layer(fp4_high_precision_tail=0)
    assert not R.schedule_precision(plain, 7, 8)  # tail 0: FP4 to the end
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        R.schedule_precision(resumed, 0, 0)


def test_quantized_base_switch():
    torch.manual_seed(0)
    lin = nn.Linear(256, 160, bias=False)
    base = L.LINEAR_CLASSES["nvfp4"].from_linear(lin.bfloat16())
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"proj": base})])})
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(3, 7, 256, generator=g).bfloat16(), torch.randn(3, 7, 160, generator=g).bfloat16()

    def run():
        xg = x.clone().requires_grad_()
        y = base(xg)
        y.backward(dy)
        return y.detach(), xg.grad

    weight_only = run()  # the format's own GEMMs: what the bf16 recipe keeps
    R.apply_recipe(model, "nvfp4", model_dtype="bf16", no_fp4_stochastic_rounding=True)
    fp4 = run()
    R.switch_to_high_precision(model)
    y, dx = run()
    assert torch.equal(y, Fn.linear(x, base.dequantize(torch.bfloat16))) and torch.equal(dx, fp4[1])
    assert "forward GEMMs switched" in repr(base.recipe_gemm)
    R.switch_to_high_precision(model, "all")
    y, dx = run()
    assert torch.equal(y, weight_only[0]) and torch.equal(dx, weight_only[1])


def test_compiled_layer_follows_the_switch():
    model, layer = _layer()
    x, dy = _inputs()
    eager = {}
    for passes in (None, "forward"):
        R.switch_to_high_precision(model, passes)
        eager[passes] = _step(layer, x, dy)
    R.switch_to_high_precision(model, None)
    torch._dynamo.reset()
    layer.compile(fullgraph=True, backend="aot_eager")
    for passes in (None, "forward", None):  # each flip re-traces (the attribute is guarded), none is stale
        R.switch_to_high_precision(model, passes)
        got = _step(layer, x, dy)
        for a, b in zip(got, eager[passes]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Record(TrainerCallback):
    def __init__(self, layer):
        self.layer, self.seen = layer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(self.layer.fp4_high_precision)


def test_trainer_callback_schedules_the_tail(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3, report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, save_strategy="no",
    )
    cb = SurogateRecipeCallback("nvfp4", fp4_high_precision_tail=0.5)
    trainer = Trainer(model=tiny_llama(layers=1), args=args, train_dataset=TokenDataset(), callbacks=[cb])
    layer = trainer.model.model.layers[0].mlp.down_proj
    rec = _Record(layer)
    trainer.add_callback(rec)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert rec.seen == [None, None, "forward", "forward"]
    assert not [w for w in seen if "fp4_high_precision_tail" in str(w.message)]  # the callback schedules it
