"""probe_param_walks_cpu.py times the Trainer's per-step parameter walks over a QLoRA model on a CPU (one layer)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_param_walks_cpu as P  # noqa: E402


def test_the_probe_times_each_walk_and_counts_the_parameters():
    got = P.probe("nf4", layers=1, repeats=1)
    assert got["params"] == P.probe("peft", layers=1, repeats=1)["params"] + 7 * 5  # NF4's five slots beside the codes
    assert all(got[k] > 0 for k in ("num_parameters", "clip"))
