"""What ptxas reports for the mixed-input WGMMA kernels (csrc/weight_only/mixed_input_gemm.cu) built for sm_90a, with
no GPU: what a kernel edit can break silently, since the GPU tests check results, not how the code was compiled.

- No register spills in any kernel (local-memory traffic in the main loop).
- No serialized WGMMAs (ptxas C7510-C7515 "Potential Performance Loss: wgmma.mma_async instructions are
  serialized"): without enough registers ptxas waits for each WGMMA before the next, which it measured as
  correct but several times slower.
- The register-operand kernels of 128- and 256-token tiles launch with 168 registers per thread: their warpgroups
  trade registers with setmaxnreg (producer 56, consumers 224), and 128 x 56 + 256 x 224 must not exceed what the
  CTA was given (168 x 384); with fewer, the consumers' setmaxnreg.inc would wait forever. Those of 64-token tiles
  (<= 64 tokens, K split over a cluster) trade nothing and fit two CTAs per SM: <= 80 registers.

Skipped where no CUDA toolkit (nvcc) is installed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from test_csrc_host import _nvcc

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "weight_only" / "mixed_input_gemm.cu"
THREADS, PRODUCER, CONSUMER = 384, 56, 224  # the kernels' kThreads and their setmaxnreg counts


@pytest.fixture(scope="module")
def ptxas_report(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc)")
    out = tmp_path_factory.mktemp("ptxas") / "mixed_input_gemm.cubin"
    proc = subprocess.run([nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                           "-Xptxas", "-v", "-o", str(out), str(SOURCE)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _functions(report: str) -> dict[str, dict]:
    """{mangled kernel name: {"registers": n, "spill": bytes stored + loaded}} from ptxas -v's lines."""
    funcs, current = {}, None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = funcs.setdefault(m.group(1), {})
        elif current is not None and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            current["spill"] = int(m.group(1)) + int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    return funcs


def test_the_mixed_input_kernels_compile_without_spills_or_serialized_wgmmas(ptxas_report):
    funcs = _functions(ptxas_report)
    rs = {n: f for n, f in funcs.items() if "mixed_input_gemm_rs_kernel" in n}
    # NVFP4 / MXFP4 / NF4 at 64-, 128- and 256-token tiles (the one mixed-input kernel: no other is compiled)
    assert len(rs) == 9 and len(funcs) == 9, sorted(funcs)
    assert not re.search(r"C75\d\d|serialized", ptxas_report), [
        line for line in ptxas_report.splitlines() if re.search(r"C75\d\d|serialized", line)]
    assert all(f["spill"] == 0 for f in funcs.values()), {n: f for n, f in funcs.items() if f["spill"]}
    assert PRODUCER * 128 + CONSUMER * (THREADS - 128) <= 168 * THREADS
    wide = {n: f for n, f in rs.items() if not re.search(r"ELi64E", n)}
    assert len(wide) == 6 and all(f["registers"] == 168 for f in wide.values()), rs
    # two CTAs of 384 threads per SM: 65536 / 768 registers, in the allocation's steps of 8
    assert all(f["registers"] <= 80 for n, f in rs.items() if n not in wide), rs
