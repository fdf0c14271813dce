"""The registered-operands route on the CPU: a quantized layer registers its decode operands at every load and move
(ops.ext.register_decode_operands), and a compiled graph hands its ops the codes alone (ext_registered_linear_fwd /
_bwd, their reference kernels and Python autograd standing in for the C++ ones here; the CUDA kernels are checked in
tests/kernels/test_gpu_decoded_linear.py). What is checked: the graph's inputs, the results against the eager op, and
that a reload, a copy, a replaced slot, a dead layer or a graph shared by layers never reaches stale operands."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

from surogate_hf.nn import linear as L
from surogate_hf.nn import slots as S
from surogate_hf.ops.ext import REGISTERED_DECODE_OPERANDS, decode_registry_key

FORMATS = ("nvfp4", "mxfp4", "nf4", "fp8")
REGISTERED_FWD = torch.ops.surogate.ext_registered_linear_fwd.default
EXPLICIT_FWD = torch.ops.surogate.ext_decoded_linear_fwd.default


def _layer(fmt, n=384, k=256, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(3.0)
    return L.LINEAR_CLASSES[fmt].from_linear(lin).requires_grad_(False)


@pytest.fixture
def graph_route(monkeypatch):
    """The graph route inside a compile on the CPU (QuantizedLinear.decoded_route asks for CUDA and the extension)."""
    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", lambda self, x: self.graph_route())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _key(layer):
    return decode_registry_key(S.raw_slot(layer, "weight"))


def _compiled(module):
    """module compiled (fullgraph) through AOTAutograd with its forward graphs' example inputs and nodes recorded."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen = {"inputs": [], "targets": []}

    def fw(gm, example_inputs):
        seen["targets"].extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def backend(gm, example_inputs):  # (dynamo's graph inputs, real tensors; AOTAutograd's graphs see fakes)
        seen["inputs"].append(list(example_inputs))
        return aot(gm, example_inputs)

    return torch.compile(module, backend=backend, fullgraph=True), seen


def _eager(layer, x):
    with torch.no_grad():
        return nn.functional.linear(x, layer.dequantize(x.dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_loaded_layer_registers_its_operands(fmt):
    """Every load registers the layer's graph operands (views of its own slots: the codes' address is the key), and a
    layer on meta registers nothing."""
    layer = _layer(fmt)
    operands = REGISTERED_DECODE_OPERANDS[_key(layer)]
    want = layer.graph_decode_operands()
    assert operands[4:8] == tuple(want[4:8])
    for got, ref in zip(operands[:4], want[:4]):
        assert (got is None) == (ref is None) and (got is None or got.data_ptr() == ref.data_ptr())
    slot_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    assert operands[0].untyped_storage().data_ptr() in slot_storages, "no copy of the codes"
    meta = L.LINEAR_CLASSES[fmt](256, 384, bias=False)
    assert "_graph_registration" not in meta.__dict__


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_graph_takes_the_codes_alone_and_computes_the_eager_result(fmt, graph_route):
    """A compiled layer on the registered route hands its forward graph the codes and nothing else of the weight (no
    scale, global, table or nested operand), and its output and input gradient are the eager op's."""
    layer = _layer(fmt)
    run, seen = _compiled(layer)
    x = torch.randn(2, 9, 256, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    y = run(xg)
    y.float().square().mean().backward()
    assert REGISTERED_FWD in seen["targets"] and EXPLICIT_FWD not in seen["targets"]
    inputs = [t for t in seen["inputs"][0] if isinstance(t, torch.Tensor)]
    codes = S.raw_slot(layer, "weight")
    others = {S.raw_slot(layer, name).data_ptr() for name in layer.slot_names() if name != "weight"}
    assert any(t.data_ptr() == codes.data_ptr() for t in inputs)
    assert not [t for t in inputs if t.data_ptr() in others], "a scale or table went into the graph"
    eager_x = x.clone().requires_grad_(True)
    eager_y = nn.functional.linear(eager_x, layer.dequantize(torch.bfloat16))
    eager_y.float().square().mean().backward()
    torch.testing.assert_close(y, eager_y, rtol=0, atol=0)
    torch.testing.assert_close(xg.grad, eager_x.grad, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["load_state_dict", "load_dense_weight"])
def test_a_reload_reaches_the_compiled_graph(how, graph_route):
    """New values loaded after compiling, in place (load_state_dict copies into the slots) or as new tensors
    (load_dense_weight sets the slots anew and re-registers them), are what the compiled layer computes with."""
    layer, other = _layer("mxfp4"), _layer("mxfp4", seed=1)
    run, _ = _compiled(layer)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(run(x), _eager(layer, x), rtol=0, atol=0)
    if how == "load_state_dict":
        layer.load_state_dict(other.state_dict())
    else:
        layer.load_dense_weight(other.dequantize(torch.bfloat16))
    assert _key(layer) in REGISTERED_DECODE_OPERANDS
    torch.testing.assert_close(run(x), _eager(other, x), rtol=0, atol=0)


def test_a_slot_set_anew_is_never_decoded_with_stale_operands(graph_route):
    """A slot set anew without a reload (S.set_slot, the loaders' step before finalize_slots) releases the layer's
    registration: the compiled layer recompiles onto the route with every operand and computes with the new scales;
    slots_loaded() registers them, and the registered route serves the layer again. Codes that lost their registration
    while a graph still holds them (here released by hand) are refused with what to do, never decoded with stale
    operands."""
    from surogate_hf.ops.ext import release_decode_operands

    layer, other = _layer("nvfp4"), _layer("nvfp4", seed=1)
    run, seen = _compiled(layer)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    run(x)
    S.set_slot(layer, "weight_scale", S.get_slot(other, "weight_scale").clone())
    assert _key(layer) not in REGISTERED_DECODE_OPERANDS
    want = nn.functional.linear(x, layer.dequantize(torch.bfloat16))
    torch.testing.assert_close(run(x), want, rtol=0, atol=0)
    assert EXPLICIT_FWD in seen["targets"]
    layer.slots_loaded()
    torch.testing.assert_close(run(x), want, rtol=0, atol=0)
    release_decode_operands(_key(layer))
    with pytest.raises(RuntimeError, match="no decode operands are registered.*slots_loaded"):
        run(x)


def test_a_layer_whose_slots_are_not_the_registered_ones_keeps_every_operand_in_the_graph(graph_route):
    """Slots that are not the ones registered (FSDP2's unsharded parameters are new tensors; here a codes Parameter
    put in place directly) are no registered route at trace time: the graph takes every operand, and computes right."""
    layer = _layer("mxfp4")
    codes = S.raw_slot(layer, "weight")
    layer._parameters["weight"] = S.PackedParameter(codes.detach().clone(), 2)
    run, seen = _compiled(layer)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(run(x), _eager(layer, x), rtol=0, atol=0)
    assert EXPLICIT_FWD in seen["targets"] and REGISTERED_FWD not in seen["targets"]


def test_layers_sharing_a_compiled_graph_each_decode_their_own_weight(graph_route):
    """Two blocks of the same shapes compiled one by one share one compiled graph (no recompile per layer: the route
    specialises on nothing of a layer's own), and each computes with its own registered operands."""
    from torch._dynamo.testing import CompileCounterWithBackend

    class Block(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.up, self.down = _layer("nf4", 384, 256, seed), _layer("nf4", 256, 384, seed + 10)

        def forward(self, x):
            return self.down(nn.functional.silu(self.up(x)))

    blocks = [Block(0), Block(1)]
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for block in blocks:
        want = _eager(block.down, nn.functional.silu(_eager(block.up, x)))
        torch.testing.assert_close(torch.compile(block, backend=counter, fullgraph=True)(x), want, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_copies_register_their_own_and_dead_layers_release_theirs(graph_route):
    """A deep copy and an unpickled layer register their own slots (the original keeps its registration); a layer that
    dies releases its registration, and a move re-registers (a layer moved to meta registers nothing)."""
    layer = _layer("nf4")
    twin, revived = copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))
    keys = {_key(layer), _key(twin), _key(revived)}
    assert len(keys) == 3 and keys <= REGISTERED_DECODE_OPERANDS.keys()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for copied in (twin, revived):
        run, _ = _compiled(copied)
        torch.testing.assert_close(run(x), _eager(layer, x), rtol=0, atol=0)
        torch._dynamo.reset()
    dead = _key(twin)
    del twin, run
    gc.collect()
    assert dead not in REGISTERED_DECODE_OPERANDS
    moved = _key(revived)
    revived.to("meta")
    assert moved not in REGISTERED_DECODE_OPERANDS and "_graph_registration" not in revived.__dict__


def test_the_registered_ops_refuse_codes_without_registered_operands():
    """Called with codes no layer registered, or registered for another shape, the ops say so."""
    layer = _layer("mxfp4")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no decode operands are registered"):
        REGISTERED_FWD(x, None, torch.zeros(384, 128, dtype=torch.uint8), None, None, None, 1.0, 384, 256)
    with pytest.raises(RuntimeError, match=r"registered for these codes are of a \[384, 256\] weight"):
        REGISTERED_FWD(x, None, S.raw_slot(layer, "weight"), None, None, None, 1.0, 256, 384)


def test_the_trace_time_check_refuses_what_has_no_registered_address():
    """Slots on meta, or without storage (a fake tensor while exporting), are no registered route; neither are the
    live slots of a layer whose registration was switched off (set_registered_graph_route)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer("mxfp4")
    codes = S.raw_slot(layer, "weight")
    assert L.graph_operands_registered(codes)
    assert not L.graph_operands_registered(torch.empty(3, device="meta"))
    with FakeTensorMode():
        fake = torch.empty(384, 128, dtype=torch.uint8)
    assert not L.graph_operands_registered(fake)
    L.set_registered_graph_route(layer, False)
    assert not L.graph_operands_registered(codes) and _key(layer) not in REGISTERED_DECODE_OPERANDS
    L.set_registered_graph_route(layer, True)
    assert L.graph_operands_registered(codes)


def test_the_trace_time_check_sees_a_scale_slot_replaced_behind_the_registration():
    """The check takes the codes alone (what the traced code touches) and compares every current slot of their layer
    with the registered addresses: a scale slot swapped in without set_slot or a reload (so nothing released the
    registration) makes the layer's route the one with every operand."""
    layer = _layer("mxfp4")
    codes = S.raw_slot(layer, "weight")
    assert L.graph_operands_registered(codes)
    old = layer._parameters["weight_scale"]
    layer._parameters["weight_scale"] = S.PackedParameter(old.detach().clone(), 0)
    assert not L.graph_operands_registered(codes)
    layer._parameters["weight_scale"] = old
    assert L.graph_operands_registered(codes)
    assert not L.graph_operands_registered(codes.detach().clone())  # codes of no registered layer


def test_a_layer_without_registration_never_reuses_a_graph_compiled_for_a_registered_one(graph_route):
    """Two models of one class share dynamo's cache (it keys on the forward's code): a graph traced on the registered
    route must not serve a model whose layers registered nothing (registration off, as bench_trainer's `_explicit`
    setups; or a replaced slot), which would find no operands. The layer's registration is guarded: the second model
    recompiles onto the route with every operand, and both compute their own weights."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    registered, explicit = _layer("nvfp4"), _layer("nvfp4", seed=1)
    L.set_registered_graph_route(explicit, False)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for layer in (registered, explicit, registered):
        torch.testing.assert_close(torch.compile(layer, backend=counter, fullgraph=True)(x), _eager(layer, x),
                                   rtol=0, atol=0)
    assert counter.frame_count == 2
    targets = [[n.target for n in g.graph.nodes if n.op == "call_function"] for g in counter.graphs]
    assert REGISTERED_FWD in targets[0] and EXPLICIT_FWD in targets[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_compiled_registered_layer_guards_its_codes_alone(graph_route, fmt):
    """Dynamo guards every tensor the traced code touches, on every call: on the registered route the codes are the
    layer's only slot it touches (with every slot touched, SmolLM2-135M's compiled nvfp4 model spent 3.05 ms a call
    in its guards on a CPU, PEFT's 0.60: benchmarks/probe_guard_time_cpu.py)."""
    layer = _layer(fmt)
    guarded = []
    run = torch._dynamo.optimize("eager", guard_export_fn=lambda guards: guarded.extend(g.name for g in guards))(layer)
    run(torch.randn(4, 256, dtype=torch.bfloat16))
    touched = {name for name in guarded if "_parameters['weight" in name}
    assert touched == {"L['self']._parameters['weight']"}
