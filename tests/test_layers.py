"""The import-layering check (tools/check_layers.py) passes on the package and catches an upward import."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_layers", REPO / "tools" / "check_layers.py")
check_layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layers)


def test_the_package_keeps_its_floors():
    assert check_layers.check(REPO / "surogate_hf") == []


def test_an_upward_module_level_import_is_caught_and_a_lazy_one_is_not(tmp_path):
    pkg = tmp_path / "surogate_hf"
    for sub in ("formats", "nn", "integrations"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import integrations\n")
    (pkg / "formats" / "fp8.py").write_text(
        "from ..nn import convert\n"  # upward at module level: caught
        "def lazy():\n    from ..integrations import peft\n"  # inside a function: allowed
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from surogate_hf.integrations import peft\n"
    )
    (pkg / "nn" / "convert.py").write_text("from surogate_hf import formats\nimport surogate_hf.integrations.peft\n")
    (pkg / "integrations" / "peft.py").write_text("from ..nn import convert\n")
    problems = check_layers.check(pkg)
    assert len(problems) == 2, problems
    assert "surogate_hf.formats.fp8 (floor 0) imports surogate_hf.nn.convert (floor 3)" in problems[0]
    assert "surogate_hf.nn.convert (floor 3) imports surogate_hf.integrations.peft (floor 4)" in problems[1]
