"""benchmarks/probe_flat_slots_cpu.py on a CPU: the flattened variant hands the graph one frozen tensor a linear and
computes what the slots' route computes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_compiled_host_cpu as C  # noqa: E402
import probe_flat_slots_cpu as P  # noqa: E402


def test_flat_slots_take_one_graph_input_a_linear_and_keep_the_operands():
    slots, flat = P.probe("slots", 1, 4, 1), P.probe("flat", 1, 4, 1)
    assert slots["graph_inputs"] - flat["graph_inputs"] == 7  # one frozen tensor fewer for each of the 7 linears

    model = C.build("mxfp4", 1)
    layer = model.base_model.model.blocks[0].q.base_layer
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in layer.graph_decode_operands()[:8]]
    P.flatten_slots(model)
    after = P.flat_decode_operands(layer)[:8]
    for a, b in zip(after, before):
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
    assert layer.weight.untyped_storage().data_ptr() == layer.weight_scale.untyped_storage().data_ptr()
