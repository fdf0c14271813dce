"""benchmarks/probe_graph_io_cpu.py on a CPU: the tensors one compiled decoder layer hands across its graphs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_graph_io_cpu as P  # noqa: E402


def test_probe_counts_what_crosses_the_graphs_per_layer():
    def per_layer(setup):
        one, two = P.graph_io(setup, 1), P.graph_io(setup, 2)
        return {k: two[k] - one[k] for k in one}

    peft, mxfp4, explicit = per_layer("peft"), per_layer("mxfp4"), per_layer("mxfp4/explicit")
    # the same 7 x 2 adapter gradients everywhere; on the registered route ours hand each linear's codes alone across,
    # as PEFT its weight; with every operand in the graph, MXFP4 hands each linear's scales in as one more frozen input,
    # and saves it for the backward (its dgrad decodes the weight again)
    assert peft["backward outputs"] == mxfp4["backward outputs"] == explicit["backward outputs"] == 14
    assert mxfp4 == peft
    assert explicit["forward inputs"] - peft["forward inputs"] == 7
    assert explicit["forward outputs"] - peft["forward outputs"] == 7
    assert peft["forward outputs"] == peft["backward inputs"] and explicit["forward outputs"] == explicit["backward inputs"]
