#!/usr/bin/env python3
"""Import-layering check: a lower floor of surogate_hf never imports a higher one at module level.

Floors, low to high (docs/architecture.md):
    0 formats        reference math, pure PyTorch
    1 ops            torch.library op declarations
    2 kernels        Triton / native implementations of the ops
    3 nn, recipes    modules (one floor: neither imports the other's internals at a lower level)
    4 integrations   transformers / peft / accelerate glue, plus config.py (SurogateConfig is a transformers
                     QuantizationConfigMixin) and training.py (prepare_for_training, a PEFT helper)
    5 cli, data      the command line and its generated task data
      testing        builders and fixtures shared by the tests (never imported by the package itself)
    6 surogate_hf    the package root (`__init__.py`): the public API over everything

Module level means what runs when the module is imported: imports inside functions (lazy, on first use) are
allowed, as are `if TYPE_CHECKING:` blocks. `ALLOWED` lists the documented exceptions, each with why.

Usage: python3 tools/check_layers.py [package_dir]   (exit status 1 and one line per violation when any)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FLOORS = {
    "formats": 0,
    "ops": 1,
    "kernels": 2,
    "nn": 3,
    "recipes": 3,
    "integrations": 4,
    "distributed": 4,
    "config": 4,
    "training": 4,
    "cli": 5,
    "data": 5,
    "testing": 5,
}
ROOT_FLOOR = 6
PACKAGE = "surogate_hf"

# (importing module, imported module) -> why the upward import is accepted. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {}

def floor_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise ValueError(module)
    if len(parts) == 1:
        return ROOT_FLOOR
    if parts[1] not in FLOORS:
        raise SystemExit(f"check_layers: {module} is on no floor; add {parts[1]!r} to FLOORS in {__file__}")
    return FLOORS[parts[1]]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module):
    """Import nodes executed at import time (not inside functions, not under `if TYPE_CHECKING`)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(node, importer: str, is_package: bool, known: set[str]) -> list[str]:
    """Fully qualified surogate_hf modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    out = []
    for alias in node.names:  # `from pkg import submodule` loads the submodule
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in known else target)
    return out


def check(root: Path) -> list[str]:
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    problems = []
    for path in files:
        importer = module_name(path, root)
        low = floor_of(importer)
        tree = ast.parse(path.read_text(), str(path))
        for node in module_level_imports(tree):
            for target in imported_modules(node, importer, path.name == "__init__.py", known):
                if target == PACKAGE and isinstance(node, ast.ImportFrom) and all(a.name == "__version__" for a in node.names):
                    continue  # the version string, defined before the root imports anything
                if floor_of(target) > low and (importer, target) not in ALLOWED:
                    problems.append(
                        f"{path}:{node.lineno}: {importer} (floor {low}) imports {target} (floor {floor_of(target)}) "
                        "at module level; import it inside the function that needs it, or move the code down"
                    )
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / PACKAGE)
    problems = check(root)
    for p in problems:
        print(p)
    print(f"check_layers: {len(problems)} violation(s) in {root}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
