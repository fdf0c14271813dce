"""The extension's C++ raises through EXT_CHECK / EXT_CUBLAS_CHECK only (csrc/common/check.h): a TORCH_CHECK whose
message c10 joins with a std::ostringstream (a number, a shape, several strings) ended the process with a segmentation
fault on the GPU machines instead of raising. CPU only: reads the sources."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_RAW = re.compile(r"\b(TORCH_CHECK|TORCH_CUDABLAS_CHECK|TORCH_CHECK_\w+|AT_ERROR)\s*\(")


def _code_lines(path: Path):
    """(line number, text) of a source's lines with // comments dropped."""
    for no, line in enumerate(path.read_text().splitlines(), 1):
        yield no, line.split("//", 1)[0]


def test_no_raw_torch_check_in_the_extension():
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".cuh", ".h")]
    assert any(p.name == "bindings.cpp" for p in sources)
    raw = [f"{p.relative_to(CSRC)}:{no}: {text.strip()}" for p in sources if p.name != "check.h"
           for no, text in _code_lines(p) if _RAW.search(text)]
    assert not raw, "use EXT_CHECK / EXT_CUBLAS_CHECK (csrc/common/check.h):\n" + "\n".join(raw)


def test_the_check_finds_what_it_looks_for():
    for text in ('TORCH_CHECK(x > 0, "x: ", x);', "  TORCH_CUDABLAS_CHECK(cublasCreate(&h));", "AT_ERROR(\"bad\");"):
        assert _RAW.search(text), text
    for text in ('EXT_CHECK(x > 0, "x: ", x);', "EXT_CUBLAS_CHECK(cublasCreate(&h));"):
        assert not _RAW.search(text), text
