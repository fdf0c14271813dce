"""The decode + GEMM route's wiring on the CPU (the CUDA kernels are checked in tests/kernels/test_gpu_decoded_linear.py):
the operands each format's plan hands surogate::ext_decoded_linear, and SurogateLoraLinear's fused call (base GEMM and
adapter in one op) against its unfused path, with the ops' reference kernels and their Python autograd standing in for
the C++ ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from surogate_hf.kernels.registry import decode_operands
from surogate_hf.nn import linear as L
from surogate_hf.nn import slots as S
from surogate_hf.nn.formats.base import SHARED_GRAPH_TABLES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from probe_graph_inputs import captured_guards  # noqa: E402  (dynamo's guard text, as the probe reads it)

FORMATS = ("nvfp4", "mxfp4", "nf4", "fp8")


def _layer(fmt, n=192, k=576, bias=False):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(3.0)
        if bias:
            lin.bias.normal_()
    return L.LINEAR_CLASSES[fmt].from_linear(lin).requires_grad_(False)


def _decoded(layer):
    """The layer's plan's `decoded`: the op operands, then the NF4 nested absmax operands or None."""
    n, k = layer.out_features, layer.in_features
    if layer.quant_format == "fp8":  # (its plan needs Triton; the operands are the stored blocks)
        t = layer._tensors()
        return (*decode_operands("fp8", t[""], t["_scale_inv"], None, None, n, k, 128), None)
    return layer.fmt.cuda_plan(layer._tensors(), n, k)[3]


def _eager_route(layer):
    """decoded_route's eager tuple for the layer's plan (ext_decoded_linear, nested operands bound), on any device."""
    *operands, nested = _decoded(layer)
    op = torch.ops.surogate.ext_decoded_linear.default
    return (op if nested is None else L._with_nested(op, nested), *operands)


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_operands_decode_to_the_layers_weight(fmt):
    """Each format's plan gives the op operands whose decode is the layer's own dequantize(), bit for bit, and a
    forward that matches the layer's (bias included). A double-quantized NF4 absmax stays as stored, with its nested
    operands (nf4: the layer's default); the plan builds the de-nested fp32 absmax only when its few-token or Python
    path first asks for its args."""
    from surogate_hf.ops.ext import decode_reference

    layer = _layer(fmt, bias=True)
    *ops, nested = _decoded(layer)
    assert ops[4] == FORMATS.index(fmt) and (nested is not None) == (fmt == "nf4")
    w, s, g, lv, code, n, k, block = ops
    dense = decode_reference(w, s, g, lv, code, n, k, block, torch.bfloat16, nested)
    assert torch.equal(dense.view(torch.int16), layer.dequantize(torch.bfloat16).view(torch.int16))
    x = torch.randn(3, 5, 576, dtype=torch.bfloat16)
    op, *operands = _eager_route(layer)
    y = op(x, None, *operands[:4], layer.bias, None, None, 1.0, *operands[4:])
    torch.testing.assert_close(y, layer(x), rtol=2e-2, atol=2e-2)
    if nested is not None:
        plan = L.gemm_plan({}, None, (), lambda: layer.fmt.cuda_plan(layer._tensors(), n, k))
        assert s.dtype == torch.uint8 and plan._args is None, "no fp32 absmax until a path asks for it"
        absmax = plan.args[1]
        assert absmax.dtype == torch.float32 and torch.equal(absmax, layer.fmt._absmax(layer._tensors(), n, k))


def test_operands_that_do_not_fit_are_refused():
    """Operands the C++ op would refuse are refused here, each reason said (the layer keeps the Python plan)."""
    layer = _layer("nvfp4")
    t = layer._tensors()
    with pytest.warns(RuntimeWarning, match="decode global"):
        assert decode_operands("nvfp4", t[""], t["_scale"], None, None, 192, 576, 16) is None
    with pytest.warns(RuntimeWarning, match="codes"):
        assert decode_operands("nvfp4", t[""][:, ::2], t["_scale"], t["_scale_2"], None, 192, 576, 16) is None
    with pytest.warns(RuntimeWarning, match="scales"):
        assert decode_operands("nvfp4", t[""], t["_scale"][:-1], t["_scale_2"], None, 192, 576, 16) is None


def test_operands_refused_inside_compile_are_said_at_trace_time():
    """Inside a fullgraph compile a refusal neither breaks the graph nor passes silently: the reason is said once while
    tracing and the caller takes its slower path."""
    layer = _layer("mxfp4")
    t = layer._tensors()

    def f(codes, scales):
        ops = decode_operands("mxfp4", codes, scales, None, None, 192, 576, 32)
        return codes.float().sum() + (0.0 if ops is None else 1.0)

    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="traced into the graph.*unexpected scales"):
        out = torch.compile(f, backend="eager", fullgraph=True)(t[""], t["_scale"].reshape(-1)[:-2])
    assert out == t[""].float().sum()


def _peft_model(fmt, dropout, bias, registered=True):
    """Two LoRA-adapted `fmt` bases; registered=False: their decode operands unregistered, so that a compiled graph
    takes every operand (the explicit graph ops)."""
    from peft import LoraConfig, get_peft_model

    from surogate_hf.integrations.peft import install_peft_dispatch, set_lora_dtype

    install_peft_dispatch()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = _layer(fmt, 384, 256, bias)
            self.down_proj = _layer(fmt, 256, 384)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.up_proj(x)))

    torch.manual_seed(1)
    model = get_peft_model(Block(), LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, init_lora_weights="gaussian",
                                               target_modules=["up_proj", "down_proj"]))
    set_lora_dtype(model, torch.float32)
    L.set_registered_graph_route(model, registered)
    return model


def _assert_trains_alike(ref, got):
    """(loss, input gradient, parameter gradients) of two runs agree within bf16 summation noise."""
    (l0, dx0, g0), (l1, dx1, g1) = ref, got
    torch.testing.assert_close(l1, l0, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(dx1.float(), dx0.float(), rtol=3e-2, atol=3e-3)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=3e-2, atol=3e-3, msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dropout,bias", [(0.0, False), (0.0, True), (0.2, False)])
def test_fused_lora_call_matches_the_unfused_path(fmt, dropout, bias, monkeypatch):
    """SurogateLoraLinear hands its base GEMM and adapter to one ext_decoded_linear call where the base takes the
    decode route (forced here on CPU): the same loss and gradients as its unfused path (base layer, then the adapter's
    addmm), dropout's mask included."""
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    results = []
    for fused in (False, True):
        model = _peft_model(fmt, dropout, bias)
        calls = []
        if fused:
            def route(self, x2d):
                calls.append(1)
                return _eager_route(self)

            monkeypatch.setattr(L.QuantizedLinear, "decoded_route", route)
        torch.manual_seed(5)  # the dropout draws
        xg = x.clone().requires_grad_(True)
        loss = model(xg).float().square().mean()
        loss.backward()
        if fused:
            assert len(calls) == 2  # both layers took the fused call
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        assert grads and all(g.dtype == torch.float32 for g in grads.values())
        results.append((loss.detach(), xg.grad, grads))
    _assert_trains_alike(*results)


def test_the_fused_call_is_skipped_where_it_would_change_behaviour(monkeypatch):
    """A forward hook on the base layer keeps that layer unfused (the hook runs once, through the base's own call), and
    the output is the unpatched model's."""
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ref = _peft_model("nf4", 0.0, False)(x)
    model = _peft_model("nf4", 0.0, False)
    fused = []
    real = L.QuantizedLinear.decoded_route

    def route(self, x2d):
        fused.append(self is model.base_model.model.down_proj.get_base_layer())
        return _eager_route(self)

    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", route)
    seen = []
    model.base_model.model.up_proj.get_base_layer().register_forward_hook(lambda *a: seen.append(1))
    torch.testing.assert_close(model(x), ref, rtol=2e-2, atol=2e-2)
    assert seen == [1]
    assert fused == [False, True]  # up_proj: its base's own forward (hook and all); down_proj: the fused call
    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", real)


@pytest.mark.parametrize("reentrant", [False, True])
def test_fused_call_under_activation_checkpointing(reentrant, monkeypatch):
    """The fused call inside a checkpointed region (recomputed in the backward, non-reentrant or reentrant) gives the
    gradients of the same model without checkpointing, and gradients accumulate over two micro-batches."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(L.QuantizedLinear, "decoded_route",
                        lambda self, x2d: _eager_route(self))
    xs = [torch.randn(2, 5, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i)) for i in (7, 8)]
    grads = []
    for ckpt in (False, True):
        model = _peft_model("mxfp4", 0.0, True)
        for x in xs:  # two micro-batches, one optimizer step's worth
            xg = x.clone().requires_grad_(True)
            y = checkpoint(model, xg, use_reentrant=reentrant) if ckpt else model(xg)
            y.float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


# ---- inside torch.compile: the same route as the graph ops ext_decoded_linear_fwd / _bwd
@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_operands_are_the_plans(fmt):
    """The operands a compiled graph derives from the slots (Format.decode_args, traced) are the eager plan's bytes, a
    slot taken as such being the stored parameter itself (no dtype view for the graph to run), and decode to the layer's
    weight through the reference. A double-quantized NF4 absmax goes in as its stored codes with its nested operands
    (the decode de-nests it), in the graph as in the eager plan."""
    from surogate_hf.ops.ext import decode_reference

    layer = _layer(fmt, bias=True)
    got, want = layer.graph_decode_operands(), _decoded(layer)
    assert got is not None and len(got) == len(want) == 9
    assert (got[8] is not None) == (want[8] is not None) == (fmt == "nf4")  # (NF4Linear double-quantizes by default)

    def flat(ops):
        return [t for t in (*ops[:8], *(ops[8] or ())) if t is not None]

    for a, b in zip(flat(got), flat(want)):
        if isinstance(b, torch.Tensor):
            assert a.element_size() == b.element_size() and a.numel() == b.numel()
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        else:
            assert a == b
    stored = [p for name, p in layer.named_parameters() if name.startswith("weight")]
    shared = layer.__dict__[S.DERIVED_ATTR]["graph_tables"]  # NF4's standard tables: one tensor for every layer
    assert set(shared) == ({"_quant_map", "_nested_quant_map"} if fmt == "nf4" else set())
    for t in flat(got):
        if isinstance(t, torch.Tensor):
            assert any(t.dtype == p.dtype and t.data_ptr() == p.data_ptr() for p in stored) or any(
                t is SHARED_GRAPH_TABLES[key] for key in shared.values()), \
                f"{fmt}: an operand is neither its slot as stored nor shared"
    dense = decode_reference(*got[:8], torch.bfloat16, got[8])
    assert torch.equal(dense, layer.dequantize(torch.bfloat16))


GRAPH_OPS = (torch.ops.surogate.ext_decoded_linear_fwd.default, torch.ops.surogate.ext_decoded_linear_bwd.default)


def _compiled_graph_nodes(fmt, monkeypatch):
    """The call_function nodes of the forward and backward graphs of a compiled LoRA layer over a `fmt` base on the
    graph route with every operand in the graph (fullgraph, AOTAutograd's graphs as captured, no inductor)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", _graph_route)
    torch._dynamo.reset()
    model = _peft_model(fmt, 0.0, False, registered=False)
    run = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    run(torch.randn(2, 7, 256, dtype=torch.bfloat16, requires_grad=True)).float().square().mean().backward()
    assert len(graphs) == 2
    nodes = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert {n.target for n in nodes if n.target in GRAPH_OPS} == set(GRAPH_OPS)
    return nodes


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_graphs_hold_no_dtype_views_of_the_slots(fmt, monkeypatch):
    """The forward and backward graphs of a compiled LoRA layer on the graph route hand the decode ops no
    aten.view.dtype: inductor materialises a dtype view that an extern op takes as a call of its own per op call and
    step."""
    calls = [n for n in _compiled_graph_nodes(fmt, monkeypatch) if n.target in GRAPH_OPS]
    aliases = (torch.ops.aten.view.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
               torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    for call in calls:
        for arg in call.args:
            while isinstance(arg, torch.fx.Node) and arg.target in aliases:  # back through the reinterpretations
                arg = arg.args[0]
            assert not (isinstance(arg, torch.fx.Node) and arg.target == torch.ops.aten.view.dtype), \
                f"{fmt}: {call.target} takes a dtype view ({arg})"


def test_compiled_nf4_graphs_de_nest_no_absmax(monkeypatch):
    """A compiled LoRA layer over a double-quantized NF4 base hands the decode ops the absmax as stored, with its
    nested operands: neither graph gathers the nested code values (the de-nesting, a kernel of its own per call and
    step before), and the backward op gets the same operands instead of a saved fp32 absmax."""
    nodes = _compiled_graph_nodes("nf4", monkeypatch)
    assert not [n for n in nodes if n.target in (torch.ops.aten.index.Tensor, torch.ops.aten.gather.default)]
    for call in (n for n in nodes if n.target in GRAPH_OPS):
        scales = call.args[4 if call.target == GRAPH_OPS[1] else 3]
        assert scales.meta["val"].dtype == torch.uint8, "the absmax goes in as its stored codes"
        assert all(a is not None for a in call.args[-3:]), "with its nested operands"


def _graph_route(self, x2d):
    return self.graph_route()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dropout,bias", [(0.0, True), (0.2, False)])
@pytest.mark.parametrize("registered", [True, False])
def test_compiled_fused_call_matches_the_eager_op(fmt, dropout, bias, registered, monkeypatch):
    """A compiled LoRA layer (fullgraph: no graph break) on the graph route, forced onto CPU here, gives the eager C++
    op's loss and gradients (its reference and Python autograd standing in on CPU), dropout's mask included; the graph
    holds one forward and one backward op per layer and no decode of its own: the registered ops (the codes alone) where
    the layer's operands are registered, else the ops taking every operand."""
    from torch._dynamo.testing import CompileCounterWithBackend

    graph_op = (torch.ops.surogate.ext_registered_linear_fwd if registered else
                torch.ops.surogate.ext_decoded_linear_fwd).default
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    results = []
    for compiled in (False, True):
        model = _peft_model(fmt, dropout, bias, registered)
        if compiled:
            monkeypatch.setattr(L.QuantizedLinear, "decoded_route", _graph_route)
            torch._dynamo.reset()  # (every case compiles the same PeftModel.forward)
            backend = CompileCounterWithBackend("aot_eager")
            run = torch.compile(model, backend=backend, fullgraph=True)
        else:
            monkeypatch.setattr(L.QuantizedLinear, "decoded_route",
                                lambda self, x2d: _eager_route(self))
            run = model
        torch.manual_seed(5)
        xg = x.clone().requires_grad_(True)
        loss = run(xg).float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), xg.grad, grads))
    assert backend.frame_count == 1
    targets = [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(graph_op) == 2
    assert torch.ops.surogate.ext_decoded_linear.default not in targets
    assert not any("dequantize" in str(t) for t in targets)
    _assert_trains_alike(*results)


@pytest.mark.parametrize("registered", [True, False])
def test_compiled_route_under_checkpointing_and_accumulation(registered, monkeypatch):
    """The graph route inside a compiled, checkpointed region over two accumulated micro-batches: the gradients of the
    eager op without checkpointing, bit for bit (both sides run the same reference kernels)."""
    from torch.utils.checkpoint import checkpoint


    xs = [torch.randn(2, 5, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i)) for i in (7, 8)]
    grads = []
    for compiled in (False, True):
        model = _peft_model("nf4", 0.0, True, registered)
        if compiled:
            monkeypatch.setattr(L.QuantizedLinear, "decoded_route", _graph_route)
            torch._dynamo.reset()
            inner = torch.compile(model, backend="aot_eager", fullgraph=True)

            def run(x):
                return checkpoint(inner, x, use_reentrant=False)
        else:
            monkeypatch.setattr(L.QuantizedLinear, "decoded_route",
                                lambda self, x2d: _eager_route(self))
            run = model
        for x in xs:
            xg = x.clone().requires_grad_(True)
            run(xg).float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("registered", [True, False])
def test_inductor_passes_the_graph_ops_arguments_by_position(registered, monkeypatch):
    """Inductor's generated code passes a custom op's defaulted arguments by keyword, which costs the call's argument
    parsing more than positional ones; the graph ops take theirs (the NF4 nested operands) without defaults, so the
    compiled forward and backward call them with positional arguments only (session 39: ~1.5 us a call)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", _graph_route)
    # (a cached graph from before a schema change would keep its old call: its key does not cover the op's defaults)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    torch._dynamo.reset()
    model = _peft_model("mxfp4", 0.0, False, registered)
    run = torch.compile(model, fullgraph=True)

    def step():
        run(torch.randn(2, 7, 256, dtype=torch.bfloat16, requires_grad=True)).float().square().mean().backward()

    _, codes = run_and_get_code(step)
    name = "ext_registered_linear_" if registered else "ext_decoded_linear_"
    calls = [line for code in codes for line in code.splitlines()
             if f"torch.ops.surogate.{name}" in line and "(" in line and "=" in line.split("(")[0]]
    assert any("_fwd.default(" in c for c in calls) and any("_bwd.default(" in c for c in calls), calls
    for call in calls:
        assert "nested_" not in call and "=" not in call.split("(", 1)[1], call


def test_nf4_standard_tables_enter_a_compiled_graph_once_for_every_layer(monkeypatch):
    """NF4's 16 levels and its 256-entry nested code are the same in every layer bitsandbytes or this package writes:
    a compiled graph takes one shared tensor of each (Format.shared_graph_tables) instead of every layer's own copy, so
    a layer hands the graph two tensors fewer (14 a decoder layer of seven linears), and the results are unchanged."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    import surogate_hf.formats as F

    a, b = _layer("nf4"), _layer("nf4", 384, 256)
    keys = [layer.__dict__[S.DERIVED_ATTR]["graph_tables"] for layer in (a, b)]
    assert keys[0] == keys[1] == {"_quant_map": ("nf4", "_quant_map", "cpu"),
                                  "_nested_quant_map": ("nf4", "_nested_quant_map", "cpu")}
    assert torch.equal(SHARED_GRAPH_TABLES[keys[0]["_quant_map"]], F.nf4.nf4_code())
    assert torch.equal(S.get_slot(a, "weight_quant_map"), F.nf4.nf4_code())
    assert torch.equal(SHARED_GRAPH_TABLES[keys[0]["_nested_quant_map"]], F.nf4.nested_code())
    ops_a, ops_b = a.graph_decode_operands(), b.graph_decode_operands()
    assert ops_a[3] is ops_b[3] and ops_a[8][1] is ops_b[8][1]

    tables_in = []

    def capture(gm, example_inputs):
        tables_in.append(sum(1 for t in example_inputs if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                             and t.numel() in (16, 256)))
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(L.QuantizedLinear, "decoded_route", _graph_route)
    torch._dynamo.reset()
    model = _peft_model("nf4", 0.0, False, registered=False)  # (the registered route takes no table at all)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    ref = model(x)
    run = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    with captured_guards() as guards:
        got = run(x)
    assert torch.equal(got, ref)
    assert tables_in[0] == 2, "the levels and the nested code once each, for both layers"
    # read through one global dict, not through each layer: no identity guard per layer that one layer's table is
    # another's (those run in Python on every call)
    identity = [line for line in guards[0].splitlines() if "LAMBDA_GUARD" in line and "graph_tables" in line]
    assert "SHARED_GRAPH_TABLES" in guards[0] and not identity, identity[:2]


def test_an_nf4_layer_with_other_tables_keeps_its_own_in_the_graph():
    """A layer whose tables differ from the standard ones (loaded through load_state_dict here) hands the graph its
    own; setting a slot drops what the layer derived from the old values, and every load rebuilds it."""
    layer = _layer("nf4")
    assert set(layer.__dict__[S.DERIVED_ATTR]["graph_tables"]) == {"_quant_map", "_nested_quant_map"}
    sd = layer.state_dict()
    levels = sd["weight_quant_map"].view(torch.float32).clone()
    levels[3] += 1e-3
    sd["weight_quant_map"] = levels.view(sd["weight_quant_map"].dtype)
    layer.load_state_dict(sd)
    assert set(layer.__dict__[S.DERIVED_ATTR]["graph_tables"]) == {"_nested_quant_map"}
    ops = layer.graph_decode_operands()
    assert ops[3].data_ptr() == layer.weight_quant_map.data_ptr() and torch.equal(ops[3].view(torch.float32), levels)
    S.set_slot(layer, "weight_quant_map", levels)
    assert S.DERIVED_ATTR not in layer.__dict__  # the next load or move rebuilds it; until then the graph reads slots
    assert layer.graph_decode_operands()[3].data_ptr() == layer.weight_quant_map.data_ptr()
    S.finalize_slots(layer)
    assert set(layer.__dict__[S.DERIVED_ATTR]["graph_tables"]) == {"_nested_quant_map"}
    import pickle

    assert pickle.loads(pickle.dumps(layer)).__dict__[S.DERIVED_ATTR]["graph_tables"].keys() == {"_nested_quant_map"}
