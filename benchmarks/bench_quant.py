"""Quantize / dequantize kernels: effective TB/s (bytes read + written, each once) vs a copy,
eager / compiled torch and torchao. Target: >= 2.4 TB/s at large sizes on the H100 (80% of copy)."""

from __future__ import annotations

import argparse

import torch

from common import attempt, bench_ms, table, write_result

import surogate_hf.kernels  # noqa: F401  (registers the CUDA kernels)
from surogate_hf import formats as F
from surogate_hf.kernels import ext, nvfp4_qdq as QDQ, triton_recipe as TR

ops = torch.ops.surogate
TARGET = 2.4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x4096,8192x14336")
    ap.add_argument("--name", default="quant_kernels", help="results/<name>.md")
    ap.add_argument("--only", default="", help="run the kernels whose name contains this (and the copy ceiling)")
    args = ap.parse_args()
    mod = ext.load(build=True)
    rows, errors = [], {}
    for shp in args.shapes.split(","):
        m, k = (int(v) for v in shp.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        n = x.numel()
        scale = torch.tensor(3.0, device="cuda")
        amax_t = x.abs().amax().float()
        e4 = torch.float8_e4m3fn

        def eager_cast():
            a = x.abs().amax()
            return (x.float() * scale).clamp(-448, 448).to(e4), a

        compiled_cast = torch.compile(eager_cast)

        def ext_cast():
            q = torch.empty(x.shape, dtype=e4, device="cuda")
            am = torch.zeros(1, dtype=torch.int32, device="cuda")
            mod.fp8_cast_amax(x, scale.reshape(1), q, am)
            return q

        scale_row, bits = scale.reshape(1), torch.zeros(1, dtype=torch.int32, device="cuda")
        nv_q = ops.quantize_nvfp4(x, False, True, "mse", False, 0, amax_t)
        mx_q = ops.quantize_mxfp4(x)
        fb_q = ops.quantize_fp8_blocks(x, 128, 128, False)
        signs = torch.ones(16, device="cuda")
        # (name, fn, bytes read + written)
        cases = [
            ("copy (ceiling)", lambda: x.clone(), 4 * n),
            ("fp8 tensorwise+amax: torch eager", eager_cast, 3 * n),
            ("fp8 tensorwise+amax: torch.compile", compiled_cast, 3 * n),
            ("fp8 tensorwise+amax: ours CUDA (csrc)", ext_cast if mod is not None else None, 3 * n),
            ("fp8 tensorwise+amax: ours Triton", lambda: TR.cast_fp8_into(x, scale_row, bits, e4, False), 3 * n),
            ("fp8 tensorwise+amax+transpose: ours Triton", lambda: TR.cast_fp8_into(x, scale_row, bits, e4, True), 4 * n),
            ("fp8 1x128 tiles: ours Triton", lambda: ops.quantize_fp8_tiles(x, 128), 3 * n + 4 * n // 128),
            ("fp8 1x128 tiles: ours CUDA (csrc)", (lambda: mod.fp8_quantize_tiles(x, 16)) if mod is not None else None,
             3 * n + 4 * n // 128),
            ("fp8 128x128 blocks: ours", lambda: ops.quantize_fp8_blocks(x, 128, 128, False), 3 * n),
            ("nvfp4 1x16 4/6 mse (given amax): ours", lambda: ops.quantize_nvfp4(x, False, True, "mse", False, 0, amax_t),
             2 * n + n // 2 + n // 16),
            ("nvfp4 1x16 4/6 mse (+amax pass): ours", lambda: ops.quantize_nvfp4(x, False, True, "mse", False, 0, None),
             2 * n + n // 2 + n // 16),
            ("nvfp4 1x16 stochastic: ours", lambda: ops.quantize_nvfp4(x, False, False, "mse", True, 7, amax_t),
             2 * n + n // 2 + n // 16),
            ("nvfp4 16x16 4/6: ours", lambda: ops.quantize_nvfp4(x, True, True, "mse", False, 0, amax_t),
             2 * n + n // 2 + n // 16),
            ("mxfp4: ours", lambda: ops.quantize_mxfp4(x), 2 * n + n // 2 + n // 32),
            ("rht 16 (fp32 out): ours", lambda: ops.rht(x, signs), 6 * n),
            ("dequant fp8 blocks -> bf16: ours", lambda: ops.dequantize_fp8_blocks(*fb_q, 128, 128, torch.bfloat16), 3 * n),
            ("dequant nvfp4 -> bf16: ours", lambda: ops.dequantize_nvfp4(*nv_q, torch.bfloat16), 2 * n + n // 2 + n // 16),
            ("dequant mxfp4 -> bf16: ours", lambda: ops.dequantize_mxfp4(*mx_q, torch.bfloat16), 2 * n + n // 2 + n // 32),
        ]
        # the nvfp4 recipe's operand passes: amax, then quantize + write e2m1 * s_blk as bf16 (rows: x, dy for the
        # forward / dgrad; tokens: the wgrad's dy and x, blocks along axis 0 with the transform and stochastic rounding)
        rht_signs = F.random_signs(0).cuda()
        if mod is not None:
            cases += [
                ("nvfp4 operand amax, rows: ours CUDA (csrc)", lambda: mod.nvfp4_amax(x, None, 1), 2 * n),
                ("nvfp4 operand amax, tokens + RHT: ours CUDA (csrc)", lambda: mod.nvfp4_amax(x, rht_signs, 0), 2 * n),
                ("nvfp4 qdq rows 4/6: ours CUDA (csrc)", lambda: mod.nvfp4_qdq(x, amax_t, None, 1, True, 0, False, 0),
                 4 * n),
                ("nvfp4 qdq rows 4/6 + SR: ours CUDA (csrc)",
                 lambda: mod.nvfp4_qdq(x, amax_t, None, 1, True, 0, True, 7), 4 * n),
                ("nvfp4 qdq tokens 4/6 + SR + RHT: ours CUDA (csrc)",
                 lambda: mod.nvfp4_qdq(x, amax_t, rht_signs, 0, True, 0, True, 7), 4 * n),
                ("nvfp4 qdq 16x16 tiles 4/6 (weights): ours CUDA (csrc)",
                 lambda: mod.nvfp4_qdq(x, amax_t, None, 2, True, 0, False, 0), 4 * n),
                ("nvfp4 qdq rows 4/6 + own amax (one call, two passes): ours CUDA (csrc)",
                 lambda: mod.nvfp4_qdq(x, None, None, 1, True, 0, False, 0), 6 * n),
            ]
        cases += [
            ("nvfp4 qdq rows 4/6 + SR: Triton composed (no extension)",
             lambda: QDQ._triton_qdq(x, amax_t, None, 1, True, "mse", True, 7), 4 * n),
            ("nvfp4 qdq tokens 4/6 + SR + RHT: Triton composed (no extension)",
             lambda: QDQ._triton_qdq(x, amax_t, rht_signs, 0, True, "mse", True, 7), 4 * n),
        ]
        try:
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

            cases += [
                ("nvfp4 1x16: torchao to_nvfp4 (eager)", lambda: NVFP4Tensor.to_nvfp4(x, per_tensor_scale=amax_t),
                 2 * n + n // 2 + n // 16),
                ("nvfp4 1x16: torchao to_nvfp4 triton", lambda: NVFP4Tensor.to_nvfp4(
                    x, per_tensor_scale=amax_t, use_triton_kernel=True), 2 * n + n // 2 + n // 16),
                ("mxfp4: torchao to_mx (eager)", lambda: to_mx(x, torch.float4_e2m1fn_x2, 32), 2 * n + n // 2 + n // 32),
            ]
        except Exception as exc:
            errors["torchao"] = f"import failed: {exc}"
        copy_tbs = None
        for name, fn, nbytes in cases:
            if args.only and args.only not in name and not name.startswith("copy"):
                continue
            label = f"{name} [{shp}]"
            if fn is None:
                rows.append([name, shp, None, None, None, TARGET, f"not run: extension {ext.status()[1]}"])
                continue
            ms = attempt(label, lambda: bench_ms(fn), errors)
            if ms is None:
                rows.append([name, shp, None, None, None, TARGET, errors[label]])
                continue
            tbs = nbytes / ms / 1e9
            if name.startswith("copy"):
                copy_tbs = tbs
            ok = "" if name.startswith("copy") or "torch" in name else ("meets" if tbs >= TARGET else f"misses by {TARGET - tbs:.2f}")
            rows.append([name, shp, ms, tbs, tbs / copy_tbs if copy_tbs else None, TARGET, ok])
    body = table(["kernel", "shape (bf16 in)", "ms", "TB/s", "x copy", "target TB/s", "note"], rows)
    if errors:
        body += "\n\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items())
    write_result(args.name, "Quantize / dequantize kernels, effective bandwidth", body)


if __name__ == "__main__":
    main()
