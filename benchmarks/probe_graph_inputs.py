"""Probe: what a whole-model compile of each bench_e2e setup hands the compiled graphs per decoder layer.

A compiled step's host time grows with the tensors its graphs take: each graph input is a dynamo guard (TENSOR_MATCH,
and NO_TENSOR_ALIASING where its source is not a module attribute), an AOTAutograd runtime-wrapper pass, inductor's
size / stride assert in the compiled forward, and, where the backward reads it, a saved tensor packed and unpacked,
every step. This probe compiles each setup's model (the `_compiled_model` builds: torch.compile of the whole model) at
two depths and reports, per decoder layer (the difference between the depths, so the embedding, LM head and loss
drop out): the forward graph's inputs and dynamo's guard checks by kind, with the guard tree's size (the checks and
the managers that reach them, which guard evaluation walks too).
    python benchmarks/probe_graph_inputs.py --setups peft_bf16_compiled_model,ours_nf4_compiled_model
(CUDA only: bench_e2e's builds are CUDA models, and our linears take the extension's decode + GEMM route only on CUDA
tensors.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import re

import torch

import bench_e2e as E

GUARD_KINDS = ("TENSOR_MATCH", "DIMENSION_DYNAMIC_MARKING_GUARD", "NO_TENSOR_ALIASING", "ID_MATCH", "TYPE_MATCH",
               "EQUALS_MATCH", "DICT_CONTAINS", "DICT_VERSION", "LENGTH_CHECK", "NONE_MATCH", "LAMBDA_GUARD")


@contextlib.contextmanager
def captured_guards():
    """Dynamo's guard trees (TORCH_LOGS=guards) of the frames compiled inside the block, as text in the yielded list
    (torch's log settings are reset to their defaults afterwards: a probe process's own)."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(guards=True)
    logger.addHandler(handler)
    out = []
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        out.append(log.getvalue())


def guard_counts(text: str) -> collections.Counter:
    """Guard checks by kind in TORCH_LOGS=guards text: tree lines '+- KIND: ...' (or a bare '+- KIND', a relational
    guard's share under each of its tensors). The tree's other lines are the managers that reach them (GuardManager,
    DictGuardManager and their key / value managers), counted under "managers"."""
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"\+- ([A-Za-z_]+)", line)
        if m:
            kind = m.group(1)
            counts[kind if re.fullmatch(r"[A-Z][A-Z_]+", kind) else "managers"] += 1
    return counts


def measure(key: str, layers: int, seq: int) -> dict:
    """Graph inputs (every graph dynamo made) and guard counts of one compiled step of the setup at `layers`."""
    from torch._inductor.compile_fx import compile_fx

    inputs = []

    def counting_backend(gm, example_inputs):
        inputs.append(sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
        return compile_fx(gm, example_inputs)

    E.COMPILE_KWARGS.clear()
    E.COMPILE_KWARGS["backend"] = counting_backend
    try:
        with captured_guards() as text:
            model = E.SETUPS[key][1](layers)
            E.causal_mask_policy()
            ids = torch.randint(0, E.SHAPES[E.SHAPE][5], (1, seq), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        E.COMPILE_KWARGS.clear()
    del model
    return {"graphs": len(inputs), "inputs": sum(inputs), "guards": guard_counts(text[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="peft_bf16_compiled_model,ours_nf4_compiled_model,ours_mxfp4_compiled_model,"
                                        "ours_nvfp4_compiled_model,ours_fp8_compiled_model")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(E.SHAPES))
    ap.add_argument("--seq", type=int, default=512, help="tokens of the one probe step (the decode route from 512)")
    E.add_attention_mask_args(ap)
    args = ap.parse_args()
    E.SHAPE = args.shape
    E.apply_attention_mask_args(args)
    rows = []
    for key in args.setups.split(","):
        one, two = measure(key, 1, args.seq), measure(key, 2, args.seq)
        diff = {k: two["guards"][k] - one["guards"][k] for k in set(two["guards"]) | set(one["guards"])}
        lines = sum(diff.values())
        checks = lines - diff.get("managers", 0)
        per_layer = {k: diff.get(k, 0) for k in GUARD_KINDS}
        rows.append((key, two["graphs"], two["inputs"] - one["inputs"], checks, lines, per_layer))
        kinds = ", ".join(f"{k} {v}" for k, v in per_layer.items() if v)
        print(f"{key}: graphs {two['graphs']}, graph inputs per layer {two['inputs'] - one['inputs']}, "
              f"guard checks per layer {checks} ({kinds}), guard-tree lines {lines}", flush=True)
    print()
    print("| setup | graphs | graph inputs per decoder layer | guard checks per decoder layer | of which | guard-tree "
          "lines (checks and their managers) |")
    print("|---|---|---|---|---|---|")
    for key, graphs, inputs, checks, lines, per_layer in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in per_layer.items() if v)
        print(f"| {E.SETUPS[key][0]} | {graphs} | {inputs} | {checks} | {kinds} | {lines} |")


if __name__ == "__main__":
    main()
