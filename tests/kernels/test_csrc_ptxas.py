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

- No instruction writes a register that a WGMMA still in flight reads as its A operand, and no loop goes round with
  a WGMMA in flight (the loop body would redefine its fragment registers): a register-operand WGMMA reads them
  asynchronously, and PTX leaves writing them before the covering wgmma.wait_group undefined. ptxas does not prevent
  it: the kernel's results came out wrong, differently from run to run, only when the consumers ran fast enough
  (session 27). Checked on the SASS (cuobjdump), where the toolkit has it.

Skipped where no CUDA toolkit (nvcc) is installed.
"""

from __future__ import annotations

import re
import shutil
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
    return proc.stderr, out


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
    ptxas_report, _ = ptxas_report
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


def _cuobjdump(nvcc: str) -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    cand = Path(nvcc).resolve().parent / "cuobjdump"
    return str(cand) if cand.exists() else None


def _writes(op: str, args: str) -> int | None:
    """The register an instruction writes (its first operand), or None for stores, barriers and the like."""
    d = re.match(r"R(\d+)", args)
    return int(d.group(1)) if d and not op.startswith(("ST", "RED", "ATOM", "SYNCS", "BAR")) else None


def wgmma_register_hazards(sass: str) -> dict[str, list[str]]:
    """{kernel: [what breaks the rule]} over cuobjdump -sass text: an instruction that writes one of the four A
    registers of an HGMMA not yet covered by a WARPGROUP.DEPBAR (gsb0 <= n keeps the last n in flight). Read in
    listing order; where a backward branch goes round with HGMMAs in flight, the loop is read again from the branch's
    target, with them in flight, until a DEPBAR has covered them all (a write before that is the hazard), and a loop
    that comes back to its branch with them still in flight breaks the rule too."""
    found = {}
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        name, problems, in_flight = body.split()[0], [], []
        code = []
        for line in body.splitlines():
            m = re.search(r"/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([\w.]+)\s*([^;]*);", line)
            if m:
                code.append((int(m.group(1), 16), m.group(3), m.group(4)))

        def step(in_flight, addr, op, args):
            """in_flight after the instruction, and the problems it makes"""
            if op.startswith("HGMMA"):
                return in_flight + [int(re.findall(r"R(\d+)", args)[1])], []
            if op.startswith("WARPGROUP.DEPBAR"):
                keep = int(args.split(",")[-1], 16)
                return (in_flight[len(in_flight) - keep:] if keep else []), []
            r = _writes(op, args)
            if r is None:
                return in_flight, []
            return in_flight, [f"{addr:#06x} {op} writes R{r}, A operand of an HGMMA in flight" for a in in_flight
                               if a <= r < a + 4]

        for addr, op, args in code:
            if (op.startswith("BRA") and in_flight and (to := re.match(r"0x[0-9a-f]+", args))
                    and int(to[0], 16) < addr):
                # round the loop once more with what is in flight at its branch
                carried, going = len(in_flight), list(in_flight)
                for a2, op2, args2 in code:
                    if a2 < int(to[0], 16):
                        continue
                    if a2 >= addr:
                        problems.append(f"{addr:#06x} loops back with {carried} WGMMAs in flight that no "
                                        "WARPGROUP.DEPBAR in the loop covers")
                        break
                    before = len(going)
                    going, found_here = step(going, a2, op2, args2)
                    problems += [p + " (round the loop)" for p in found_here if p]
                    carried -= max(0, min(carried, before - len(going)) if op2.startswith("WARPGROUP.DEPBAR") else 0)
                    if carried <= 0:
                        break
                continue
            in_flight, found_here = step(in_flight, addr, op, args)
            problems += found_here
        if problems:
            found[name] = problems[:5]
    return found


def test_no_instruction_overwrites_the_a_fragments_of_a_wgmma_in_flight(ptxas_report):
    _, cubin = ptxas_report
    tool = _cuobjdump(_nvcc())
    if tool is None:
        pytest.skip("no cuobjdump in the CUDA toolkit")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=300).stdout
    assert sass.count("HGMMA") >= 9 * 4, "no WGMMA found in the SASS"
    assert wgmma_register_hazards(sass) == {}


def test_the_hazard_check_finds_what_it_looks_for():
    """The check itself, on SASS lines shaped like the kernel's before session 27 (three WGMMAs left in flight round
    the loop while its head decoded into their registers), like a decode that writes a fragment register in flight,
    and like session 32's 64-token loop (WGMMAs in flight round the loop, covered before their registers are
    written)."""
    head = "\n\tFunction : kernel\n"
    hgmma = "        /*{:04x}*/                   HGMMA.64x256x16.F32.BF16 R24, R{}, gdesc[UR16], R24, gsb0 ;\n"
    depbar = "        /*{:04x}*/                   WARPGROUP.DEPBAR.LE gsb0, 0x{} ;\n"
    hmul = "        /*{:04x}*/                   HMUL2.BF16_V2 R{}, R7, R8 ;\n"
    branch = "        /*{:04x}*/               @!P0 BRA 0x{:x} ;\n"
    body = "".join(hgmma.format(0x100 + 16 * i, 152 + 4 * i) for i in range(4))
    # the loop's head decodes into the registers of WGMMAs still in flight from the last time round
    looped = head + hmul.format(0xf0, 157) + body + depbar.format(0x140, 3) + branch.format(0x150, 0xf0)
    assert "round the loop" in wgmma_register_hazards(looped)["kernel"][0]
    # no DEPBAR in the loop: what goes round in flight is never covered
    uncovered = head + body + branch.format(0x140, 0x100)
    assert "loops back" in wgmma_register_hazards(uncovered)["kernel"][0]
    waited = head + hmul.format(0xf0, 157) + body + depbar.format(0x140, 0) + branch.format(0x150, 0xf0)
    assert wgmma_register_hazards(waited) == {}
    # in flight round the loop, covered by a DEPBAR before the head writes their registers
    covered = head + depbar.format(0xe0, 0) + hmul.format(0xf0, 157) + body + branch.format(0x140, 0xe0)
    assert wgmma_register_hazards(covered) == {}
    written = head + body + hmul.format(0x140, 157) + depbar.format(0x150, 0)
    assert "writes R157" in wgmma_register_hazards(written)["kernel"][0]
