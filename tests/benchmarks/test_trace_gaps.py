"""trace_gaps.py reads a torch.profiler Chrome trace and says, per phase annotation, how long the GPU idles and on
which host work (the traces themselves are taken on the GPU machine; here a hand-made one with known answers)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_gaps as G  # noqa: E402


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_idle_gpu_time_goes_to_the_host_work_that_overlaps_it(tmp_path):
    events = [
        _x("phase:fwd+bwd", "user_annotation", 0, 1000),
        _x("phase:optimizer", "user_annotation", 1000, 500),
        # fwd+bwd: kernels 100-400 and 600-1000 (idle 0-100 and 400-600)
        _x("k1", "kernel", 100, 300, tid=7), _x("k2", "kernel", 600, 400, tid=7),
        _x("k3", "kernel", 650, 100, tid=7),  # nested in k2: counted once
        _x("cudaGraphLaunch", "cuda_runtime", 50, 100),  # 50 us of it while idle
        _x("aten::mul", "cpu_op", 420, 100), _x("aten::empty", "cpu_op", 440, 10),  # nested op: the outer one counts
        # optimizer: a 100 us kernel, the rest idle with no host op
        _x("k4", "kernel", 1100, 100, tid=7),
        _x("aten::sum", "cpu_op", 2000, 50, tid=9),  # another thread's op while idle: not the main thread's work
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    report = G.gap_report(str(path))
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in report.splitlines() if line.count("|") >= 3}
    assert [c.strip() for c in rows["fwd+bwd"]] == ["1", "1.00", "0.70", "0.30", "0, 0.00 / 0, 0.00 / 2, 0.30"]
    assert [c.strip() for c in rows["optimizer"]] == ["1", "0.50", "0.10", "0.40", "0, 0.00 / 0, 0.00 / 2, 0.40"]
    assert "GPU idle inside the phases: 0.70 ms" in report
    assert rows["cudaGraphLaunch"] == [" 0.05 "]
    assert rows["aten::mul"] == [" 0.10 "]
    assert rows["python (no op)"] == [" 0.55 "]  # 0.05 + 0.10 in fwd+bwd, 0.40 in the optimizer phase
    assert "aten::empty" not in rows and "aten::sum" not in rows


def test_a_trace_without_annotations_is_one_window(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("k", "kernel", 10, 10, tid=7), _x("op", "cpu_op", 0, 40)]}))
    report = G.gap_report(str(path))
    assert "| window | 1 | 0.04 | 0.01 | 0.03 | 0, 0.00 / 2, 0.03 / 0, 0.00 |" in report
    assert "| op | 0.03 |" in report
