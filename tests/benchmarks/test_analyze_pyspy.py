"""analyze_pyspy.py sorts py-spy's raw samples of a compiled step into the parts of a layer call (the profiles
themselves are taken on the GPU machine; here a recorded-format file with one stack per part)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import analyze_pyspy as A  # noqa: E402

TIMED = f"time_train_steps_cpu ({A.TIMED_LOOP})"
LAYER = "Module._call_impl (torch/nn/modules/module.py:1790)"


def test_samples_sort_into_the_parts_of_a_compiled_layer_call(tmp_path):
    aot = "AOTDispatchAutograd.post_compile.<locals>.CompiledFunction.forward (torch/_functorch/x.py:2546)"
    lines = [
        # the timed steps on the main thread
        f"thread (1): MainThread;main (bench_e2e.py:379);{TIMED};{LAYER};Runner.call (c.py:552);"
        "OpOverload.__call__ (torch/_ops.py:865) 7",
        f"thread (1): MainThread;{TIMED};{LAYER};Runner.call (c.py:600) 5",
        f"thread (1): MainThread;{TIMED};_TorchDynamoContext.__call__.<locals>.compile_wrapper (e.py:1024);{LAYER} 3",
        f"thread (1): MainThread;{TIMED};{aot};Function.apply (torch/autograd/function.py:596) 2",
        f"thread (1): MainThread;{TIMED};Optimizer.step (torch/optim/optimizer.py:500) 4",
        # a compile inside the timed loop, the warm-up, and the backward thread
        f"thread (1): MainThread;{TIMED};_compile (torch/_dynamo/convert_frame.py:1827) 50",
        "thread (1): MainThread;time_train_steps_cpu (common.py:92);Runner.call (c.py:552) 11",
        "thread (2);CompiledFunction.backward (x.py:1);Runner.call (d.py:10) 6",
    ]
    path = tmp_path / "spy.txt"
    path.write_text("\n".join(lines) + "\n")
    parts, other_threads = A.analyze(str(path))
    assert parts == {
        "graph: custom / aten op calls (OpOverload)": 7,
        "graph: the wrapper's own lines (extern GEMMs, allocations)": 5,
        "dynamo frame entry (guard evaluation)": 3,
        "AOTAutograd runtime wrappers (forward)": 2,
        "optimizer": 4,
    }
    assert other_threads == 6


def test_frames_count_each_frame_once_a_sample_across_profiles(tmp_path, capsys):
    """--frames: inclusive samples per (thread, frame), a recursive frame counted once a sample, the library of a
    --native frame and the site-packages prefix dropped from its name."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("thread (1): MainThread;f (x.py:1);f (x.py:1);cublasGemmEx (libcublas.so.13) 3\n"
                 "thread (2);g (/s/site-packages/torch/y.py:2) 2\n")
    b.write_text("thread (1): MainThread;f (x.py:1);at::empty (surogate_hf_ext.so) 5\n")
    assert A.inclusive(str(a)) == {("main", "f (x.py:1)"): 3, ("main", "cublasGemmEx"): 3,
                                   ("other", "g (torch/y.py:2)"): 2}
    A.print_frames([str(a), str(b)], 2)
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["main | 0 | 5 | +5 | at::empty", "main | 3 | 5 | +2 | f (x.py:1)"]
