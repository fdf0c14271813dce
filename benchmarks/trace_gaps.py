"""Where a profiled window leaves the GPU idle: reads a torch.profiler Chrome trace and reports, per phase
annotation (user_annotation events, e.g. bench_trainer's Trainer phases), the wall time, the GPU's busy time (the
union of its kernels, copies and sets) and its idle time, and which host work runs while the GPU idles: each idle
interval's time is given to the outermost host ops of the main thread that overlap it (torch ops, CUDA runtime
calls), and the rest to "python (no op)", the host's own Python between ops.

    python benchmarks/trace_gaps.py trace.json[.gz] [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
from bisect import bisect_right
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver"}


def _load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def _outermost(events):
    """The events not nested in another of the list (one thread's host ops)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def gap_report(path, top=25) -> str:
    events = [e for e in _load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS])
    host = [e for e in events if e.get("cat") in HOST_CATS]
    if not gpu or not host:
        return "trace_gaps: no GPU or host events in the trace\n"
    # the main thread: the one with the most host-op time
    per_tid = defaultdict(float)
    for e in host:
        per_tid[e["tid"]] += e["dur"]
    main = max(per_tid, key=per_tid.get)
    ops = _outermost([e for e in host if e["tid"] == main])
    starts = [e["ts"] for e in ops]
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["tid"] == main
              and e["name"].startswith("phase:")]
    if not phases:
        t0 = min(e["ts"] for e in events)
        t1 = max(e["ts"] + e["dur"] for e in events)
        phases = [{"name": "phase:window", "ts": t0, "dur": t1 - t0}]

    lines = ["| phase | count | wall ms | GPU busy ms | GPU idle ms | idle gaps <5 us / 5-50 us / >50 us (n, ms) |",
             "|---|---|---|---|---|---|"]
    by_phase = defaultdict(lambda: [0, 0.0, 0.0, [[0, 0.0], [0, 0.0], [0, 0.0]]])
    idle_by_host = defaultdict(float)
    idle_total = 0.0
    for ph in phases:
        p0, p1 = ph["ts"], ph["ts"] + ph["dur"]
        busy = sum(_overlap(a, b, p0, p1) for a, b in gpu)
        row = by_phase[ph["name"]]
        row[0] += 1
        row[1] += ph["dur"]
        row[2] += busy
        # the idle intervals inside the phase
        cursor, idle = p0, []
        for a, b in gpu:
            if b <= p0 or a >= p1:
                continue
            if a > cursor:
                idle.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < p1:
            idle.append((cursor, p1))
        for i0, i1 in idle:
            idle_total += i1 - i0
            bucket = row[3][0 if i1 - i0 < 5 else 1 if i1 - i0 < 50 else 2]
            bucket[0] += 1
            bucket[1] += i1 - i0
            covered = 0.0
            for e in ops[max(0, bisect_right(starts, i0) - 1):]:
                if e["ts"] >= i1:
                    break
                ov = _overlap(i0, i1, e["ts"], e["ts"] + e["dur"])
                if ov:
                    idle_by_host[e["name"]] += ov
                    covered += ov
            idle_by_host["python (no op)"] += (i1 - i0) - covered
    for name, (n, wall, busy, gaps) in sorted(by_phase.items()):
        hist = " / ".join(f"{c}, {us / 1e3:.2f}" for c, us in gaps)
        lines.append(f"| {name[6:]} | {n} | {wall / 1e3:.2f} | {busy / 1e3:.2f} | {(wall - busy) / 1e3:.2f} | {hist} |")
    lines += ["", f"GPU idle inside the phases: {idle_total / 1e3:.2f} ms; the host's work meanwhile (outermost ops of "
                  "the main thread):", "", "| host work while the GPU idles | ms |", "|---|---|"]
    for name, us in sorted(idle_by_host.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:90]} | {us / 1e3:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(gap_report(a.trace, a.top))
