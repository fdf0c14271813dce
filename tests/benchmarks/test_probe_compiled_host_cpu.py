"""benchmarks/probe_compiled_host_cpu.py on a CPU: one block, PEFT's bf16 linears against ours NF4 on the graph route,
registered and with every operand in the graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_compiled_host_cpu as P  # noqa: E402


def test_probe_counts_the_graph_inputs_and_asserts_of_each_setup():
    peft, nf4, explicit = P.probe("peft", 1, 4, 2), P.probe("nf4", 1, 4, 2), P.probe("nf4/explicit", 1, 4, 2)
    assert peft["graphs"] == nf4["graphs"] == explicit["graphs"] == 1
    # PEFT: 7 frozen weights and 14 adapter matrices, plus the input; ours NF4 on the registered route: the codes a
    # linear (its other operands registered), the adapters and x; with every operand in the graph: codes, absmax codes,
    # nested absmax, offset a linear (its two standard tables shared by every layer: two more for the model)
    assert peft["graph_inputs"] == nf4["graph_inputs"] == 7 + 14 + 1
    assert explicit["graph_inputs"] == 7 * 4 + 2 + 14 + 1
    assert explicit["asserts"] > nf4["asserts"] > peft["asserts"] > 0
    assert nf4["CompiledFunction"] is not None and nf4["wall_ms"] > 0
    with pytest.raises(ValueError, match="route suffix"):
        P.probe("nf4/flat", 1, 4, 2)
