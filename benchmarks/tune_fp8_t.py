"""Tile shape / launch order sweep of the transposed FP8 cast (quantize_fp8_tensorwise_t), bit-checked against
the kernel in use. Diagnostic: it picks the launch configuration kernels/triton_quant/fp8.py uses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common import bench_ms

from surogate_hf.kernels import triton_quant as TQ, triton_recipe as TR


@triton.jit
def _variant(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr,
             ROWS_FASTEST: tl.constexpr):
    pid = tl.program_id(0)
    nrb = tl.cdiv(R, BR)
    ncb = tl.cdiv(C, BC)
    if ROWS_FASTEST:
        pr, pc = pid % nrb, pid // nrb
    else:
        pr, pc = pid // ncb, pid % ncb
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
             TQ._clamp_nan(x * s, -448.0, 448.0).to(tl.float8e4nv), mask=m)
    mt = (cols[:, None] < C) & (rows[None, :] < R)
    xt = tl.load(x_ptr + rows[None, :].to(tl.int64) * C + cols[:, None], mask=mt, other=0.0).to(tl.float32)
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :],
             TQ._clamp_nan(xt * s, -448.0, 448.0).to(tl.float8e4nv), mask=mt)
    tl.atomic_max(amax_ptr, tl.max(tl.max(TQ._abs_bits(x), axis=1), axis=0))


def main():
    scale = torch.tensor(3.0, device="cuda")
    for shape in [(8192, 4096), (14336, 4096), (8192, 14336), (4096, 14336), (8192, 2048), (8192, 6144)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        r, c = shape
        am0 = torch.zeros(1, dtype=torch.int32, device="cuda")
        q0, qt0 = TR.cast_fp8_into(x, scale.reshape(1), am0, torch.float8_e4m3fn, True)
        am0 = am0.view(torch.float32)
        base = bench_ms(lambda: TR.cast_fp8_into(x, scale.reshape(1), torch.zeros(1, dtype=torch.int32, device="cuda"),
                                                 torch.float8_e4m3fn, True))
        res = [f"current {base * 1e3:.0f}us ({4 * r * c / base / 1e9:.2f} TB/s)"]
        for br, bc, nw, rf in [(64, 64, 4, True), (64, 64, 4, False), (128, 64, 8, False), (64, 128, 8, False),
                               (128, 128, 8, False), (32, 128, 4, False), (128, 32, 4, True)]:
            q = torch.empty_like(q0)
            qt = torch.empty_like(qt0)
            am = torch.zeros((), dtype=torch.int32, device="cuda")
            grid = (triton.cdiv(r, br) * triton.cdiv(c, bc),)

            def run():
                _variant[grid](x, scale, q, qt, am, r, c, BR=br, BC=bc, ROWS_FASTEST=rf, num_warps=nw,
                               enable_fp_fusion=False)

            run()
            ok = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(
                qt.view(torch.uint8), qt0.view(torch.uint8)) and am.view(torch.float32).item() == am0.item()
            ms = bench_ms(run)
            res.append(f"{br}x{bc}/w{nw}/{'rows' if rf else 'cols'} {ms * 1e3:.0f}us {4 * r * c / ms / 1e9:.2f}TB/s"
                       f"{'' if ok else ' MISMATCH'}")
        print(shape, " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
