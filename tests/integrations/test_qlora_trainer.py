"""QLoRA with the HF Trainer: loss goes down on every format, grad accumulation + checkpoint resume replays the
uninterrupted run, 8-bit AdamW (bitsandbytes, CPU) trains, and prepare_for_training keeps the model dtypes."""

import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from surogate_hf import SurogateConfig
from surogate_hf.data import (
    CharTokenizer, PadCollator, SyntheticTaskDataset, TaskSpec, build_tiny_model, tiny_llama_config,
)
from surogate_hf.integrations.peft import SurogateLoraLinear, is_peft_dispatch_installed, uninstall_peft_dispatch
from surogate_hf.training import prepare_for_training

FORMATS = ["fp8", "nvfp4", "mxfp4", "nf4"]
TOK = CharTokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tiny_llama_config(TOK.vocab_size, num_layers=2), seed=0).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def train_set():
    return SyntheticTaskDataset(TaskSpec(task="reverse"), 512, seed=1)


def peft_model(path, fmt, gradient_checkpointing=False, r=8, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=SurogateConfig(format=fmt), dtype=dtype)
    model = prepare_for_training(model, gradient_checkpointing=gradient_checkpointing)
    torch.manual_seed(0)  # same adapter init for every model a test builds
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0))


def args(out, **kw):
    base = dict(
        output_dir=str(out), per_device_train_batch_size=16, learning_rate=5e-3, warmup_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# fp8 in the default run; the other formats' gradients are checked against dense in test_qlora.py, their Trainer
# runs (~2-5 s each alone on 2 cores) with -m slow
@pytest.mark.parametrize("fmt", [f if f == "fp8" else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_trainer_lowers_loss(tiny_dir, train_set, tmp_path, fmt):
    model = peft_model(tiny_dir, fmt)
    trainer = Trainer(model=model, args=args(tmp_path, max_steps=24, lr_scheduler_type="constant"),
                      train_dataset=train_set, data_collator=PadCollator(TOK.pad_token_id))
    trainer.train()
    ls = losses(trainer)
    start, end = sum(ls[:3]) / 3, sum(ls[-3:]) / 3
    print(f"{fmt}: Trainer loss {start:.3f} -> {end:.3f}")
    assert end < 0.9 * start


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir, train_set):
    batch = PadCollator(TOK.pad_token_id)([train_set[i] for i in range(8)])
    grads = []
    for gc in (False, True):
        model = peft_model(tiny_dir, "nf4", gradient_checkpointing=gc)
        model.train()
        model(**batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_grad_accumulation_and_checkpoint_resume_match_uninterrupted_run(tiny_dir, train_set, tmp_path):
    kw = dict(max_steps=6, gradient_accumulation_steps=2, per_device_train_batch_size=8, save_strategy="steps",
              save_steps=3)
    collate = PadCollator(TOK.pad_token_id)

    full = Trainer(model=peft_model(tiny_dir, "nvfp4"), args=args(tmp_path / "full", **kw),
                   train_dataset=train_set, data_collator=collate)
    full.train()

    cut = Trainer(model=peft_model(tiny_dir, "nvfp4"), args=args(tmp_path / "cut", **kw),
                  train_dataset=train_set, data_collator=collate, callbacks=[_StopAt(3)])
    cut.train()
    assert cut.state.global_step == 3 and (tmp_path / "cut" / "checkpoint-3").is_dir()

    resumed = Trainer(model=peft_model(tiny_dir, "nvfp4"), args=args(tmp_path / "cut", **kw),
                      train_dataset=train_set, data_collator=collate)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    l_full, l_res = losses(full), losses(resumed)
    print(f"resume: uninterrupted final loss {l_full[-1]:.6f}, resumed {l_res[-1]:.6f}")
    # the resumed state carries the first 3 logged losses from the checkpoint, then logs 3 new ones
    assert len(l_full) == 6 and len(l_res) == 6 and resumed.state.global_step == 6
    assert l_res == pytest.approx(l_full, rel=1e-5, abs=1e-6)
    sd_full = {n: p for n, p in full.model.named_parameters() if "lora_" in n}
    sd_res = {n: p for n, p in resumed.model.named_parameters() if "lora_" in n}
    for n in sd_full:
        torch.testing.assert_close(sd_res[n], sd_full[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.slow  # 20 Trainer steps with bitsandbytes' optimizer (~7 s alone on 2 cores)
def test_adamw_bnb_8bit_trains_quantized_model(tiny_dir, train_set, tmp_path):
    # r=16: down_proj's lora_A is 16 x 256 = 4096 elements, the size from which bitsandbytes keeps 8-bit state
    model = peft_model(tiny_dir, "fp8", r=16)
    trainer = Trainer(model=model, args=args(tmp_path, max_steps=20, optim="adamw_bnb_8bit"),
                      train_dataset=train_set, data_collator=PadCollator(TOK.pad_token_id))
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt).__module__.startswith("bitsandbytes.optim") and opt.args.optim_bits == 8
    state_dtypes = {v.dtype for s in trainer.optimizer.optimizer.state.values() for k, v in s.items() if k == "state1"}
    assert torch.uint8 in state_dtypes  # real 8-bit moments, not an fp32 fallback
    ls = losses(trainer)
    print(f"adamw_bnb_8bit: loss {ls[0]:.3f} -> {ls[-1]:.3f}")
    assert sum(ls[-3:]) / 3 < 0.9 * sum(ls[:3]) / 3


def test_prepare_for_training_keeps_dtypes_and_freezes(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=SurogateConfig(format="nf4"),
                                                 dtype=torch.bfloat16)
    before = {n: p.dtype for n, p in model.named_parameters()}
    uninstall_peft_dispatch()
    assert not is_peft_dispatch_installed()
    out = prepare_for_training(model)
    assert out is model and is_peft_dispatch_installed()
    assert {n: p.dtype for n, p in model.named_parameters()} == before
    assert model.model.norm.weight.dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert model.is_activation_checkpointing and model.config.use_cache is False
    pm = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert any(isinstance(m, SurogateLoraLinear) for m in pm.modules())

    # what prepare_for_training replaces: PEFT's kbit helper upcasts norms and embeddings of unknown methods
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=SurogateConfig(format="nf4"),
                                                 dtype=torch.bfloat16)
    prepare_model_for_kbit_training(stock, use_gradient_checkpointing=False)
    assert stock.model.norm.weight.dtype == torch.float32

    with pytest.raises(TypeError, match="nn.Module"):
        prepare_for_training("not a model")


def test_trainer_torch_compile_trains_like_eager(tiny_dir, train_set, tmp_path):
    """The Trainer's compile switch (TrainingArguments(torch_compile=True): accelerate compiles the whole PeftModel,
    with inductor) over an NF4 QLoRA model: the eager run's losses, with no recompile storm."""
    from torch._dynamo.utils import counters

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        trainer = Trainer(model=peft_model(tiny_dir, "nf4"),
                          args=args(tmp_path / f"c{compiled}", max_steps=3, lr_scheduler_type="constant",
                                    torch_compile=compiled),
                          train_dataset=train_set, data_collator=PadCollator(TOK.pad_token_id))
        trainer.train()
        runs.append(losses(trainer))
        if compiled:
            assert counters["stats"]["unique_graphs"] >= 1
            assert sum(counters["recompiles"].values()) <= 2, dict(counters["recompiles"])
    torch._dynamo.reset()
    assert len(runs[1]) == len(runs[0]) == 3
    assert runs[1] == pytest.approx(runs[0], rel=1e-3)
