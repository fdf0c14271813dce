"""The flat delayed-scaling state: history semantics, first-step scaling, one update (and one all_reduce)
per optimizer step, weight caches that follow every optimizer (fused ones too), torch.compile."""

import os
import socket
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import surogate_hf.recipes as R
from surogate_hf import formats as F
from surogate_hf.recipes.fp8_hybrid import cast
from surogate_hf.recipes.scaling import Fp8ScalingState
from surogate_hf.testing.recipes import TokenDataset, tiny_llama, tiny_mlp

E4 = F.FP8_MAX[F.E4M3]
E5 = F.FP8_MAX[F.E5M2]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def push(st, row, a):
    st.amax[row] = max(st.amax[row].item(), a) if a == a else float("nan")
    st.update()
    return st.scale[row].item()


def run(seq, row=0, **kw):
    st = Fp8ScalingState(1, **kw)
    return st, [push(st, row, a) for a in seq]


def test_max_over_window():
    st, s = run([2.0, 8.0, 1.0, 1.0, 1.0], history_len=3, algo="max")
    # windows: [2] [8,2] [1,8,2] [1,1,8] [1,1,1]
    assert s == pytest.approx([E4 / 2, E4 / 8, E4 / 8, E4 / 8, E4 / 1], rel=1e-7)
    assert st.amax_history[0].tolist() == [1.0, 1.0, 1.0]


def test_most_recent_margin_and_gradient_format():
    _, s = run([2.0, 8.0, 1.0], history_len=3, algo="most_recent")
    assert s == pytest.approx([E4 / 2, E4 / 8, E4 / 1], rel=1e-7)
    _, s = run([4.0], history_len=4, margin=2)
    assert s == pytest.approx([E4 / 4 / 4], rel=1e-7)
    _, s = run([2e-6], row=2)  # row 2 is the layer's dy: E5M2
    assert s == pytest.approx([E5 / 2e-6], rel=1e-6)


def test_zero_and_nonfinite_keep_previous_scale():
    _, s = run([4.0, 0.0, float("nan"), float("inf"), 2.0], history_len=1, algo="max")
    assert s == pytest.approx([E4 / 4] * 4 + [E4 / 2], rel=1e-7)
    st, s = run([4.0, float("nan")], history_len=4, algo="most_recent")
    assert s == pytest.approx([E4 / 4, E4 / 4], rel=1e-7)
    assert st.amax_history[0, 0].item() == 0.0  # NaN recorded as "no information"
    _, s = run([4.0, float("nan"), 1.0], history_len=2, algo="max")
    assert s == pytest.approx([E4 / 4, E4 / 4, E4 / 1], rel=1e-7)


def test_rows_and_update_per_format():
    st = Fp8ScalingState(3, history_len=4)
    assert [st.rows(i) for i in range(3)] == [(0, 1, 6), (2, 3, 7), (4, 5, 8)]
    st.amax.copy_(torch.arange(1, 10, dtype=torch.float32))
    st.update()
    a = torch.arange(1, 10, dtype=torch.float32)
    want = torch.cat((F.fp8_scale_from_amax(a[:6], F.E4M3), F.fp8_scale_from_amax(a[6:], F.E5M2)))
    torch.testing.assert_close(st.scale, want, rtol=0, atol=0)
    torch.testing.assert_close(st.scale_inv[:, 0], want.reciprocal(), rtol=0, atol=0)
    assert st.amax.abs().sum() == 0 and st.initialized


def test_first_cast_uses_the_tensor_amax_then_the_history():
    """Before any update a cast is current scaling (a scale of 1.0 would flush 1e-5 to zero in E4M3)."""
    st = Fp8ScalingState(1, history_len=8)
    x = torch.tensor([[1e-5, -3e-5], [2e-5, 0.0]])
    q, qt, sinv = cast(x, st.scale, st.scale_inv, st.amax, 0, F.E4M3, True, True, current=not st.initialized)
    ref_q, ref_inv = F.quantize_fp8_tensorwise(x, F.E4M3)  # dynamic scaling
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and sinv.item() == ref_inv.item()
    assert torch.equal(qt.view(torch.uint8), ref_q.t().contiguous().view(torch.uint8))
    assert (q.float() != 0).sum() == 3
    assert st.amax[0].item() == pytest.approx(3e-5) and st.scale[0].item() == 1.0  # recorded, not yet pushed
    st.update()
    y = x * 2
    q2, _, sinv2 = cast(y, st.scale, st.scale_inv, st.amax, 0, F.E4M3, False, True, current=not st.initialized)
    ref_q2, ref_inv2 = F.quantize_fp8_tensorwise(y, F.E4M3, scale=torch.tensor(E4 / 3e-5))
    assert torch.equal(q2.view(torch.uint8), ref_q2.view(torch.uint8))
    assert sinv2.item() == pytest.approx(ref_inv2.item(), rel=1e-7)


def test_recomputes_and_micro_batches_share_one_push():
    """Casts between two updates raise one running max, pushed once (a recompute changes nothing)."""
    st = Fp8ScalingState(1, history_len=4)
    for a in (1.0, 3.0, 3.0, 2.0):
        cast(torch.full((2, 2), a), st.scale, st.scale_inv, st.amax, 0, F.E4M3, False, True, False)
    st.update()
    assert st.amax_history[0].tolist() == [3.0, 0.0, 0.0, 0.0]


def test_eval_casts_leave_the_state_alone():
    st = Fp8ScalingState(1)
    cast(torch.ones(2, 2), st.scale, st.scale_inv, st.amax, 0, F.E4M3, False, False, True)
    assert st.amax.abs().sum() == 0


def test_state_dict_round_trip_restores_first_step_flag():
    st, _ = run([3.0], history_len=5)
    sd = st.state_dict()
    assert set(sd) == {"amax_history", "scale", "x_row"} and sd["amax_history"].shape == (3, 5)
    fresh = Fp8ScalingState(1, history_len=5)
    assert not fresh.initialized
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "x_row"})  # a checkpoint from before x_row loads too
    fresh.load_state_dict(sd)
    assert fresh.initialized and torch.equal(fresh.scale, st.scale) and torch.equal(fresh.scale_inv, st.scale_inv)


# ---------------------------------------------------------------- models: steps, optimizers, distributed
def batch(i, dim=32):
    return torch.randn(4, 8, dim, generator=torch.Generator().manual_seed(i))


def test_one_update_per_optimizer_step_with_grad_accumulation():
    m = R.apply_recipe(tiny_mlp(), "fp8-hybrid", amax_history_len=8)
    st = m.surogate_fp8_state
    assert st.n_layers == 4 and sum(isinstance(x, R.RecipeLinear) for x in m.modules()) == 4
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for step in range(2):
        for micro in range(3):
            m(batch(step * 3 + micro)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert st.initialized
    assert ((st.amax_history[:, :2] > 0).all() and (st.amax_history[:, 2:] == 0).all()), "one push per step"


@pytest.mark.parametrize("recipe, knobs", [("bf16", {}), ("fp8-hybrid", {}), ("nvfp4", {})])
@pytest.mark.parametrize("opt_kw", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_work_weights_follow_every_optimizer(recipe, knobs, opt_kw):
    """fp32 masters with bf16 compute: after an optimizer step the layers compute with the new weights, also
    with torch._fused_adamw_, which does not bump version counters (the forward must equal a fresh model's)."""
    m = R.apply_recipe(tiny_mlp(), recipe, model_dtype="bf16", master_dtype="fp32", **knobs)
    assert m.layers[0][0].weight.dtype == torch.float32
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, **opt_kw)
    x = batch(0).bfloat16()
    for _ in range(2):
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    fresh = R.apply_recipe(tiny_mlp(), recipe, model_dtype="bf16", master_dtype="fp32", **knobs)
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.equal(m(x), fresh(x)), "a layer kept computing with stale weights"


def test_trainer_defaults_train_fp32_masters(tmp_path):
    """The Trainer's default optimizer with recipe knobs model bf16 / master fp32: the trained model's outputs are
    those of its own state_dict reloaded (stale work copies would make them differ)."""
    from transformers import Trainer, TrainingArguments

    from surogate_hf.integrations.trainer import SurogateRecipeCallback

    cb = SurogateRecipeCallback("bf16", model_dtype="bf16", master_dtype="fp32")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    t = Trainer(model=tiny_llama(layers=1), args=args, train_dataset=TokenDataset(12), callbacks=[cb])
    t.train()
    assert "fused" in type(t.optimizer.optimizer).__name__.lower() or t.args.optim.value == "adamw_torch_fused"
    model = t.model
    ids = torch.arange(16).reshape(2, 8)
    fresh = R.apply_recipe(tiny_llama(layers=1), "bf16", model_dtype="bf16", master_dtype="fp32")
    fresh.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)


def _run_on_two_gloo_ranks(worker) -> dict:
    """worker(rank, world, port, out) on 2 spawned processes; returns out {rank: result}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_run_then_exit, args=(worker, 2, port, out), nprocs=2, join=True)
    return dict(out)


def _run_then_exit(rank, worker, world, port, out):
    """Runs a worker, then ends its process without tearing the gloo process group down. Destroying
    ProcessGroupGloo joins gloo's run-loop thread while the caller holds the GIL, and that thread may be waiting for
    the GIL to release a tensor: a CPU CI rehearsal hung there for good (torch 2.13; ~ProcessGroupGloo under a DDP
    Reducer's destructor, one rank joining the run loop, the run loop in take_gil). The workers write their results
    to `out` (a Manager dict: each write waits for the manager's reply) before returning. A worker that raises ends
    the same way, with its traceback printed and exit code 1 (which mp.spawn reports), rather than through the
    teardown that could hang."""
    code = 0
    try:
        worker(rank, world, port, out)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _count_reduces_worker(rank, world, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    try:
        m = R.apply_recipe(tiny_mlp(layers=3), "fp8-hybrid", amax_history_len=4)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        x = batch(0) * (rank + 1)  # rank 1 sees twice the activations
        for _ in range(2):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[rank] = (calls, m.surogate_fp8_state.amax_history[:, :2].tolist())
    finally:
        dist.all_reduce = real  # (the process group stays: _run_then_exit)


def test_one_all_reduce_per_step_and_ranks_agree():
    out = _run_on_two_gloo_ranks(_count_reduces_worker)
    (c0, h0), (c1, h1) = out[0], out[1]
    assert c0 == c1 == [18, 18], "one all_reduce of all 3 x 6 rows per optimizer step"
    assert h0 == h1  # every rank casts with the same scales


# ---------------------------------------------------------------- torch.compile
def _train(m, steps=3, compiled=False):
    run = torch.compile(m, fullgraph=True, backend="aot_eager") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        loss = run(batch(i)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "bf16", "nvfp4"])
def test_compiled_fullgraph_trains_like_eager(recipe):
    """fullgraph=True: no graph break anywhere in the model; same losses and state as eager. nvfp4: the same
    stochastic-rounding draws (the step read and advanced in the graph, the seeds hashed there): identical losses."""
    torch._dynamo.reset()
    eager = R.apply_recipe(tiny_mlp(), recipe)
    comp = R.apply_recipe(tiny_mlp(), recipe)
    le, lc = _train(eager), _train(comp, compiled=True)
    if recipe == "nvfp4":
        assert lc == le
        steps = {n: int(b) for n, b in comp.named_buffers() if n.endswith("fp4_sr_step")}
        assert steps and set(steps.values()) == {3}, steps
    assert lc == pytest.approx(le, rel=1e-5, abs=1e-7)
    if recipe == "fp8-hybrid":
        torch.testing.assert_close(comp.surogate_fp8_state.amax_history, eager.surogate_fp8_state.amax_history,
                                   rtol=1e-6, atol=0)


def test_compiled_with_the_cast_as_one_op_trains_like_eager(monkeypatch):
    """recipes.fp8_hybrid.TRACED_CAST = "op": the traced casts are surogate::quantize_fp8_tensorwise[_t] calls (the
    Triton cast-transpose kernel on CUDA) instead of torch ops for inductor to fuse; fullgraph, and the same losses,
    states and gradients as eager (the op's reference is the torch path's formula)."""
    from surogate_hf.recipes import fp8_hybrid as FH

    monkeypatch.setattr(FH, "TRACED_CAST", "op")
    torch._dynamo.reset()
    eager = R.apply_recipe(tiny_mlp(), "fp8-hybrid")
    comp = R.apply_recipe(tiny_mlp(), "fp8-hybrid")
    le, lc = _train(eager), _train(comp, compiled=True)
    assert lc == pytest.approx(le, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(comp.surogate_fp8_state.amax_history, eager.surogate_fp8_state.amax_history,
                               rtol=1e-6, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "nvfp4"])
def test_regional_compile_shares_one_graph_across_layers(recipe):
    """Per-block compile (what users do for big models): the layers' rows (fp8) and indices (nvfp4, hashed into the
    stochastic-rounding seeds) are tensors, so every block reuses the same graph; fp8: the first step (current
    scaling) and the later ones (delayed) are the only two variants."""
    from torch._dynamo.utils import counters

    graphs = []
    for layers in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        kw = {"skip_quant_first_layers": 0, "skip_quant_last_layers": 0} if recipe == "nvfp4" else {}
        eager, comp = R.apply_recipe(tiny_mlp(layers), recipe, **kw), R.apply_recipe(tiny_mlp(layers), recipe, **kw)
        for blk in comp.layers:
            blk.compile(fullgraph=True, backend="aot_eager")
        le, lc = _train(eager), _train(comp)
        assert lc == pytest.approx(le, rel=1e-5, abs=1e-7)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], f"graphs compiled for 2 and 5 layers: {graphs}"


def _ddp_worker(rank, world, port, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # (it stays: _run_then_exit)
    m = R.apply_recipe(tiny_mlp(layers=2), "fp8-hybrid", amax_history_len=4)
    ddp = DDP(m, broadcast_buffers=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # micro-batch 0: rank 1 sees 8x larger activations; micro-batch 1: rank 1's are tiny
    for micro, s in enumerate((8.0 if rank else 1.0, 1e-3 if rank else 1.0)):
        with ddp.no_sync() if micro == 0 else __import__("contextlib").nullcontext():
            ddp(batch(0) * s).square().mean().backward()
    opt.step()
    broadcast = sum(b.numel() * b.element_size() for b in ddp.modules_buffers)
    out[rank] = (m.surogate_fp8_state.amax_history[0, 0].item(), broadcast)  # x of the first linear


def test_ddp_broadcasts_no_recipe_state_and_steps_see_every_rank():
    """DDP (broadcast_buffers=True, the Trainer's default) leaves the recipe state out of its per-step buffer
    broadcast (the state agrees across ranks through the update's all_reduce), and the step pushes the max over
    every rank and micro-batch (rank 1's 8x batch)."""
    out = _run_on_two_gloo_ranks(_ddp_worker)
    (a0, b0), (a1, b1) = out[0], out[1]
    assert a0 == a1 == pytest.approx(batch(0).abs().max().item() * 8.0, rel=1e-6)
    assert b0 == b1 == 0, "bytes of recipe state DDP would broadcast before every forward"


def test_a_deep_copy_trains_with_its_own_state():
    """copy.deepcopy of a recipe model (EMA copies, TRL reference models) gets a state bound to the copy: the copy's
    optimizer updates the copy's state from the copy's casts, and the original's state is left alone."""
    import copy

    m = R.apply_recipe(tiny_mlp(), "fp8-hybrid", amax_history_len=4)
    c = copy.deepcopy(m)
    st, cst = m.surogate_fp8_state, c.surogate_fp8_state
    assert cst is not st and cst.root() is c and c.layers[0][0].scaling_state is cst
    opt = torch.optim.SGD(c.parameters(), lr=1e-3)
    c(batch(0)).square().mean().backward()
    opt.step()
    assert cst.initialized and (cst.amax_history[:, 0] > 0).all(), "every row of the copy, dy rows included"
    assert not st.initialized and st.amax_history.abs().sum() == 0
