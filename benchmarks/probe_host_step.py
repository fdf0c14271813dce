"""Probe: where a small model's QLoRA step spends its host time, and whether anything in it waits for the GPU.

For each setup of bench_e2e (PEFT LoRA on the bf16 base, our QLoRA formats; eager or compiled layers), on the shape's
config cut to a few layers (so that a step's launches fit the GPU's queue while the GPU is held back):
- wall: seconds per step, steps back to back, synchronized at the end;
- host: seconds the host takes to issue the step from its decoder layers on (forward, loss, backward, optimizer)
  while the GPU is held busy by torch.cuda._sleep for longer than the step. With nothing there waiting for the GPU
  this is that part's host time alone; a step that syncs (an .item(), a blocking copy, a cudaFree) reads at least
  the sleep. (HF's causal-mask preparation before the layers synchronizes once per step in every setup; the GPU
  is held back right after it: AfterMask.)
- where the step first synchronizes after the mask, as far as torch knows (torch.cuda.set_sync_debug_mode).
The step computes its loss itself (cross-entropy on the logits).
The difference of two layer counts gives the host time per decoder layer.
    python benchmarks/probe_host_step.py --shape smollm2-135m --layers 2,4 \
        --setups peft_bf16,ours_mxfp4,ours_nf4,peft_bf16_compiled,ours_mxfp4_compiled,ours_nf4_compiled
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import bench_e2e as E
from common import table, write_result


def plain_step(model, ids, opt):
    """A causal-LM step whose loss is computed here (the HF loss path syncs once per step; this one does not)."""

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sleep_cycles_per_second() -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    return 200_000_000 / (time.perf_counter() - t0)


class AfterMask:
    """A forward pre-hook on the model's rotary embedding, which runs right after HF's causal-mask preparation (whose
    packed-sequence check synchronizes once per step in every setup: masking_utils.find_packed_sequence_indices) and
    before the decoder layers: from there on, `mode` "sleep" holds the GPU back and notes the time, "error" makes
    torch raise at the next synchronizing call."""

    def __init__(self, model):
        self.mode, self.cycles, self.t0 = None, 0, 0.0
        rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
        rotary.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.mode == "sleep":
            torch.cuda._sleep(self.cycles)
            self.t0 = time.perf_counter()
        elif self.mode == "error":
            torch.cuda.set_sync_debug_mode("error")


def first_sync(step, hook: AfterMask) -> str:
    """Where the step first synchronizes after the mask (torch.cuda.set_sync_debug_mode('error') raises there), or
    'none'."""
    import traceback

    hook.mode = "error"
    try:
        step()
        return "none"
    except RuntimeError as exc:
        frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)]
        return " <- ".join(reversed(frames[-4:])) + f" ({str(exc).splitlines()[0][:60]})"
    finally:
        hook.mode = None
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def probe(key: str, layers: int, batch: int, seq: int, steps: int, cps: float) -> list:
    model = E.SETUPS[key][1](layers)
    hook = AfterMask(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    ids = torch.randint(0, E.SHAPES[E.SHAPE][5], (batch, seq), device="cuda")
    step = plain_step(model, ids, opt)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    enq = []
    sleep_s = max(0.2, 3 * wall)
    hook.cycles = int(sleep_s * cps)
    for _ in range(steps):
        torch.cuda.synchronize()
        hook.mode = "sleep"
        step()
        enq.append(time.perf_counter() - hook.t0)
        hook.mode = None
        torch.cuda.synchronize()
    enq.sort()
    where = first_sync(step, hook)
    del model, opt, params, step
    gc.collect()
    torch.cuda.empty_cache()
    median = enq[len(enq) // 2]
    return [E.SETUPS[key][0], layers, wall * 1e3, median * 1e3, sleep_s * 1e3,
            "waits for the GPU" if median >= 0.9 * sleep_s else "no", where[:300]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(E.SHAPES))
    ap.add_argument("--setups", default="peft_bf16,ours_mxfp4,ours_nf4,peft_bf16_compiled,ours_mxfp4_compiled,"
                    "ours_nf4_compiled")
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--name", default="probe_host_step")
    args = ap.parse_args()
    E.SHAPE = args.shape
    cps = sleep_cycles_per_second()
    rows = []
    for key in args.setups.split(","):
        for layers in (int(v) for v in args.layers.split(",")):
            rows.append(probe(key, layers, args.batch, args.seq, args.steps, cps))
            print(rows[-1], flush=True)
    body = table(["setup", "layers", "wall ms/step", "host ms/step (GPU held back)", "GPU held back ms",
                  "step waits for the GPU", "first sync after the mask"], rows)
    write_result(f"{args.name}_{args.shape}", f"Probe: host time of a {args.shape} QLoRA step", body)


if __name__ == "__main__":
    main()
