"""Weight fidelity on real weights, CPU only: SQNR of every format (and of MXFP4's scale-rounding rules) over
the linear weights of the convergence benchmark's model, and the weight error LoftQ leaves per format. `nf4` is the default encode (the
block scale searched, `nf4_scale_search`); the row after it is bitsandbytes' own (scale = the block absmax).

    python benchmarks/weight_fidelity.py                    # needs `benchmarks/convergence.py --prepare` once
    python benchmarks/weight_fidelity.py --layers 0,8,17 --loftq-iters 1,2,5

SQNR = 10 log10(sum w^2 / sum (w - deq(Q(w)))^2) over all selected weights together (dB; +3 dB = half the
error power). The MXFP4 rules (surogate_hf.formats.mxfp4._shared_exponent) all store valid E8M0 scales:
floor (OCP v1.0, the default), ceil (never clip), rtn (nearest exponent to amax/6), best (per block the
better of floor and floor+1, a Four-Over-Six analogue).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import convergence_assets as assets  # noqa: E402
from surogate_hf import formats as F  # noqa: E402
from surogate_hf.nn.linear import make_format  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant(w: torch.Tensor, how: str) -> torch.Tensor:
    if how.startswith("mxfp4"):
        return F.fake_quantize_mxfp4(w, torch.float32, how.split(":")[1])
    if how == "nvfp4":
        return F.fake_quantize_nvfp4(w, out_dtype=torch.float32)
    if how == "nvfp4 (no 4/6)":
        return F.fake_quantize_nvfp4(w, four_over_six=False, out_dtype=torch.float32)
    n, k = w.shape
    if how == "nf4 (bitsandbytes' absmax scale)":
        fmt = make_format("nf4", scale_search=False)
        return fmt.dequantize(fmt.quantize(w), n, k, torch.float32)
    fmt = make_format(how, **({"block_size": (128, 128)} if how == "fp8" else {}))
    return fmt.dequantize(fmt.quantize(w), n, k, torch.float32)


def e2m1_blocks(w: torch.Tensor, block: int, scale: str) -> torch.Tensor:
    """Diagnostic E2M1 fake-quant that isolates one difference at a time between NVFP4 and MXFP4:
    block size (16 / 32) and block scale ("exact" fp32 amax/6, "e4m3" amax/6 rounded to E4M3 as NVFP4
    does without its global, "e8m0" OCP floor power of two)."""
    xb = w.float().reshape(-1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "exact":
        s = amax / 6
    elif scale == "e4m3":
        s = (amax / 6).to(torch.float8_e4m3fn).float()  # weights here are << 448: no global needed to fit E4M3
    else:
        s = torch.ldexp(torch.ones_like(amax), (torch.frexp(amax)[1] - 3).float())
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = F.e2m1_decode(F.e2m1_encode(xb / s)) * s
    return q.reshape(w.shape)


def sqnr(num: float, den: float) -> float:
    return 10 * math.log10(num / den) if den > 0 else float("inf")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, default=assets.DEFAULT_DIR)
    ap.add_argument("--layers", default="0,4,8,13,17", help="decoder layers to read (comma-separated)")
    ap.add_argument("--loftq-layers", default="0,17", help="layers of the LoftQ table (a subset: slow on CPU)")
    ap.add_argument("--loftq-iters", default="1,3")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "weight_fidelity.json")
    args = ap.parse_args(argv)
    layers = [int(i) for i in args.layers.split(",")]
    loftq_layers = [int(i) for i in args.loftq_layers.split(",")]
    _, state, _, _ = assets.load_real(args.assets, max(layers + loftq_layers) + 1)
    linear = {n: w for n, w in state.items() if n.endswith(".weight") and n.split(".")[-2] in LINEARS}
    weights = {n: w for n, w in linear.items() if int(n.split(".")[2]) in layers}
    loftq_weights = {n: w for n, w in linear.items() if int(n.split(".")[2]) in loftq_layers}
    print(f"{len(weights)} weights of layers {layers}, {sum(w.numel() for w in weights.values()) / 1e6:.1f}M elements")

    kinds = ["fp8", "nvfp4", "nvfp4 (no 4/6)", "nf4", "nf4 (bitsandbytes' absmax scale)"] + [f"mxfp4:{r}" for r in F.mxfp4.SCALE_ROUNDINGS]
    sig = sum(float(w.square().sum()) for w in weights.values())
    rows = {}
    for how in kinds:
        noise = sum(float((fake_quant(w, how) - w).square().sum()) for w in weights.values())
        rows[how] = {"sqnr_db": sqnr(sig, noise), "rel_err_power": noise / sig}
    for block in (16, 32):
        for scale in ("exact", "e4m3", "e8m0"):
            noise = sum(float((e2m1_blocks(w, block, scale) - w).square().sum()) for w in weights.values())
            rows[f"diag: e2m1 1x{block}, {scale} scale"] = {"sqnr_db": sqnr(sig, noise), "rel_err_power": noise / sig}
    # MXFP4 floor: how often the block max clips, and where it lands on the E2M1 grid
    clipped = blocks = 0
    for w in weights.values():
        b = w.reshape(-1, 32).abs().amax(-1)
        _, s = F.quantize_mxfp4(w, "floor")
        top = b[b > 0] / F.e8m0_to_float(s).reshape(-1)[b > 0]
        clipped += int((top > 6).sum())
        blocks += top.numel()
    print("\n| format | weight SQNR (dB) | error power vs nvfp4 |\n|---|---|---|")
    for how, r in rows.items():
        print(f"| {how} | {r['sqnr_db']:.2f} | {r['rel_err_power'] / rows['nvfp4']['rel_err_power']:.2f}x |")
    print(f"\nMXFP4 floor: {100 * clipped / blocks:.1f}% of blocks have their max above 6 * scale (clipped to 6)")

    from surogate_hf.integrations.loftq import loftq_decompose
    from surogate_hf.nn.linear import LINEAR_CLASSES

    iters = [int(i) for i in args.loftq_iters.split(",")]
    loftq = {}
    print(f"\nLoftQ on layers {loftq_layers}, rank {args.rank}, scaling 2: relative weight error ||W - (deq + s*B@A)|| / ||W|| (mean over weights)")
    print("| format | plain | " + " | ".join(f"loftq {t} iter" for t in iters) + " |\n|---|---|" + "---|" * len(iters))
    for fmt in ("fp8", "nvfp4", "mxfp4", "nf4"):
        res = {"plain": [], **{t: [] for t in iters}}
        for w in loftq_weights.values():
            base = LINEAR_CLASSES[fmt](w.shape[1], w.shape[0], bias=False, device="cpu", dtype=torch.bfloat16)
            for t in iters:
                _, _, _, err = loftq_decompose(base, w, args.rank, 2.0, t)
                res[t].append(err["loftq"])
            res["plain"].append(err["plain"])
        mean = {str(k): sum(v) / len(v) for k, v in res.items()}
        loftq[fmt] = mean
        print(f"| {fmt} | {mean['plain']:.4f} | " + " | ".join(f"{mean[str(t)]:.4f}" for t in iters) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"layers": layers, "sqnr": rows, "mxfp4_floor_clipped_blocks": clipped / blocks,
                                    "loftq": loftq, "loftq_layers": loftq_layers, "rank": args.rank}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
