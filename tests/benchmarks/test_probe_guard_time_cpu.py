"""probe_guard_time_cpu.py times the guard check of a compiled QLoRA model on a CPU (one layer here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_guard_time_cpu as P  # noqa: E402


def test_the_probe_times_the_compiled_forwards_guards_per_setup():
    peft = P.probe("peft", layers=1, repeats=1)
    ours = P.probe("mxfp4", layers=1, repeats=1)
    assert peft["guard_ms"] > 0 and ours["guard_ms"] > 0
    # one layer of seven LoRA linears: PEFT 7 weights + 14 adapters + norms and embeddings; mxfp4 adds a scale slot each
    assert ours["params"] == peft["params"] + 7
