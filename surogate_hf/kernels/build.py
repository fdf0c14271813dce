"""`python -m surogate_hf.kernels.build`: build (or load the cached) native extension and report."""

from __future__ import annotations

import sys
import time

import torch


def main() -> int:
    from . import ext

    if not torch.cuda.is_available():
        print("surogate_hf extension: skipped, no CUDA device (the Triton / reference paths need none of it)")
        return 0
    t0 = time.perf_counter()
    mod = ext.load(build=True)
    ok, why = ext.status()
    if mod is None:
        print(f"surogate_hf extension: NOT loaded: {why}")
        return 1
    print(f"surogate_hf extension: loaded from {ext.build_dir()} in {time.perf_counter() - t0:.1f}s; "
          f"CUDA kernels of: {', '.join(f'torch.ops.surogate.ext_{n}' for n in ext.OPS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
