"""Shared helpers of the benchmark scripts: timing, tables, result files.

Timing: triton.testing.do_bench (CUDA events, L2 flushed between runs), median in ms. Every
setup runs in the same process as its peers; a setup that fails is reported with its error,
never dropped silently.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def device_name() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"


def bench_ms(fn, warmup=25, rep=100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def attempt(label: str, fn, errors: dict):
    """fn() or None; the error is kept for the table."""
    try:
        return fn()
    except Exception as exc:  # benchmarks report every failure in their table
        errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str) -> Path:
    """benchmarks/results/<name>.md (and a copy under $OUT when set); also printed."""
    text = f"# {title}\n\nDevice: {device_name()}\nDate: {datetime.date.today().isoformat()}\n\n{body}\n"
    print(text, flush=True)
    out = ROOT / "benchmarks" / "results" / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.md").write_text(text)
    return out
