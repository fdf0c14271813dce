"""Where a compiled training step's host time goes, from py-spy samples of bench_e2e.py (Python frames only: a native
profile, `--native`, fell seconds behind its samples and wrote nothing on the GPU machine). The samples of the timed
steps (common.time_train_steps_cpu's timed loop; the compiles dropped) are sorted into the parts of a compiled
layer's call that scale differently: dynamo's frame entry (guard evaluation), AOTAutograd's runtime wrappers
(autograd.Function.apply over every input, the wrappers' loops over them), the inductor wrapper's own lines (extern
GEMMs, allocations), its custom-op calls and its Triton launches, the backward thread, the optimizer.

Record on the GPU machine (py-spy is a wheel from the package index, carried in .whl; bench_e2e attaches it to its
own process after each setup's warm-up, so no compile is sampled):

    python3 bench_e2e.py --shape smollm2-135m --setups <setup>,<setup> --steps 60 --gc-off --pyspy spy \
        --pyspy-exe /tmp/site/bin/py-spy

then here: python3 analyze_pyspy.py spy/spy_peft_bf16_compiled.txt spy/spy_ours_nf4_compiled.txt
With `bench_e2e.py --pyspy-native` (C++ frames), `--frames 200` lists inclusive samples per frame side by side.
(Session 35 recorded each setup's whole process, `py-spy record --threads --rate 250 --format raw -o ... -- python3
bench_e2e.py ...`; a whole-model compile under the sampler took 3x as long, session 38.)
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def timed_loop() -> str:
    """'common.py:<line>' of the timed loop's `loss = step()` in common.time_train_steps_cpu, read from the source."""
    lines = (Path(__file__).with_name("common.py")).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def time_train_steps_cpu("))
    return f"common.py:{next(i for i in range(start, len(lines)) if lines[i].strip().startswith('loss = step()')) + 1}"


TIMED_LOOP = timed_loop()
COMPILING = ("convert_frame.py", "compile_fx")


def stacks(path: str):
    """(frames, samples) per line of py-spy's raw output: 'thread;frame;frame ... count'."""
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            cut = line.rfind(" ")
            yield line[:cut].split(";"), int(line[cut + 1:])


def part(names: list[str], leaf: str) -> str:
    if any("Optimizer" in n or "adam" in n.lower() for n in names):
        return "optimizer"
    if "Runner.call" in names:
        if names[-1] == "OpOverload.__call__":
            return "graph: custom / aten op calls (OpOverload)"
        if names[-1] == "Runner.call":
            return "graph: the wrapper's own lines (extern GEMMs, allocations)"
        if "launcher" in names or "CachingAutotuner.run" in names or "triton" in leaf.lower():
            return "graph: Triton launches"
        return "graph: other"
    if any("CompiledFunction.forward" in n or "runtime_wrapper" in n or "aot" in n.lower() for n in names):
        return "AOTAutograd runtime wrappers (forward)"
    if "_TorchDynamoContext.__call__.<locals>.compile_wrapper" in names:
        return "dynamo frame entry (guard evaluation)"
    if "_engine_run_backward" in names:
        return "backward, on the main thread"
    return "other"


def analyze(path: str) -> tuple[collections.Counter, int]:
    """Samples per part on the main thread in the timed steps, and the other threads' samples (the autograd engine's
    backward thread; its warm-up samples cannot be told apart, but the compiles are dropped)."""
    parts, other_threads = collections.Counter(), 0
    for frames, n in stacks(path):
        if any(c in f for f in frames for c in COMPILING):
            continue
        if "MainThread" not in frames[0]:
            other_threads += n
            continue
        if not any(TIMED_LOOP in f for f in frames):
            continue
        names = [re.sub(r"\s*\(.*\)$", "", f) for f in frames[1:]]
        parts[part(names, frames[-1])] += n
    return parts, other_threads


def frame_name(frame: str) -> str:
    """A frame without its site-packages prefix or its shared library (`--native` frames name one)."""
    frame = re.sub(r"\(\S*?/site-packages/", "(", frame)
    return re.sub(r"\s*\([^()]*\.so[^()]*\)$", "", frame)


def inclusive(path: str) -> collections.Counter:
    """Samples in which each frame is on the stack (counted once a sample), keyed by (thread, frame); the thread is
    "main" or "other" (the autograd engine's backward thread). For --native profiles: which C++ calls a custom op's
    or the dispatcher's time sits under."""
    counts = collections.Counter()
    for frames, n in stacks(path):
        thread = "main" if "MainThread" in frames[0] else "other"
        for name in {frame_name(f) for f in frames[1:]}:
            counts[(thread, name)] += n
    return counts


def print_frames(paths: list[str], rows: int) -> None:
    """The `rows` frames with the most inclusive samples in any profile, side by side (and the last minus the first)."""
    counts = [inclusive(p) for p in paths]
    keys = sorted(set().union(*counts), key=lambda k: (-max(c[k] for c in counts), k))[:rows]
    print("thread | " + " | ".join(paths) + " | last - first | frame")
    for k in keys:
        print(f"{k[0]} | " + " | ".join(str(c[k]) for c in counts) + f" | {counts[-1][k] - counts[0][k]:+d} | {k[1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profiles", nargs="+", help="py-spy raw outputs, one per setup")
    ap.add_argument("--frames", type=int, default=None, metavar="N",
                    help="instead of the parts table: the N frames with the most inclusive samples, per profile")
    args = ap.parse_args()
    if args.frames:
        print_frames(args.profiles, args.frames)
        return
    results = {p: analyze(p) for p in args.profiles}
    keys = sorted({k for parts, _ in results.values() for k in parts}, key=lambda k: -max(r[0][k] for r in results.values()))
    print("| part (samples) | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r[0][k]) for r in results.values()) + " |")
    print("| main thread, timed steps | " + " | ".join(str(sum(r[0].values())) for r in results.values()) + " |")
    print("| other threads (backward) | " + " | ".join(str(r[1]) for r in results.values()) + " |")


if __name__ == "__main__":
    main()
