"""``bench/`` is on the public API or on the internal names ``bench/README.md`` lists: every
``from eplb.<module> import <name>`` (and ``import eplb.<module>``) in a benchmark script is in that
list, and every listed name still exists."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import eplb

BENCH = Path(__file__).resolve().parents[2] / "bench"
ROW = re.compile(r"^\| `(eplb\.[\w.]+)` \| ([^|]+) \|", re.MULTILINE)


def documented() -> dict[str, set[str]]:
    rows = ROW.findall((BENCH / "README.md").read_text())
    return {module: set(re.findall(r"`([^`]+)`", names)) for module, names in rows}


def imported() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("eplb"):
                found |= {(path.name, node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {(path.name, alias.name, "(the module)") for alias in node.names
                          if alias.name.startswith("eplb.")}
    return found


def test_bench_imports_public_or_documented_names():
    listed = documented()
    assert listed  # the table parses
    undocumented = sorted((script, module, name) for script, module, name in imported()
                          if not (module == "eplb" and name in eplb.__all__) and name not in listed.get(module, ()))
    assert undocumented == []


def test_every_documented_name_exists():
    def exists(module: str, name: str) -> bool:
        if name == "(the module)" or hasattr(importlib.import_module(module), name):
            return True
        try:  # a submodule, e.g. eplb.planning.methods.exact_model
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            return False
        return True

    missing = [f"{module}.{name}" for module, names in documented().items() for name in names
               if not exists(module, name)]
    assert missing == []
