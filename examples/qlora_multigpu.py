"""QLoRA on several GPUs with accelerate: DDP or FSDP2, through the HF Trainer or a plain accelerate loop.

    accelerate launch --config_file examples/accelerate_ddp.yaml   examples/qlora_multigpu.py --loop trainer
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/qlora_multigpu.py --loop accelerate
    accelerate launch --cpu --num_processes 2 examples/qlora_multigpu.py --steps 5     # CPU (gloo) DDP check
    python examples/qlora_multigpu.py --steps 5                                        # one process

The packed base (weights and scales of every quantized linear) is frozen Parameters: under DDP it is sent
once at construction and never per step; under FSDP2 each rank keeps ~1/num_processes of it. Each rank
prints the packed bytes it holds. Without --model a tiny Llama and a generated task are used (no download).
"""

import argparse
import os

import torch
from accelerate import Accelerator, PartialState
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from surogate_hf import SurogateConfig
from surogate_hf.data import CharTokenizer, PadCollator, SyntheticTaskDataset, TaskSpec, build_tiny_model, tiny_llama_config
from surogate_hf.distributed import packed_base_bytes
from surogate_hf.training import prepare_for_training


def load(args, state):
    path = args.model
    if path is None:  # rank 0 writes a tiny model once; the others wait for it
        path = os.path.join(args.out, "base")
        with state.main_process_first():
            if state.is_main_process and not os.path.exists(os.path.join(path, "config.json")):
                build_tiny_model(tiny_llama_config(CharTokenizer().vocab_size), seed=0).save_pretrained(path)
    cuda = torch.cuda.is_available() and not args.cpu
    # each rank loads (and quantizes) onto its own device; FSDP2 then keeps only this rank's shards there
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=SurogateConfig(format=args.format),
        dtype=torch.bfloat16 if cuda else torch.float32,
        device_map={"": state.local_process_index} if cuda else None,
    )
    model = prepare_for_training(model, gradient_checkpointing=args.model is not None)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))


def report(model, state, tag):
    local, total = packed_base_bytes(model)
    print(f"[rank {state.process_index}] {tag}: packed base held here {local / 2**20:.2f} MiB of {total / 2**20:.2f} MiB",
          flush=True)


def accelerate_loop(model, data, args):
    accelerator = Accelerator(cpu=args.cpu)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    dl = torch.utils.data.DataLoader(data, batch_size=args.batch, collate_fn=PadCollator(0), shuffle=True)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    report(model, accelerator.state, "after prepare")
    model.train()
    step = 0
    while step < args.steps:
        for batch in dl:
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0 or step == args.steps:
                accelerator.print(f"step {step}: loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}")
            if step == args.steps:
                break
    # adapters only: the FULL state dict is gathered (all ranks take part), rank 0 writes
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(args.out, "adapter"), state_dict=state_dict)
    accelerator.wait_for_everyone()


def trainer_loop(model, data, args):
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=args.lr,
            logging_steps=10, report_to=[], save_strategy="no", use_cpu=args.cpu or not torch.cuda.is_available(),
        ),
        train_dataset=data,
        data_collator=PadCollator(0),
    )
    trainer.train()
    report(trainer.model_wrapped, PartialState(), "after training")
    trainer.save_model(os.path.join(args.out, "adapter"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir or Hub id (default: a tiny model built offline)")
    ap.add_argument("--format", default="nf4", choices=["fp8", "nvfp4", "mxfp4", "nf4"])
    ap.add_argument("--loop", default="accelerate", choices=["accelerate", "trainer"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="per process")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default="out/qlora_multigpu")
    args = ap.parse_args()
    args.cpu = args.cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true"
    state = PartialState(cpu=args.cpu)
    os.makedirs(args.out, exist_ok=True)
    model = load(args, state)
    report(model, state, "loaded")
    data = SyntheticTaskDataset(TaskSpec(task="reverse", alphabet=16, min_len=4, max_len=8), 4096, seed=1)
    (accelerate_loop if args.loop == "accelerate" else trainer_loop)(model, data, args)
    # left to interpreter exit, the gloo group's teardown aborted a rank once in CI ("terminate called without an
    # active exception" after all steps had finished); torch asks for an explicit destroy
    state.destroy_process_group()


if __name__ == "__main__":
    main()
