#!/usr/bin/env python3
"""Bit-for-bit snapshot of the Triton quantize kernels run by the interpreter on CPU, for checking a refactor.

    python3 tools/kernel_snapshot.py save BEFORE.pt      # on the old code
    python3 tools/kernel_snapshot.py save AFTER.pt       # on the new code
    python3 tools/kernel_snapshot.py compare BEFORE.pt AFTER.pt

`save` runs every Python-level entry point of surogate_hf.kernels.triton_quant (amax, the FP8 per-tensor casts
and their transpose, the delayed-scaling update, FP8 blocks / tiles and their dequantize, NVFP4 quantize with every
option and dequantize, MXFP4 quantize / dequantize, rht, transpose_2d) and the triton_recipe / triton_norm /
triton_gemm launches that import from it, under TRITON_INTERPRET=1 on CPU tensors of a few shapes, and saves
each output's bits, or the error a case raised (the interpreter path implements the e4m3 cast only: e5m2 casts
raise). Not a check against the references (tests/kernels/test_gpu_kernels.py is, on a GPU): only that a change
that should keep the numbers does. A minute or two on 2 cores.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ.setdefault("SUROGATE_HF_AUTOTUNE", "0")

import torch  # noqa: E402


def data(shape, seed, dtype=torch.float32, specials=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    if specials and x.numel() > 8:
        f = x.view(-1)
        f[:6] = torch.tensor([0.0, -0.0, 1e-30, 1e4, -3e-3, 448.0])  # zeros, a subnormal, saturation, the max
    return x.to(dtype)


def bits(t):
    """Tensors as (tag, dtype, shape, their bytes as integers); nested tuples / lists alike."""
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous()
        if t.dtype.is_floating_point and t.element_size() in (1, 2, 4, 8):
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            return ("T", str(t.dtype), tuple(t.shape), t.view(as_int).clone())
        return ("T", str(t.dtype), tuple(t.shape), t.clone())
    if isinstance(t, (tuple, list)):
        return tuple(bits(v) for v in t)
    return repr(t)


def save(path: str) -> None:
    import surogate_hf
    from surogate_hf.kernels import triton_gemm as TG, triton_norm as TN, triton_quant as TQ, triton_recipe as TR

    print("surogate_hf from", os.path.dirname(surogate_hf.__file__))

    cases = {}

    def case(name, fn):
        try:
            cases[name] = ("ok", bits(fn()))
        except Exception as e:  # noqa: BLE001
            cases[name] = ("err", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(name, cases[name][0], "" if cases[name][0] == "ok" else cases[name][1], flush=True)

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    for shape in [(3, 5), (64, 256), (37, 200), (2, 33, 130)]:
        for dt in (torch.float32, torch.bfloat16):
            x = data(shape, 1, dt)
            tag = f"{shape}-{str(dt)[6:]}"
            case(f"amax/{tag}", lambda: TQ.amax(x))
            for fdt in (e4, e5):
                for sc in (1.0, 0.37):
                    s = torch.tensor(sc)
                    case(f"fp8_tensorwise/{tag}/{str(fdt)[6:]}/{sc}", lambda: TQ.quantize_fp8_tensorwise(x, s, fdt))
                    case(f"fp8_tensorwise_t/{tag}/{str(fdt)[6:]}/{sc}", lambda: TQ.quantize_fp8_tensorwise_t(x, s, fdt))
    xn = data((7,), 2)
    xn[3] = float("nan")
    case("amax/nan", lambda: TQ.amax(xn))
    case("fp8_tensorwise/nan", lambda: TQ.quantize_fp8_tensorwise(xn, torch.tensor(2.0), e4))

    for L, n in [(16, 3), (1024, 2), (1500, 2)]:
        for use_max in (False, True):
            for margin in (0, 1):
                def upd():
                    g = torch.Generator().manual_seed(L)
                    h = torch.rand((n, L), generator=g) * 10
                    sc = torch.rand(n, generator=g) + 0.5
                    am = torch.tensor([3.5, float("nan"), 0.0][:n])
                    TQ.delayed_scaling_update(h, sc, am, e4, margin, use_max)
                    return h, sc
                case(f"delayed_update/{L}x{n}/max={use_max}/m={margin}", upd)

    for shape, bn, bk in [((256, 256), 128, 128), ((100, 300), 128, 128), ((3, 100, 300), 128, 128), ((2, 256, 128), 128, 128), ((64, 96), 32, 32)]:
        for ue in (False, True):
            w = data(shape, 3)
            case(f"fp8_blocks/{shape}/{bn}x{bk}/ue8m0={ue}", lambda: TQ.quantize_fp8_blocks(w, bn, bk, ue))
            def dq():
                q, s = TQ.quantize_fp8_blocks(w, bn, bk, ue)
                return [TQ.dequantize_fp8_blocks(q, s, bn, bk, od) for od in (torch.float32, torch.bfloat16)]
            case(f"dequant_fp8_blocks/{shape}/{bn}x{bk}/ue8m0={ue}", dq)

    for shape in [(4, 128), (33, 300), (2, 5, 256)]:
        for tile in (128, 32):
            for cm in (False, True):
                x = data(shape, 4, torch.bfloat16)
                case(f"fp8_tiles/{shape}/{tile}/colmajor={cm}", lambda: TQ.quantize_fp8_tiles(x, tile, cm))

    for shape in [(16, 64), (32, 256), (48, 160), (2, 16, 128)]:
        x = data(shape, 5, torch.bfloat16)
        for b2 in (False, True):
            for fos, rule in [(False, "mse"), (True, "mse"), (True, "mae"), (True, "abs_max")]:
                for st in (False, True):
                    for am in (None, "given"):
                        a = None if am is None else torch.tensor(7.5)
                        nm = f"nvfp4/{shape}/2d={b2}/46={fos}/{rule}/sr={st}/amax={am}"
                        case(nm, lambda: TQ.quantize_nvfp4(x, b2, fos, rule, st, 1234, a))
        def nvdq():
            p, s, g = TQ.quantize_nvfp4(x, False, False, "mse", False, 0, None)
            return [TQ.dequantize_nvfp4(p, s, g, od) for od in (torch.float32, torch.bfloat16)]
        case(f"dequant_nvfp4/{shape}", nvdq)

    for shape in [(16, 64), (33, 512), (2, 3, 96)]:
        x = data(shape, 6, torch.bfloat16)
        if shape[0] == 33:
            x.view(-1)[10] = float("inf")  # a block with an inf: its shared exponent is 255 (NaN)
        case(f"mxfp4/{shape}", lambda: TQ.quantize_mxfp4(x))
        def mxdq():
            p, s = TQ.quantize_mxfp4(x)
            return [TQ.dequantize_mxfp4(p, s, od) for od in (torch.float32, torch.bfloat16)]
        case(f"dequant_mxfp4/{shape}", mxdq)

    signs = torch.tensor([1, -1] * 8, dtype=torch.float32)
    for shape in [(16, 16), (33, 160), (2, 4, 256)]:
        x = data(shape, 7, torch.bfloat16)
        case(f"rht/{shape}", lambda: TQ.rht(x, signs))

    for shape in [(5, 7), (64, 64), (100, 130)]:
        x = data(shape, 8).to(e4)
        case(f"transpose_2d/{shape}/fp8", lambda: TQ.transpose_2d(x))
        case(f"transpose_2d/{shape}/u8", lambda: TQ.transpose_2d(x.view(torch.uint8)))

    # the sibling modules that import kernels and helpers from triton_quant
    for shape in [(3, 5), (37, 200)]:
        x = data(shape, 9, torch.bfloat16)
        def rec_amax():
            a = torch.tensor([0.5])
            TR.amax_into(x, a.view(torch.int32))
            return a
        case(f"recipe.amax_into/{shape}", rec_amax)
        for tr in (False, True):
            def rec_cast():
                a = torch.tensor([0.5])
                q, qt = TR.cast_fp8_into(x, torch.tensor([0.37]), a.view(torch.int32), e4, tr)
                return q, qt, a
            case(f"recipe.cast_fp8_into/{shape}/t={tr}", rec_cast)
            def norm():
                w = data((shape[1],), 10, torch.bfloat16, specials=False)
                a = torch.tensor([0.5])
                out = TN.rmsnorm_fwd(x, w, 1e-6, False, torch.bfloat16, (torch.tensor([2.0]), a.view(torch.int32), e4, tr))
                return out, a
            case(f"norm.rmsnorm_fwd_fp8/{shape}/t={tr}", norm)
    for n, k, m in [(32, 64, 3), (48, 128, 17)]:
        w = data((n, k), 11, torch.bfloat16, specials=False)
        x = data((m, k), 12, torch.bfloat16, specials=False)
        dy = data((m, n), 13, torch.bfloat16, specials=False)
        def gemm_nv():
            p, s, g = TQ.quantize_nvfp4(w, False, False, "mse", False, 0, None)
            return (TG.dequantize(TG.NVFP4, p, s, g, None, n, k, 64, torch.bfloat16),
                    TG.linear(TG.NVFP4, x, p, s, g, None, n, k), TG.linear_dgrad(TG.NVFP4, dy, p, s, g, None, n, k))
        case(f"gemm.nvfp4/{n}x{k}/m={m}", gemm_nv)
        def gemm_mx():
            p, s = TQ.quantize_mxfp4(w)
            return (TG.dequantize(TG.MXFP4, p, s, None, None, n, k, 64, torch.bfloat16),
                    TG.linear(TG.MXFP4, x, p, s, None, None, n, k), TG.linear_dgrad(TG.MXFP4, dy, p, s, None, None, n, k))
        case(f"gemm.mxfp4/{n}x{k}/m={m}", gemm_mx)

    torch.save(cases, path)
    print(f"{sum(v[0] == 'ok' for v in cases.values())}/{len(cases)} cases ran; saved {path}")


def _eq(x, y):
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "T":
        return isinstance(y, tuple) and x[:3] == y[:3] and torch.equal(x[3], y[3])
    if isinstance(x, tuple):
        return isinstance(y, tuple) and len(x) == len(y) and all(_eq(u, v) for u, v in zip(x, y))
    return x == y


def compare(path_a: str, path_b: str) -> int:
    a, b = torch.load(path_a, weights_only=False), torch.load(path_b, weights_only=False)
    if a.keys() != b.keys():
        print("different cases:", sorted(set(a) ^ set(b)))
        return 1
    bad = [k for k in a if not _eq(a[k], b[k])]
    ran = sum(v[0] == "ok" for v in a.values())
    print(f"{len(a)} cases, {ran} ran, {len(a) - ran} raised the same error on both sides; {len(bad)} differ")
    for k in bad:
        print("DIFFERS", k)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "save":
        save(argv[2])
        return 0
    if len(argv) == 4 and argv[1] == "compare":
        return compare(argv[2], argv[3])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
