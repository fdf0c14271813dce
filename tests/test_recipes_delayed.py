"""Delayed scaling over scripted amax sequences: window, MAX vs MOST_RECENT, margin, zero / NaN amax."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from surogate_hf import formats as F
from surogate_hf.recipes import DelayedScaling

E4 = F.FP8_MAX[F.E4M3]


def run(seq, **kw):
    ds = DelayedScaling(["e4m3"], **kw)
    scales = []
    for a in seq:
        ds.update(0, torch.tensor(a))
        scales.append(ds.scale[0].item())
    return ds, scales


def test_max_over_window():
    ds, s = run([2.0, 8.0, 1.0, 1.0, 1.0], history_len=3, algo="max")
    # windows: [2] [8,2] [1,8,2] [1,1,8] [1,1,1]
    expect = [E4 / 2, E4 / 8, E4 / 8, E4 / 8, E4 / 1]
    assert s == pytest.approx(expect, rel=1e-7)
    assert ds.amax_history[0].tolist() == [1.0, 1.0, 1.0]


def test_most_recent():
    _, s = run([2.0, 8.0, 1.0], history_len=3, algo="most_recent")
    assert s == pytest.approx([E4 / 2, E4 / 8, E4 / 1], rel=1e-7)


def test_margin():
    _, s = run([4.0], history_len=4, margin=2)
    assert s == pytest.approx([E4 / 4 / 4], rel=1e-7)


def test_zero_and_nonfinite_keep_previous_scale():
    _, s = run([4.0, 0.0, float("nan"), float("inf"), 2.0], history_len=1, algo="max")
    assert s == pytest.approx([E4 / 4] * 4 + [E4 / 2], rel=1e-7)
    ds, s = run([4.0, float("nan")], history_len=4, algo="most_recent")
    assert s == pytest.approx([E4 / 4, E4 / 4], rel=1e-7)
    assert ds.amax_history[0, 0].item() == 0.0  # NaN recorded as "no information"
    # MAX over a window that still holds a good amax: a NaN step does not freeze the scale
    _, s = run([4.0, float("nan"), 1.0], history_len=2, algo="max")
    assert s == pytest.approx([E4 / 4, E4 / 4, E4 / 1], rel=1e-7)


def test_cast_uses_previous_scale_then_updates():
    ds = DelayedScaling(["e4m3", "e5m2"], history_len=8)
    x = torch.tensor([0.5, -3.0, 1e-3])
    q, sinv = ds.cast(0, x)  # first cast: scale 1 (no history yet)
    assert sinv.item() == 1.0 and torch.equal(q, F.cast_to_fp8(x, F.E4M3))
    assert ds.scale[0].item() == pytest.approx(E4 / 3.0)
    q2, sinv2 = ds.cast(0, x)
    ref_q, ref_inv = F.quantize_fp8_tensorwise(x, F.E4M3, scale=torch.tensor(E4 / 3.0))
    assert torch.equal(q2.float(), ref_q.float()) and sinv2.item() == pytest.approx(ref_inv.item())
    g = torch.tensor([1e-6, -2e-6])
    ds.cast(1, g)
    assert ds.scale[1].item() == pytest.approx(F.FP8_MAX[F.E5M2] / 2e-6, rel=1e-6)
    assert ds.scale[0].item() == pytest.approx(E4 / 3.0)  # roles are independent


def test_state_is_in_state_dict():
    ds, _ = run([3.0], history_len=5)
    sd = ds.state_dict()
    assert set(sd) == {"amax_history", "scale"} and sd["amax_history"].shape == (1, 5)
    fresh = DelayedScaling(["e4m3"], history_len=5)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.scale, ds.scale) and torch.equal(fresh.amax_history, ds.amax_history)


def _reduce_worker(rank, world, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = DelayedScaling(["e4m3"], history_len=4)
    ds.cast(0, torch.full((4,), float(rank + 1)))  # rank 0 sees amax 1, rank 1 sees amax 2
    out[rank] = ds.scale[0].item()
    dist.destroy_process_group()


def test_reduce_amax_all_reduces_over_dp_group():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_reduce_worker, args=(2, port, out), nprocs=2, join=True)
    assert out[0] == out[1] == pytest.approx(E4 / 2.0)


def _steps():
    g = torch.Generator().manual_seed(5)
    for scale in (1.0, 4.0, 0.0, float("nan"), 0.25):
        x = torch.randn(6, 8, generator=g) * scale
        w = torch.randn(4, 8, generator=g) * (scale if scale == scale else 1.0)
        yield x, w


def bits(q):
    """fp8 bit patterns (NaN-safe equality); transposed views made contiguous first."""
    return q.contiguous().view(torch.uint8)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_cast_group_and_transpose_match_one_role_casts(algo):
    """The forward's grouped (x, W) cast with transposes equals one-role casts: same q, scale_inv, state."""
    kw = dict(history_len=3, algo=algo, margin=1)
    a, b = DelayedScaling(["e4m3", "e4m3", "e5m2"], **kw), DelayedScaling(["e4m3", "e4m3", "e5m2"], **kw)
    for x, w in _steps():
        ((xq, xqt), (wq,)), sinv = a.cast_group(0, (x, w), "train", (True, False))
        xq1, xs1 = b.cast(0, x)
        wq1, ws1 = b.cast(1, w)
        assert torch.equal(bits(xq), bits(xq1)) and torch.equal(bits(wq), bits(wq1))
        assert xqt.is_contiguous() and torch.equal(bits(xqt), bits(xq1.t()))
        assert torch.equal(sinv, torch.stack((xs1, ws1)))
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    assert a.amax_history[0, 1].item() == 0.0  # the NaN step (two steps back) was recorded as 0
    q, qt, s = a.cast(2, x, transpose=True)
    q1, s1 = b.cast(2, x)
    assert torch.equal(bits(q), bits(q1)) and torch.equal(bits(qt), bits(q1.t())) and torch.equal(s, s1)
    assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)


def test_cast_group_refuses_mixed_formats():
    ds = DelayedScaling(["e4m3", "e4m3", "e5m2"])
    with pytest.raises(ValueError, match="share one FP8 format"):
        ds.cast_group(1, (torch.ones(2, 2), torch.ones(2, 2)))
