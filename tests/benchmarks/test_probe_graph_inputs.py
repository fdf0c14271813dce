"""probe_graph_inputs.py's guard count, against dynamo's own guard log (the probe itself runs on the GPU machine): it
fails when torch changes the TORCH_LOGS=guards format the probe parses."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_graph_inputs as P  # noqa: E402


class _ThreeTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.b = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("c", torch.ones(4))

    def forward(self, x):
        return x * self.a + self.b - self.c


def test_guard_counts_read_dynamos_guard_log():
    torch._dynamo.reset()
    with P.captured_guards() as text:
        torch.compile(_ThreeTensors(), backend="eager")(torch.ones(4))
    counts = P.guard_counts(text[0])
    assert counts["TENSOR_MATCH"] == 4  # the input and the module's three tensors, one guard each
    assert counts["managers"] >= 4  # a manager reaches each of them
    assert all(k == "managers" or k.isupper() for k in counts)
    assert P.guard_counts("") == {}
