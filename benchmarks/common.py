"""Shared helpers of the benchmark scripts: timing, tables, result files.

Timing: triton.testing.do_bench (CUDA events, L2 flushed between runs), median in ms. Every
setup runs in the same process as its peers; a setup that fails is reported with its error,
never dropped silently.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def device_name() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"


def bench_ms(fn, warmup=25, rep=100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def layer_step_fn(m, x, dy):
    """One fwd+bwd of layer m on x with output gradient dy (parameter and input grads cleared first)."""

    def f():
        for p in m.parameters():
            p.grad = None
        x.grad = None
        m(x).backward(dy)

    return f


def train_step_fn(model, ids, opt):
    """One causal-LM training step on ids (labels = ids): forward, backward, optimizer step; returns the loss."""

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def speed_knobs(recipe) -> dict:
    """apply_recipe knobs for timing a recipe's steady state: the nvfp4 precision switch off (recipes.switch), so every
    timed step is an FP4 step and the first optimizer step does not warn that nothing schedules the switch."""
    return {"fp4_high_precision_tail": 0.0} if recipe == "nvfp4" else {}


GC_OFF = []  # bench_e2e --gc-off: Python's garbage collector frozen and off during the timed steps


def time_train_steps(step, warmup: int, steps: int) -> tuple[float, float | None, torch.Tensor]:
    """(seconds for `steps` timed steps after `warmup`, peak GiB over warm-up and timed steps or None off CUDA,
    the last loss): time_train_steps_cpu without the host CPU time."""
    return time_train_steps_cpu(step, warmup, steps)[:3]


PYSPY_ATTACH_S = 2.0  # py-spy's attach to a running process, waited out before the timed steps


@contextlib.contextmanager
def pyspy_sampling(path: str | None, exe: str = "py-spy", native: bool = False):
    """py-spy sampling this process (every thread, Python frames, 250 Hz, raw format: analyze_pyspy.py reads it) into
    `path` for the block; nothing when path is None. native: C/C++ frames too (py-spy --native: what a custom op's
    or the dispatcher's time is spent on). Attached to the running process after the warm-up, so compiles
    are never sampled: sampling a whole model's compile from the start (`py-spy record -- python ...`) made it take
    3x as long (PEFT's SmolLM2-135M setup 305 s against ~100 s, H200, session 38)."""
    if path is None:
        yield
        return
    found = shutil.which(exe)
    if found is None:
        raise FileNotFoundError(f"--pyspy: no py-spy executable at {exe!r} (pip install py-spy; --pyspy-exe names it)")
    proc = subprocess.Popen([found, "record", "--pid", str(os.getpid()), "--threads", "--rate", "250", "--format",
                             "raw", "-o", path, *(["--native"] if native else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(PYSPY_ATTACH_S)
    if proc.poll() is not None:
        raise RuntimeError(f"py-spy exited before the timed steps: {proc.stderr.read().decode()[-500:]}")
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def time_train_steps_cpu(step, warmup: int, steps: int, sample_to: str | None = None, pyspy_exe: str = "py-spy",
                         pyspy_native: bool = False) -> tuple[float, float | None, torch.Tensor, float]:
    """time_train_steps's (seconds, peak GiB, last loss), then the CPU seconds the process spent over the same timed
    steps (time.process_time: every thread, the autograd engine's included): close to the wall time where the host
    bounds the step (SmolLM2-135M's compiled QLoRA step: within 0.1 ms, H200, session 35), well under it where the
    GPU does (plus the closing synchronize's spin-wait). Raises on a non-finite loss: a broken setup must not report
    a speed. With GC_OFF set, the objects alive after the warm-up are frozen (gc.freeze) and the collector is off for
    the timed steps: a host-bound step otherwise takes a full collection's pause at a random step. sample_to: a file
    for py-spy's samples of the timed steps (pyspy_sampling; the sampler's own cost slows them; pyspy_native: with
    C/C++ frames)."""
    import gc

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    sync()
    if GC_OFF:
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        with pyspy_sampling(sample_to, pyspy_exe, pyspy_native):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                loss = step()  # analyze_pyspy.timed_loop() finds this line
            sync()
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if GC_OFF:
            gc.enable()
            gc.unfreeze()
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return seconds, (torch.cuda.max_memory_allocated() / 2**30 if cuda else None), loss, cpu_seconds


def attempt(label: str, fn, errors: dict):
    """fn() or None; the error is kept for the table."""
    try:
        return fn()
    except Exception as exc:  # benchmarks report every failure in their table
        errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str) -> Path:
    """benchmarks/results/<name>.md (and a copy under $OUT when set); also printed."""
    commit = os.environ.get("BENCH_COMMIT", "unknown (set BENCH_COMMIT)")
    text = f"# {title}\n\nDevice: {device_name()}\nDate: {datetime.date.today().isoformat()}\nCommit: {commit}\n\n{body}\n"
    print(text, flush=True)
    out = ROOT / "benchmarks" / "results" / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.md").write_text(text)
    return out
